"""What training builds before its first step: the frozen target and a new drafter of the configured
architecture, the autocast dtype for each, and the draft vocabulary (the ids a drafter may propose)."""

from __future__ import annotations

from typing import Any

import torch

from shared.config import Config
from shared.records import TokenizedSample

from .data import SampleSet
from .drafters import new_drafter
from .features import Target
from .model import DFlashDrafter, dtype_name, feature_layer_ids, resolve_mask_token_id


def build(cfg: Config, device: str) -> tuple[Target, DFlashDrafter, Any]:
    from transformers import AutoConfig

    from shared.model import load_causal_lm, load_tokenizer, resolve_target

    t = cfg.trainer
    tok = load_tokenizer(cfg.model.target)
    lm = load_causal_lm(cfg.model.target, device=device)
    n = lm.config.num_hidden_layers
    if not 0 <= t.draft_vocab < lm.config.vocab_size:
        raise ValueError(f"trainer.draft_vocab = {t.draft_vocab}: 0 (off) or fewer than the target's "
                         f"{lm.config.vocab_size} ids")
    ids = list(t.target_layer_ids) or feature_layer_ids(n, t.num_feature_layers)
    on_disk = AutoConfig.from_pretrained(resolve_target(cfg.model.target), local_files_only=True)
    drafter = new_drafter(t, lm.config, num_layers=t.num_layers, block_size=t.block_size, layer_ids=ids,
                          mask_token_id=resolve_mask_token_id(tok, lm.config.vocab_size), serve_dtype=dtype_name(on_disk))
    if t.init == "target":
        drafter.init_from_target(lm.get_decoder().layers)
    drafter = drafter.to(device)
    return Target(lm, ids), drafter, tok


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast (the drafter's, or the target's training forward): "auto" on GPU, and on CPU where
    matmuls have bf16 units (AMX / AVX512-BF16, ~3× fp32 there; AVX2-only CPUs emulate bf16, ~7×
    slower than fp32); "off" keeps fp32, "bf16" forces it."""
    if setting == "off":
        return None
    if setting == "bf16" or device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None


def draft_vocab_ids(samples: SampleSet | list[TokenizedSample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids most frequent among the supervised tokens (ties to the lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.long)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts.index_add_(0, ids, torch.ones_like(ids))
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values

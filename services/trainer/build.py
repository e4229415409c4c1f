"""What training builds before its first step: the frozen target and a new drafter of the configured
architecture, the autocast dtype for each, and the draft vocabulary (the ids a drafter may propose)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

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
    """bf16 autocast (the drafter's, or the target's training forward): "auto" on GPU, and on CPU where a timed
    probe finds bf16 matmuls faster than fp32 (`bf16_is_faster`: AMX / AVX512-BF16 units, ~3× there; not where
    bf16 is emulated, ~7× slower: AVX2-only CPUs, or kernels restricted to AVX2); "off" keeps fp32, "bf16"
    forces it."""
    if setting == "off":
        return None
    if setting == "bf16" or device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and bf16_is_faster().faster else None


class Bf16Probe(NamedTuple):
    fp32_s: float  # best time of the probe's matmuls in fp32
    bf16_s: float  # the same under bf16 autocast
    faster: bool  # bf16 beat fp32 by the margin


BF16_MARGIN = 1.2  # bf16 must be this much faster: autocast's casts cost something a tie does not repay


@functools.cache
def bf16_is_faster() -> Bf16Probe:
    """Whether bf16 matmuls are faster than fp32 on this CPU, as timed (once per process, 0.1-1 s): by what runs,
    not by a CPU flag, so that kernels restricted to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) or a CPU that
    emulates bf16 keep fp32. The shape is a training forward's (a thousand tokens through a 576-wide MLP
    projection, SmolLM2-135M's); the best of several interleaved rounds, so a busy machine's noise decides little."""
    import time

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1024, 576, generator=g), torch.randn(1536, 576, generator=g)

    def timed(dtype: torch.dtype | None) -> float:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            return time.perf_counter() - t0

    timed(None), timed(torch.bfloat16)  # warm both kernels up
    fp32 = bf16 = float("inf")
    for _ in range(5):
        fp32, bf16 = min(fp32, timed(None)), min(bf16, timed(torch.bfloat16))
    return Bf16Probe(fp32, bf16, bf16 * BF16_MARGIN < fp32)


def draft_vocab_ids(samples: SampleSet | list[TokenizedSample], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` ids most frequent among the supervised tokens (ties to the lower id), sorted."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor(s.input_ids, dtype=torch.long)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts.index_add_(0, ids, torch.ones_like(ids))
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:size]).values

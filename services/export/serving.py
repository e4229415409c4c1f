"""What the serving engines read from a DFlash drafter's config.json, and the commands that serve one.

The one place the model card's key table, its serving commands and the exported-directory tests take these
facts from. Sources, as read (never copied) with the search tool:
- z-lab's reference `dflash==0.1.0`, dflash/model.py: `DFlashDraftModel.compute_logits` multiplies the LM head's
  logits by `output_multiplier` (default 1.0) and soft-caps them when `final_logit_softcapping` is set and > 0;
  `dflash_generate` scales the block embedding by `input_embedding_scale` (default 1.0); each is read from
  `dflash_config` first, then the top level.
- vLLM vllm/model_executor/models/qwen3_dflash2.py (@030da624): `DFlash2Qwen3ForCausalLM` reads
  `dflash_config.output_multiplier` (default 1.0) and `dflash_config.final_logit_softcapping` (absent, null or 0:
  off), `DFlash2Qwen3Model` reads `dflash_config.input_embedding_scale` (default 1.0), `selector_rank`,
  `selector_top_k`, and each layer `conv_kernel_size`, `conv_group_size`; the conv's block is
  1 + `num_speculative_tokens`, so that must be block_size − 1. DFlash keys: qwen3_dflash.py (@036a00d1), see
  tests/test_interop.py's contract test.
- SGLang python/sglang/srt/speculative/dflash_utils.py (`parse_dflash_draft_config`, @00731f0b) and
  python/sglang/srt/models/dflash.py (@003b23d7): `num_hidden_layers`, `num_target_layers` and `block_size`
  (dflash_config first, then top level), `dflash_config.target_layer_ids` (absent: its own layer rule,
  sgl-project/sglang#37475), `mask_token_id`, `layer_types` (+ `sliding_window`), rope settings.
- SGLang's DFlash 2 (`DFlash2DraftModel` in models/dflash.py, sgl-project/sglang#35371, merged 2026-08-19, in
  0.5.19): the same parser (@00731f0b already holds its fields) reads from `dflash_config` only
  `conv_kernel_size` and `conv_group_size` (both set or both 0; the group divides hidden_size),
  `selector_rank` and `selector_top_k` (DFlash2DraftModel refuses 0), `output_multiplier` (> 0; applied to
  the target head's top-K logits only when != 1.0) and `final_logit_softcapping` (`v or 0.0`, a cap only when
  > 0, as vLLM). It does not read `input_embedding_scale` (its block-embedding scale comes from a target-model
  hook no model defines: 1.0, which is what we write and train) nor `draft_vocab_size`; it uses the target's
  LM head, and taps `target_layer_ids` as layer outputs (it captures the input of layer id + 1), as the
  trainer does. Read in the search index's post-merge copies of models/dflash.py (the exact v0.5.19 tag was
  not readable here), 2026-12-07.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

# The values under which the reference and vLLM compute exactly what the trainer trained: the trainer applies
# no logit multiplier, no soft cap and no embedding scale (services/trainer/model.py `propose`), so these make
# the engines do the same. Written explicitly: an engine's default could change, a stated value cannot.
DFLASH2_IDENTITY_KEYS: dict[str, float] = {
    "output_multiplier": 1.0,  # logits × 1
    "final_logit_softcapping": 0.0,  # 0: no soft cap (the reference: "> 0" enables; vLLM: "or 0.0", "> 0")
    "input_embedding_scale": 1.0,  # block embedding × 1
}

# Minimum engine releases per architecture, and what that rests on.
MIN_RELEASES: dict[str, dict[str, str]] = {
    "DFlashDraftModel": {
        "sglang": "0.5.11 (`--speculative-algorithm DFLASH`; issue 34 of this project; compose pins 0.5.19)",
        "vllm": "0.28.0 (`method: dflash`; the release NVIDIA NeMo's DFlash serving guide pins; earlier ones not "
                "checked here)",
    },
    "DFlash2DraftModel": {
        "sglang": "0.5.19 (`DFlash2DraftModel` under the same `--speculative-algorithm DFLASH`, "
                  "sgl-project/sglang#35371)",
        "vllm": "0.28.0 (`DFlash2DraftModel`, vllm/model_executor/models/qwen3_dflash2.py; the release NVIDIA "
                "NeMo's DFlash/DFlash2 serving guide pins; earlier ones not checked here)",
    },
}

# key (dotted into dflash_config) -> who reads it
_COMMON_KEYS: list[tuple[str, str]] = [
    ("architectures", "SGLang, vLLM, reference: the model class"),
    ("model_type", "transformers' config class (qwen3)"),
    ("num_hidden_layers", "SGLang, vLLM: draft layers"),
    ("hidden_size", "SGLang, vLLM"),
    ("intermediate_size", "SGLang, vLLM"),
    ("num_attention_heads", "SGLang, vLLM"),
    ("num_key_value_heads", "SGLang, vLLM"),
    ("head_dim", "SGLang, vLLM"),
    ("hidden_act", "SGLang (silu only), vLLM"),
    ("rms_norm_eps", "SGLang, vLLM"),
    ("vocab_size", "vLLM (draft_vocab_size absent: the target's head)"),
    ("max_position_embeddings", "SGLang, vLLM: RoPE table"),
    ("rope_parameters", "vLLM (absent: theta 1e6), SGLang get_rope_config"),
    ("attention_bias", "SGLang, vLLM"),
    ("is_causal", "vLLM: bidirectional inside the block"),
    ("layer_types", "SGLang, vLLM: full or sliding attention per layer"),
    ("sliding_window", "SGLang, vLLM: only with sliding layers"),
    ("num_target_layers", "SGLang (after dflash_config.num_target_layers)"),
    ("torch_dtype", "SGLang, vLLM `--dtype auto`"),
    ("dflash_config.block_size", "SGLang (before the top level); must equal --speculative-dflash-block-size"),
    ("dflash_config.num_target_layers", "SGLang"),
    ("dflash_config.target_layer_ids", "SGLang, vLLM (+1: it taps a layer's input), reference"),
    ("dflash_config.mask_token_id", "SGLang, vLLM, reference"),
]
_DFLASH2_KEYS: list[tuple[str, str]] = [
    ("dflash_config.conv_kernel_size", "SGLang, vLLM, reference"),
    ("dflash_config.conv_group_size", "SGLang, vLLM, reference"),
    ("dflash_config.selector_rank", "SGLang, vLLM, reference"),
    ("dflash_config.selector_top_k", "SGLang, vLLM, reference"),
    ("dflash_config.output_multiplier", "SGLang, vLLM, reference: top-K logits × this"),
    ("dflash_config.final_logit_softcapping", "SGLang, vLLM, reference: tanh soft cap when > 0"),
    ("dflash_config.input_embedding_scale", "vLLM, reference: block embedding × this (SGLang: always 1.0)"),
]


def architecture(config: dict[str, Any]) -> str:
    return (config.get("architectures") or ["?"])[0]


def served_config(config: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's config.json as exported: DFlash 2's logit and embedding keys stated explicitly."""
    out = json.loads(json.dumps(config))
    if architecture(out) == "DFlash2DraftModel":
        dc = out.setdefault("dflash_config", {})
        for key, value in DFLASH2_IDENTITY_KEYS.items():
            dc.setdefault(key, value)
    return out


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def engine_keys(config: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """(key, value in this config, who reads it) for every key the engines' parsers read for its architecture."""
    keys = _COMMON_KEYS + (_DFLASH2_KEYS if architecture(config) == "DFlash2DraftModel" else [])
    return [(k, _lookup(config, k), who) for k, who in keys]


def serve_commands(target: str, drafter_dir: str, block_size: int) -> dict[str, str]:
    """The command lines that serve `target` with this drafter (SGLang, vLLM)."""
    spec = json.dumps({"method": "dflash", "model": drafter_dir, "num_speculative_tokens": block_size - 1})
    return {
        "sglang": " ".join([
            "python3 -m sglang.launch_server", "--model-path", shlex.quote(target),
            "--speculative-algorithm DFLASH", "--speculative-draft-model-path", shlex.quote(drafter_dir),
            f"--speculative-dflash-block-size {block_size}"]),
        "vllm": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
    }

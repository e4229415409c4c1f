"""The DFlash drafter: a few Llama/Qwen3-style decoder layers that denoise a block of mask tokens
in one pass, conditioned on the target's hidden states by KV injection.

Shapes: D hidden size, k feature layers, C context positions, Q = n_blocks·B query positions.
- fuse:   concat of k target layers [C, k·D] → Linear(k·D → D, no bias) → RMSNorm → context [C, D]
- layer:  Q from the block tokens only; K = [k_proj(context); k_proj(block)], V likewise, so the
          block attends to the target's features of the context and (bidirectionally) to itself.
- head:   the target's own embedding and LM head, frozen, not part of this module's weights.

The checkpoint layout follows the public DFlash drafters: `config.json` with
`architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`, explicit `is_causal: false`,
`layer_types` and `rope_parameters`, `dflash_config: {mask_token_id, target_layer_ids, block_size,
num_target_layers}` and Qwen3-style layer names in
`model.safetensors` (`layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`, `norm`, `fc`, `hidden_norm`).

A draft vocabulary (`trainer.draft_vocab = K`, off by default) restricts the drafter's proposals to
the K tokens most frequent in the training labels, as EAGLE-3's: the frozen head's cost falls by V/K
in training and drafting, and nothing else changes (the target verifies every proposal). It adds
`dflash_config.draft_vocab_size` and a `draft_vocab` [K] id tensor to the checkpoint, which no engine
serves as written. SGLang's DFlash has no head of its own (it drafts through the target's `lm_head` and drops
unknown tensors) and the reference reads no draft vocabulary: both propose over the whole vocabulary. vLLM's
`qwen3_dflash.py` would serve it in another layout — a top-level `draft_vocab_size`, an `lm_head.weight` [K, H]
of its own and `d2t` [K] offsets (target id − i, EAGLE-3's) — which `dfpipe export` does not write yet; DFlash 2
takes no reduced vocabulary anywhere. So the demo, which must serve in SGLang, keeps the whole vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def feature_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """The paper's rule: k layers spread from layer 1 to layer N−3, `round(1 + i·(N−4)/(k−1))` (half up)."""
    if k == 1:
        return [1]
    return [math.floor(1 + i * (num_target_layers - 4) / (k - 1) + 0.5) for i in range(k)]


SGLANG_MASK_TOKEN = "<|MASK|>"  # SGLang refuses a drafter whose mask id differs from this token's, if it exists


def resolve_mask_token_id(tokenizer: Any, vocab_size: int) -> int:
    """An id that already exists in the target's embedding, in this order: `<|MASK|>` when the vocabulary
    has it (SGLang's DFlash loader requires it then), the tokenizer's mask token, its pad token when it
    differs from eos, then unk, then eos (e.g. SmolLM2: unk `<|endoftext|>`)."""
    candidates = [(tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}).get(SGLANG_MASK_TOKEN),
                  getattr(tokenizer, "mask_token_id", None)]
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    candidates += [pad if pad != eos else None, getattr(tokenizer, "unk_token_id", None), eos]
    for c in candidates:
        if c is not None and 0 <= int(c) < vocab_size:
            return int(c)
    raise ValueError("no usable mask token id: the tokenizer has no mask, pad, unk or eos token")


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    draft_vocab_size: int = 0  # 0: proposals over the target's whole vocabulary
    # The dtype an engine serves the drafter in: the target's, so that `--dtype auto` gives both one dtype
    # (SGLang maps a float32 config to float16, a bfloat16 one to bfloat16). The stored tensors stay
    # float32 (exact resume); engines cast them on load.
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)

    ARCHITECTURE = "DFlashDraftModel"  # config.json's `architectures`
    DFLASH_KEYS = ("mask_token_id", "target_layer_ids")  # what a checkpoint's `dflash_config` must hold

    # What the weights' meaning depends on: a resume under other values would load the tensors into a model
    # that reads them differently (block size, feature layers) or fail on a shape deep in load_state_dict.
    SHAPE = ("block_size", "target_layer_ids", "num_hidden_layers", "hidden_size", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")

    def shape_differences(self, other: DFlashConfig) -> list[str]:
        """'name: ours → other's' for each SHAPE field that differs."""
        return [f"{k}: {getattr(self, k)} → {getattr(other, k)}" for k in self.SHAPE if getattr(self, k) != getattr(other, k)]

    def to_hf(self) -> dict[str, Any]:
        """config.json in the public DFlash drafters' layout."""
        d = asdict(self)
        ids, mask, draft_vocab = d.pop("target_layer_ids"), d.pop("mask_token_id"), d.pop("draft_vocab_size")
        d.pop("extra")
        # Engines guess what a config leaves out, and differently: vLLM defaults rope_theta to 1e6 and reads
        # causality as is_causal → dflash_config.causal → "sliding layers are causal"; SGLang reads block_size
        # and num_target_layers from dflash_config before the top level. So every such key is stated, in both places.
        dflash = {"mask_token_id": mask, "target_layer_ids": ids, "block_size": d["block_size"],
                  "num_target_layers": d["num_target_layers"]}
        if draft_vocab:
            dflash["draft_vocab_size"] = draft_vocab
        attention = {"is_causal": False, "layer_types": ["full_attention"] * d["num_hidden_layers"],
                     "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_theta"]}}
        return {"architectures": [self.ARCHITECTURE], "model_type": "qwen3", "hidden_act": "silu", **d, **attention,
                "dflash_config": dflash, **self.extra}

    @classmethod
    def for_target(cls, target_config: Any, *, num_layers: int, block_size: int, layer_ids: list[int],
                   mask_token_id: int, serve_dtype: str | None = None) -> DFlashConfig:
        """The config of a drafter for this target (its HF config). `serve_dtype`: the dtype the target is
        served in (its config.json's; the in-memory config of a target loaded for training says the training
        dtype); default: `target_config`'s."""
        t = target_config
        rope_params = getattr(t, "rope_parameters", None) or {}
        theta = rope_params.get("rope_theta", getattr(t, "rope_theta", 10000.0))
        heads = t.num_attention_heads
        return cls(
            hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", heads),
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, vocab_size=t.vocab_size,
            block_size=block_size, num_target_layers=t.num_hidden_layers, target_layer_ids=layer_ids,
            mask_token_id=mask_token_id, rms_norm_eps=t.rms_norm_eps, rope_theta=float(theta),
            max_position_embeddings=getattr(t, "max_position_embeddings", 8192), torch_dtype=serve_dtype or dtype_name(t),
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> DFlashConfig:
        fields = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("extra",)}
        fields["target_layer_ids"] = d["dflash_config"]["target_layer_ids"]
        fields["mask_token_id"] = d["dflash_config"]["mask_token_id"]
        fields["draft_vocab_size"] = d["dflash_config"].get("draft_vocab_size", 0)
        return cls(**fields)


def dtype_name(target_config: Any) -> str:
    """The target config's dtype as config.json spells it ("bfloat16" when it names none)."""
    dtype = getattr(target_config, "dtype", None) or getattr(target_config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return name if name in ("bfloat16", "float16", "float32") else "bfloat16"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split layout (as Llama/Qwen3). x [H, T, hd], pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = pos.float()[:, None] * inv[None, :]  # [T, hd/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype), torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, q_pos: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        # x [Q, D] block tokens, ctx [C, D] fused context, mask [Q, C+Q] True = may attend
        c = self.c
        hq, hk, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = self.q_norm(self.q_proj(x).view(-1, hq, hd)).transpose(0, 1)  # [Hq, Q, hd]
        kv_in = torch.cat([ctx, x], 0)  # [C+Q, D]: KV injection
        k = self.k_norm(self.k_proj(kv_in).view(-1, hk, hd)).transpose(0, 1)  # [Hk, C+Q, hd]
        v = self.v_proj(kv_in).view(-1, hk, hd).transpose(0, 1)
        kv_pos = torch.cat([ctx_pos, q_pos])
        q, k = rope(q, q_pos, c.rope_theta), rope(k, kv_pos, c.rope_theta)
        rep = hq // hk
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # GQA
        # a batch of one: 4-D inputs take the fused (flash) CPU kernel, 3-D ones the unfused math path
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None])[0]  # [Hq, Q, hd]
        return self.o_proj(y.transpose(0, 1).reshape(-1, hq * hd))


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, ctx, q_pos, ctx_pos, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, ctx_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    layer_class: type[nn.Module] = DecoderLayer  # DFlash 2 swaps in its layer and config (model_dflash2.py)
    config_class: type[DFlashConfig] = DFlashConfig

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.config = c
        k = len(c.target_layer_ids)
        self.fc = nn.Linear(k * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.register_buffer("draft_vocab", None)  # [K] ids when proposals are restricted
        if c.draft_vocab_size:
            self.set_draft_vocab(torch.zeros(c.draft_vocab_size, dtype=torch.long))

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Restrict proposals to these target token ids (sorted, unique; stored with the weights)."""
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if len(ids) == 0 or len(ids) >= self.config.vocab_size:
            raise ValueError(f"a draft vocabulary has 1 to {self.config.vocab_size - 1} ids, not {len(ids)}")
        self.config.draft_vocab_size = len(ids)
        self.register_buffer("draft_vocab", ids.to(self.fc.weight.device))

    def vocab_rows(self, labels: torch.Tensor) -> torch.Tensor:
        """Target token ids → rows of `head_rows` (−1 where a label is outside the draft vocabulary)."""
        if self.draft_vocab is None:
            return labels
        row = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=labels.device)
        row[self.draft_vocab.to(labels.device)] = torch.arange(len(self.draft_vocab), device=labels.device)
        return row[labels]

    def head_rows(self, head: torch.Tensor) -> torch.Tensor:
        """The rows of the target's LM head weight [V, D] this drafter proposes from: [K, D], or all."""
        return head if self.draft_vocab is None else head.index_select(0, self.draft_vocab.to(head.device))

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy proposals [Q] for hidden rows [Q, D] through the target's LM head (restricted, if set).
        `anchor` (the block's first token) is unused here: DFlash drafts each slot alone, DFlash 2 walks from it."""
        if self.draft_vocab is None:
            return lm_head(hidden).argmax(-1)
        bias = getattr(lm_head, "bias", None)
        logits = F.linear(hidden, self.head_rows(lm_head.weight), None if bias is None else bias[self.draft_vocab])
        return self.draft_vocab[logits.argmax(-1)]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))  # [C, k·D] → [C, D]

    def forward(self, block_emb: torch.Tensor, features: torch.Tensor, q_pos: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """block_emb [Q, D] (target embeddings of anchor + mask tokens), features [C, k·D] → hidden [Q, D]."""
        ctx = self.fuse(features)
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, q_pos, ctx_pos, mask)
        return self.norm(x)

    @torch.no_grad()
    def init_from_target(self, target_layers: Any) -> None:
        """Start from the target's own computation above the deepest feature layer instead of noise.

        From random weights a short run spends most of its time on a plateau of context-free guesses;
        here the fused context starts as the deepest feature layer's output, normalised as the target
        layer above it normalises its input, and drafter layer i starts as a copy of target layer
        deepest+1+i (matching parameter names and shapes; anything without a counterpart stays random).
        The final norm stays at ones: a copy of the target's makes confident wrong logits at the start.
        """
        c = self.config
        deepest = max(c.target_layer_ids)
        slot, D = c.target_layer_ids.index(deepest), c.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, slot * D:(slot + 1) * D] = torch.eye(D)
        above = [target_layers[i] for i in range(deepest + 1, len(target_layers))]
        if above and hasattr(above[0], "input_layernorm"):
            self.hidden_norm.weight.copy_(above[0].input_layernorm.weight)
        for layer, source in zip(self.layers, above, strict=False):
            theirs = source.state_dict()
            for name, p in layer.state_dict(keep_vars=True).items():
                if name in theirs and theirs[name].shape == p.shape:
                    p.copy_(theirs[name])

    @classmethod
    def for_target(cls, target_config: Any, **kw: Any) -> DFlashDrafter:
        """A drafter for this target: DFlashConfig.for_target's keywords."""
        return cls(DFlashConfig.for_target(target_config, **kw))

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  directory / "model.safetensors", metadata={"format": "pt"})

    @classmethod
    def load(cls, directory: Path) -> DFlashDrafter:
        from safetensors.torch import load_file

        model = cls(cls.config_class.from_hf(json.loads((directory / "config.json").read_text())))
        model.load_state_dict(load_file(directory / "model.safetensors"))
        return model

"""The DFlash 2 drafter ("Keep Drafting Parallel"): the DFlash drafter of model.py plus, in every layer,
a grouped dynamic causal convolution around the attention and the MLP sublayers, and a candidate
selector that walks the drafter's top-K tokens from the anchor.

Notation: Q = n·B block positions (n blocks of B slots), D hidden size, G = D / conv_group_size
channel groups, K' = conv_kernel_size taps, r = selector_rank, K = selector_top_k, V vocabulary.

- Convolution, inside one block only (causal over its slots, zeros before slot 0; the context is not
  convolved): out[t] = Σ_{o<K'} (base[o] + dyn[t, o, g(c)]) · x[t−o], channel c in group g(c). `base`
  [K', D] is a static per-channel kernel, `dyn` [Q, K', G] a per-position correction that one linear
  map makes from the sublayer's (normed) input, shared by the channels of a group. Each layer has two
  such convolutions, one around attention and one around the MLP; each is split in two: `prepare`
  convolves the sublayer's input, `finish` its output with a second kernel made from the same input:

      x ─┬─ norm ─┬─ prepare ── attention ── finish ──(+)──┬─ norm ─┬─ prepare ── MLP ── finish ──(+)──
         │        └────────── dyn (finish half) ──┘     │     │        └───── dyn (finish half) ──┘   │
         └──────────────────────────────────────────────┘     └───────────────────────────────────────┘

- Selector: per slot t the drafter's top-K candidates c_{t,1..K} and their logits; from the anchor
  a_0, the walk picks a_t = argmax_k logit_t(c_{t,k}) + ⟨A[a_{t−1}] ⊙ H h_t, Bc[c_{t,k}]⟩, with
  predecessor/successor codebooks A, Bc [V, r] and H [r, D] a projection of the slot's hidden state.
  With a zero H the walk is DFlash's own argmax; training moves it from there.

Checkpoint: `architectures: ["DFlash2DraftModel"]`, `dflash_config` adds `conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k`; tensors `layers.N.{attention,mlp}_conv.base_kernel`
[2, K', D] (prepare's kernel, finish's) and `.kernel_projection.weight` [2·K'·G, D] (its rows are
(half, tap, group) in that order), `candidate_selector.hidden_projection.weight` [r, D] and the
codebooks as bare tensors `candidate_selector.{predecessor,successor}_codebook` [V, r] (no `.weight`:
the reference maps those names onto its embedding modules when loading).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .model import DecoderLayer, DFlashConfig, DFlashDrafter


@dataclass
class DFlash2Config(DFlashConfig):
    # The released DFlash 2 drafters' values (block 8, top-16, rank 256, 2 taps, groups of 16).
    conv_kernel_size: int = 2  # taps: each slot mixes in the previous conv_kernel_size − 1 slots of its block
    conv_group_size: int = 16  # channels that share one dynamic kernel; divides hidden_size
    selector_rank: int = 256  # width of the predecessor/successor codebooks
    selector_top_k: int = 16  # candidates per slot the walk chooses among (the right token is in the top 16 ~99.5%)

    ARCHITECTURE = "DFlash2DraftModel"
    SELECTOR_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    DFLASH_KEYS = DFlashConfig.DFLASH_KEYS + SELECTOR_KEYS
    SHAPE = DFlashConfig.SHAPE + SELECTOR_KEYS

    def __post_init__(self) -> None:
        for name in self.SELECTOR_KEYS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: must be at least 1")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size = {self.conv_group_size} does not divide hidden_size = {self.hidden_size}")
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k = {self.selector_top_k} exceeds vocab_size = {self.vocab_size}")

    def to_hf(self) -> dict[str, Any]:
        d = super().to_hf()
        d["dflash_config"].update({k: d.pop(k) for k in self.SELECTOR_KEYS})
        return d

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> DFlash2Config:
        return cls(**vars(DFlashConfig.from_hf(d)), **{k: int(d["dflash_config"][k]) for k in cls.SELECTOR_KEYS})


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Causal convolution of each block over its slots. x [n, B, D], dynamic [n, B, K', G], base [K', D]
    → [n, B, D]; out[t] = Σ_o (base[o] + dynamic[t, o] per group) · x[t − o], zero before slot 0."""
    _, B, D = x.shape
    group = D // dynamic.shape[-1]
    out = torch.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = F.pad(x, (0, 0, o, 0))[:, :B]  # x[t − o]: shifted down o slots within the block
        kernel = base[o].to(x.dtype) + dynamic[:, :, o].repeat_interleave(group, -1)  # [n, B, D]
        out = out + kernel * shifted
    return out


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, c: DFlash2Config) -> None:
        super().__init__()
        self.block_size, self.taps = c.block_size, c.conv_kernel_size
        self.groups = c.hidden_size // c.conv_group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, c.hidden_size))  # [prepare|finish, K', D]
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # starts as the identity: the layer is DFlash's until trained
        self.kernel_projection = nn.Linear(c.hidden_size, 2 * self.taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [Q, D] the sublayer's input → (its convolution [Q, D], finish's dynamic kernel [n, B, K', G])."""
        blocks = x.view(-1, self.block_size, x.shape[-1])  # [n, B, D]: no slot sees another block
        dynamic = self.kernel_projection(blocks).view(*blocks.shape[:2], 2, self.taps, self.groups)  # [n, B, 2, K', G]
        return grouped_dynamic_conv(blocks, dynamic[:, :, 0], self.base_kernel[0]).view_as(x), dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """y [Q, D] the sublayer's output → its convolution with prepare's second kernel [Q, D]."""
        return grouped_dynamic_conv(y.view(-1, self.block_size, y.shape[-1]), dynamic, self.base_kernel[1]).view_as(y)


class DecoderLayer2(DecoderLayer):
    def __init__(self, c: DFlash2Config) -> None:
        super().__init__(c)  # model.py's norms, attention and MLP
        self.attention_conv = GroupedDynamicCausalConv(c)
        self.mlp_conv = GroupedDynamicCausalConv(c)

    def forward(self, x, ctx, q_pos, ctx_pos, mask):
        h, dyn = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, q_pos, ctx_pos, mask), dyn)
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dyn)


class CandidateSelector(nn.Module):
    def __init__(self, c: DFlash2Config) -> None:
        super().__init__()
        self.top_k = c.selector_top_k
        scale = c.selector_rank ** -0.25  # ⟨A ⊙ Hh, Bc⟩ of order |Hh| once H is trained
        self.predecessor_codebook = nn.Parameter(torch.randn(c.vocab_size, c.selector_rank) * scale)  # A [V, r]
        self.successor_codebook = nn.Parameter(torch.randn(c.vocab_size, c.selector_rank) * scale)  # Bc [V, r]
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)  # H
        nn.init.zeros_(self.hidden_projection.weight)  # starts as the plain argmax over the candidates

    def pair_scores(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """⟨A[previous] ⊙ H hidden, Bc[candidates]⟩: hidden [N, D], previous [N], candidates [N, K] → [N, K]."""
        query = self.predecessor_codebook[previous] * self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # [N, r]
        return torch.einsum("nr,nkr->nk", query, self.successor_codebook[candidates])

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One block's drafts: hidden [T, D] and logits [T, V] of slots 1..T, anchor [] the block's first token
        → (tokens [T], candidates [T, K], q [T, K] or None). Greedy (temperature 0) takes each slot's best
        candidate after the one taken before it; sampling draws from q = softmax(score / temperature) over
        the candidates, the proposal distribution a lossless rejection step needs."""
        unary, candidates = logits.float().topk(self.top_k, -1)  # [T, K] each
        previous, tokens, q_rows = anchor.reshape(1), [], []
        for t in range(hidden.shape[0]):
            scores = unary[t] + self.pair_scores(hidden[t:t + 1], previous, candidates[t:t + 1])[0]  # [K]
            if temperature > 0:
                q = torch.softmax(scores / temperature, -1)
                pick = torch.multinomial(q, 1, generator=generator)[0]
                q_rows.append(q)
            else:
                pick = scores.argmax()
            previous = candidates[t, pick].reshape(1)
            tokens.append(previous)
        return torch.cat(tokens), candidates, torch.stack(q_rows) if q_rows else None

    def loss(self, hidden: torch.Tensor, previous: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
             labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Teacher-forced selector loss: Σ w·CE over the K candidates of each row with the gold label.
        hidden [N, D], previous [N] (the gold token one slot earlier, the anchor for slot 1), unary [N, K]
        and candidates [N, K] the drafter's top-K (detached), labels [N], weights [N]
        → (Σ w·CE as an fp32 scalar, the walk step's hit [N], gold among the candidates [N]).

        A row whose gold token is not among its candidates is left out of this loss (it still has the
        DFlash loss, whose gradient is what brings the gold token into the top K). At decode time no
        choice among the candidates can draft that slot right, so the selector has nothing to learn
        there; forcing the gold token in would train it on a candidate set the walk never sees, and
        teach the codebooks to lift tokens that the head ranks below the top K. The predecessor is
        the gold token because only a walk whose earlier steps were right is still accepted."""
        scores = unary + self.pair_scores(hidden, previous, candidates)  # [N, K] fp32
        is_gold = candidates == labels[:, None]
        found = is_gold.any(-1)
        ce = F.cross_entropy(scores, is_gold.float().argmax(-1), reduction="none")
        total = (ce * weights * found).sum()
        hits = found & (scores.argmax(-1) == is_gold.float().argmax(-1))
        return total, hits, found


class DFlash2Drafter(DFlashDrafter):
    layer_class = DecoderLayer2
    config_class = DFlash2Config

    def __init__(self, c: DFlash2Config) -> None:
        super().__init__(c)
        self.candidate_selector = CandidateSelector(c)

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        raise ValueError("a draft vocabulary (trainer.draft_vocab) is not available for DFlash 2 drafters: the "
                         "selector's codebooks are over the target's whole vocabulary, as the reference's")

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy drafts [T] for slots 1..T (hidden [T, D]) by the selector's walk from the block's `anchor`."""
        if anchor is None:
            raise ValueError("a DFlash 2 drafter walks from the block's anchor token: pass anchor=")
        return self.candidate_selector.walk(hidden, lm_head(hidden), anchor)[0]

    def sample(self, hidden: torch.Tensor, lm_head: nn.Module, anchor: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts [T] by the selector's walk, and their proposal distribution q [T, V] over the whole
        vocabulary: row t is the walk's softmax over slot t's candidates given the draft drawn before it (0
        outside them), which is what lossless rejection sampling needs of a chain of dependent drafts."""
        tokens, candidates, q_top = self.candidate_selector.walk(hidden, lm_head(hidden), anchor, temperature, generator)
        q = torch.zeros(hidden.shape[0], self.config.vocab_size, device=hidden.device)
        return tokens, q.scatter_(1, candidates, q_top)

    @classmethod
    def for_target(cls, target_config: Any, *, conv_kernel_size: int = 2, conv_group_size: int = 16,
                   selector_rank: int = 256, selector_top_k: int = 16, **kw: Any) -> DFlash2Drafter:
        """DFlashDrafter.for_target's drafter with the DFlash 2 parts (same keywords, plus these four)."""
        c = DFlashConfig.for_target(target_config, **kw)
        return cls(DFlash2Config(**vars(c), conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                                 selector_rank=selector_rank, selector_top_k=selector_top_k))

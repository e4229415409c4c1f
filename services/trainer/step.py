"""One optimizer step of the drafter, as plain torch (no bus, no S3, no asyncio).

One optimizer step = `grad_accum` micro-batches (per rank) of whole sequences up to `token_budget` tokens.
The loss is Σ w·CE / Σ w over the whole step: the weights do not depend on the model, so the step's
weight sum is known before any forward and every micro-batch backpropagates its share. Anchors are drawn
from a generator seeded by (seed, step, sequence), so every rank, and a resumed run, draws exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from shared.config import TrainerConfig
from shared.records import TokenizedSample

from .blocks import Blocks, label_states, make_blocks, sample_anchors
from .dist import Dist
from .features import Target
from .loss import head_cross_entropy, head_cross_entropy_top_k
from .model import DFlashDrafter
from .model_dflash2 import DFlash2Drafter

Microbatch = list[tuple[int, TokenizedSample]]  # (position in the pass's order, sample)

# The step's parts, as torch.profiler ranges (free when no profiler runs; bench/train_speed.py sums them). The
# head's gradient is computed in its forward (services/trainer/loss.py), so "head + CE" holds the head's whole
# cost and "backward" the drafter's (and the selector's).
PHASES = ("target forward", "drafter forward", "head + CE", "selector", "backward", "optimizer")


def sequence_blocks(sample: TokenizedSample, anchors_n: int, seed: int, step: int, index: int, max_length: int,
                    block_size: int, mask_token_id: int) -> Blocks | None:
    """One sequence's blocks for this step (None: no anchor). The anchors are drawn from (seed, step,
    index), so every rank, and a resumed run, draws the same ones."""
    ids = torch.tensor(sample.input_ids[:max_length], dtype=torch.long)
    mask = torch.tensor(sample.loss_mask[:max_length], dtype=torch.long)
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + index)
    anchors = sample_anchors(mask, anchors_n, g)
    return make_blocks(ids, mask, anchors, block_size, mask_token_id) if len(anchors) else None


def sequence_loss(target: Target, drafter: DFlashDrafter, b: Blocks, chunk: int, scale: float, stats: dict,
                  amp: torch.dtype | None, feats: torch.Tensor, final: torch.Tensor | None = None,
                  selector_weight: float = 1.0) -> None:
    """Drafter forward + backward of one sequence's blocks; adds to stats (loss numerator, per-slot hits).
    `feats` [S, k·D] come from the caller's batched target forward (in the target's dtype, fp32 on
    CPU); `amp` autocasts the drafter, and the head runs in that dtype. With the target's final hidden
    states `final` [S, D], each label is the target's distribution at the position before it. A DFlash 2
    drafter adds `selector_weight` × its selector loss over the head's top-K (CandidateSelector.loss),
    and its hits are the selector's (what its walk would draft)."""
    c = drafter.config
    device = next(drafter.parameters()).device
    S, q_pos = feats.shape[0], b.q_pos.to(device)
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None), \
            record_function(PHASES[1]):
        emb = target.embed(b.block_ids.to(device))
        hidden = drafter(emb, feats, q_pos, torch.arange(S, device=device), b.mask.to(device))
    head = drafter.head_rows(target.head_weight(amp or hidden.dtype))
    w = b.weights.to(device)
    keep = torch.nonzero(w > 0).flatten()
    rows = drafter.vocab_rows(b.labels.to(device)[keep])
    teacher = None if final is None else label_states(final, q_pos[keep])
    if isinstance(drafter, DFlash2Drafter):
        selector = drafter.candidate_selector
        with record_function(PHASES[2]):
            total, _, top_values, top_ids = head_cross_entropy_top_k(hidden[keep].to(head.dtype), head, rows,
                                                                     w[keep], selector.top_k, chunk, teacher)
        labels = b.labels.to(device)  # slot k−1's label is slot k's predecessor (slot 0's: the anchor itself)
        with record_function(PHASES[3]):
            picked, hits, _ = selector.loss(hidden[keep], labels[keep - 1], top_values, top_ids, labels[keep],
                                            w[keep])
        total = total + selector_weight * picked
    elif drafter.draft_vocab is None:
        with record_function(PHASES[2]):
            total, hits = head_cross_entropy(hidden[keep].to(head.dtype), head, rows, w[keep], chunk, teacher)
    else:  # labels outside the draft vocabulary cannot be proposed: out of the loss, counted as misses
        inside = rows >= 0
        with record_function(PHASES[2]):
            total, hits_in = head_cross_entropy(hidden[keep[inside]].to(head.dtype), head, rows[inside],
                                                w[keep[inside]], chunk, None if teacher is None else teacher[inside])
        hits = torch.zeros(len(keep), dtype=torch.bool, device=device).masked_scatter_(inside, hits_in)
    slot = (keep % c.block_size).cpu()
    stats["hits"].index_add_(0, slot, hits.float().cpu())
    stats["counts"].index_add_(0, slot, torch.ones(len(slot)))
    with record_function(PHASES[4]):
        (total * scale).backward()
    stats["loss_sum"] += float(total.detach())
    stats["tokens"] += S


@dataclass
class StepResult:
    """What one optimizer step measured, summed over the ranks."""

    loss: float  # Σ w·CE / Σ w over the step
    acc: list[float]  # per slot 1..B−1: the share of labels the drafter's proposal hit
    tokens_per_s: float
    target_share: float  # of the step's time, the share spent in the target's forward
    samples: int
    elapsed_s: float  # this rank's time for the step


class DrafterStep:
    """Forward, backward and the optimizer step over a step's micro-batches; rank r takes micro-batches
    r, r+world, ... and the gradients are summed across ranks before clipping."""

    def __init__(self, t: TrainerConfig, target: Target, drafter: DFlashDrafter, opt: torch.optim.Optimizer,
                 device: str, dist: Dist, amp: torch.dtype | None, target_amp: torch.dtype | None) -> None:
        self.t, self.target, self.drafter, self.opt = t, target, drafter, opt
        self.device, self.dist, self.amp, self.target_amp = device, dist, amp, target_amp

    def trained_weights(self, b: Blocks) -> torch.Tensor:
        """The loss weights that count: labels outside a draft vocabulary are out of the loss."""
        if self.drafter.draft_vocab is None:
            return b.weights
        return b.weights * (self.drafter.vocab_rows(b.labels) >= 0)

    def __call__(self, micro: list[Microbatch], step: int) -> StepResult:
        t, c = self.t, self.drafter.config
        # every rank builds every micro-batch's blocks: loss = Σ w·CE / Σ w over the whole optimizer step
        blocks = [[sequence_blocks(s, t.anchors_per_sequence, t.seed, step, pos, t.max_length, c.block_size,
                                   c.mask_token_id) for pos, s in mb] for mb in micro]
        # labels outside a draft vocabulary are out of the loss, so out of its normaliser too
        weight_sum = sum(float(self.trained_weights(b).sum()) for bs in blocks for b in bs if b is not None)
        stats = {"loss_sum": 0.0, "tokens": 0, "target_s": 0.0, "hits": torch.zeros(c.block_size),
                 "counts": torch.zeros(c.block_size)}
        t0 = time.perf_counter()
        self.drafter.train()
        self.opt.zero_grad(set_to_none=True)
        if weight_sum > 0:
            for mb, bs in list(zip(micro, blocks, strict=True))[self.dist.rank::self.dist.world]:
                t1 = time.perf_counter()  # the micro-batch's target forward, batched
                with torch.autocast(torch.device(self.device).type, dtype=self.target_amp or torch.float32,
                                    enabled=self.target_amp is not None), record_function(PHASES[0]):
                    seqs = [torch.tensor(s.input_ids[: t.max_length], device=self.device) for _, s in mb]
                    feats = self.target.features_and_final_many(seqs) if t.soft_labels else \
                        [(f, None) for f in self.target.features_many(seqs)]
                stats["target_s"] += time.perf_counter() - t1
                for b, (f, final) in zip(bs, feats, strict=True):
                    if b is not None:
                        sequence_loss(self.target, self.drafter, b, t.logits_chunk, 1.0 / weight_sum, stats, self.amp,
                                      f, final, t.selector_loss_weight)
            with record_function(PHASES[5]):
                self.dist.sum_grads(list(self.drafter.parameters()))
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), t.grad_clip)
                self.opt.step()
        elapsed = time.perf_counter() - t0
        totals = self.dist.sum(torch.tensor([stats["loss_sum"], stats["tokens"], stats["target_s"], elapsed],
                                            dtype=torch.float64))
        hits, counts = self.dist.sum(stats["hits"]), self.dist.sum(stats["counts"])
        loss_sum, tokens, target_s, elapsed_sum = totals.tolist()
        acc = (hits[1:] / counts[1:].clamp(min=1)).tolist()
        return StepResult(loss=loss_sum / weight_sum if weight_sum else 0.0, acc=acc, tokens_per_s=tokens / elapsed,
                          target_share=target_s / max(elapsed_sum, 1e-9), samples=sum(len(mb) for mb in micro),
                          elapsed_s=elapsed)

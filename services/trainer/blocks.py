"""Training blocks for one sequence: anchors, the one attention mask for all blocks, labels and weights.

For a sequence of S tokens and n anchors a_1..a_n (drawn among positions i with loss_mask[i] and
loss_mask[i+1]), block j is [input_ids[a_j], MASK × (B−1)] at positions a_j .. a_j+B−1.
- Attention: block j's queries see context positions p < a_j (strictly before the anchor; the
  anchor's own feature is not context), every slot of block j, and no other block.
- Labels: slot k predicts input_ids[a_j + k] (same position); slot 0, the anchor itself, is not
  in the loss.
- Weights: w_k = exp(−(k−1)/γ) · loss_mask[a_j+k] · [a_j+k < S]; γ = 7, 5, 4 for B = 16, 10, 8
  (other B: γ = B/2.3, close to the same curve).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def gamma_for(block_size: int) -> float:
    return GAMMA.get(block_size, block_size / 2.3)


@dataclass
class Blocks:
    anchors: torch.Tensor  # [n]
    block_ids: torch.Tensor  # [n·B] token ids fed to the drafter (anchor then mask tokens)
    q_pos: torch.Tensor  # [n·B] positions
    mask: torch.Tensor  # [n·B, S + n·B] bool, True = may attend
    labels: torch.Tensor  # [n·B] target ids (0 where unused)
    weights: torch.Tensor  # [n·B] loss weights (0 on slot 0 and outside the sequence/response)


def candidate_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    cand = candidate_anchors(loss_mask)
    if len(cand) == 0:
        return cand
    pick = torch.randperm(len(cand), generator=generator)[: min(n, len(cand))]
    return cand[pick].sort().values


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                mask_token_id: int) -> Blocks:
    S, B, n = input_ids.shape[0], block_size, anchors.shape[0]
    slots = torch.arange(B)
    pos = anchors[:, None] + slots[None, :]  # [n, B]
    block_ids = torch.full((n, B), mask_token_id, dtype=input_ids.dtype)
    block_ids[:, 0] = input_ids[anchors]
    inside = pos < S
    safe = pos.clamp(max=S - 1)
    labels = torch.where(inside, input_ids[safe], torch.zeros_like(pos))
    decay = torch.exp(-(slots.float() - 1) / gamma_for(B))
    weights = decay[None, :] * loss_mask[safe].float() * inside.float()
    weights[:, 0] = 0.0
    # context: key position p < anchor; blocks: same block only
    ctx_ok = torch.arange(S)[None, :] < anchors[:, None]  # [n, S]
    ctx_ok = ctx_ok[:, None, :].expand(n, B, S).reshape(n * B, S)
    blk = torch.arange(n).repeat_interleave(B)
    blk_ok = blk[:, None] == blk[None, :]  # [n·B, n·B]
    return Blocks(anchors=anchors, block_ids=block_ids.flatten(), q_pos=pos.flatten(),
                  mask=torch.cat([ctx_ok, blk_ok], 1), labels=labels.flatten(), weights=weights.flatten())


def label_states(final: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """For soft labels: the target's final hidden state whose next-token distribution labels each slot,
    the one *before* the slot's position (a causal LM's output at p − 1 predicts token p). [S, D] → [n, D]."""
    return final[q_pos - 1]


def estimated_tau(position_accuracy: list[float]) -> float:
    """Expected tokens per cycle if slot k is right with probability acc_k given the earlier ones were:
    1 (the bonus) + Σ_k Π_{j≤k} acc_j."""
    tau, run = 1.0, 1.0
    for acc in position_accuracy:
        run *= acc
        tau += run
    return tau

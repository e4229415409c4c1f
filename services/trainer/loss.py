"""Weighted cross-entropy through the frozen LM head, fused with the head's matmul.

The drafter's loss needs logits over the whole vocabulary (49k for SmolLM2, 152k for Qwen3) at
every block slot; unfused, autograd keeps each chunk's fp32 logits for the backward and walks
them five more times (log-softmax, its backward, the NLL one-hot, the dtype casts, argmax).
Here each chunk of rows is taken through once, in the forward: logits → fp32 softmax → the
gradient of the weighted loss w.r.t. the hidden rows (as Liger's fused linear cross-entropy).
The [n, V] logits exist one chunk at a time and nothing vocabulary-sized is kept for backward,
which only scales the stored [N, D] gradient. The head is frozen: no gradient for it.

With `teacher` rows (the target's own final hidden state before each label), the label is the
target's next-token distribution q = softmax(teacher · headᵀ) instead of its argmax token: the
loss is Σ w·(−Σ_v q_v log p_v) and its gradient w·(p − q), the teacher's logits made one chunk
at a time as well (EAGLE's soft labels).
"""

from __future__ import annotations

import threading

import torch

_WORKSPACE: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
_WORKSPACE_LOCK = threading.Lock()  # one user of the scratch buffers at a time (the trainer runs steps in threads)


def _scratch(name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused [rows, cols] buffer on CPU: a fresh 100 MB tensor per chunk costs as much in page
    faults as the pass that fills it (GPU allocators cache blocks themselves)."""
    if device.type != "cpu":
        return torch.empty(rows, cols, dtype=dtype, device=device)
    buf = _WORKSPACE.get((name, dtype, device))
    if buf is None or buf.numel() < rows * cols:
        buf = _WORKSPACE[(name, dtype, device)] = torch.empty(rows * cols, dtype=dtype, device=device)
    return buf[: rows * cols].view(rows, cols)


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                chunk: int, teacher: torch.Tensor | None, top_k: int) -> tuple[torch.Tensor, ...]:
        # hidden [N, D] in the head's dtype, head [V, D], labels [N], weights [N] fp32, teacher [N, D] or None
        (N, _), V = hidden.shape, head.shape[0]
        grad = torch.empty_like(hidden)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(N, dtype=torch.bool, device=hidden.device)
        top_values = torch.empty(N, top_k, dtype=torch.float32, device=hidden.device)  # [N, K] (K may be 0)
        top_ids = torch.empty(N, top_k, dtype=torch.long, device=hidden.device)
        fp32_head = head.dtype == torch.float32
        with _WORKSPACE_LOCK:
            logits_buf = _scratch("logits", min(chunk, N), V, head.dtype, hidden.device)
            p_buf = logits_buf if fp32_head else _scratch("p", min(chunk, N), V, torch.float32, hidden.device)
            q_buf = None if teacher is None else _scratch("q", min(chunk, N), V, torch.float32, hidden.device)
            for start in range(0, N, chunk):
                n = min(chunk, N - start)
                rows = slice(start, start + n)
                y, w = labels[rows, None], weights[rows, None]
                logits = torch.mm(hidden[rows], head.T, out=logits_buf[:n])  # [n, V], the head's dtype
                top = logits.amax(-1, keepdim=True).float()
                picked = logits.gather(1, y).float()
                hits[rows] = (picked >= top).squeeze(1)  # argmax == label (a tie counts as a hit)
                if top_k:  # DFlash 2's candidates, taken while the logits exist
                    values, ids = logits.topk(top_k, -1)
                    top_values[rows], top_ids[rows] = values.float(), ids
                if q_buf is not None:  # the teacher's distribution, and Σ_v q_v·logit_v in place of logit[label]
                    q = q_buf[:n]
                    if fp32_head:
                        torch.mm(teacher[rows], head.T, out=q)
                    else:
                        q.copy_(torch.mm(teacher[rows], head.T))
                    q.sub_(q.amax(-1, keepdim=True)).clamp_min_(-64.0).exp_()
                    q.div_(q.sum(-1, keepdim=True))
                    picked = (q * logits).sum(-1, keepdim=True, dtype=torch.float32)
                # fp32 from here. The floor: exp of an input below about −87 is a denormal and the CPU's
                # exp is ~20× slower there, while a trained head spreads logits over hundreds;
                # exp(−64) ≈ 1.6e-28 cannot move an fp32 sum that holds the max's 1.
                p = logits if fp32_head else p_buf[:n].copy_(logits)
                p.sub_(top).clamp_min_(-64.0).exp_()
                z = p.sum(-1, keepdim=True)
                loss += ((z.log() + top - picked) * w).sum()  # CE = logsumexp − logit[label] (or − q·logits)
                # d(Σ w·CE)/d logits = w·(softmax − onehot) = (p − z·onehot)·w/z; with a teacher w·(p/z − q)
                if q_buf is None:
                    p.scatter_add_(1, y, -z).mul_(w / z)
                else:
                    p.div_(z).sub_(q_buf[:n]).mul_(w)
                g = p if fp32_head else logits.copy_(p)  # back to the head's dtype, into the logits' buffer
                torch.mm(g, head, out=grad[rows])
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits, top_values, top_ids)
        return loss, hits, top_values, top_ids

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, *_grad_non_differentiable: torch.Tensor | None):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


def head_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                       chunk: int = 2048, teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_i w_i · CE(hidden_i · headᵀ, labels_i) as an fp32 scalar (differentiable in `hidden`), and
    whether each row's argmax is its label. Softmax math is fp32 whatever the matmuls' dtype.
    With `teacher` [N, D] the CE is against softmax(teacher_i · headᵀ) instead of the label."""
    loss, hits, _, _ = head_cross_entropy_top_k(hidden, head, labels, weights, 0, chunk, teacher)
    return loss, hits


def head_cross_entropy_top_k(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                             top_k: int, chunk: int = 2048, teacher: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_cross_entropy, and each row's `top_k` largest logits [N, K] (fp32, not differentiable) with their
    ids [N, K], from the same pass over the head (DFlash 2's selector candidates cost no second matmul)."""
    if head.requires_grad:
        raise ValueError("head_cross_entropy is for a frozen head: it computes no gradient for it")
    if teacher is not None:
        teacher = teacher.detach().to(head.dtype)
    return _HeadCrossEntropy.apply(hidden, head, labels, weights.float(), max(1, chunk), teacher, top_k)

"""`dfpipe eval`: real speculative decoding with the trained drafter and the target, greedy, on held-out prompts.

Per cycle: the block [last token, MASK × (B−1)] sits right after the verified text; one drafter
pass proposes B−1 tokens (greedy); one target forward over the block verifies them; the longest
prefix equal to the target's own greedy choices is accepted, plus the target's next token (the
bonus); the accepted positions' target features join the draft context. τ = mean tokens per
cycle, bonus included. Losslessness: the output must equal plain greedy decoding of the target
token for token, on every prompt.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from .features import Target
from .model import DFlashDrafter


def _cache_kw(model: Any) -> str:
    """transformers ≥ 5.24 names the KV cache `cache` (`past_key_values` goes in 5.40); older ones the latter."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def greedy(target: Target, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with a KV cache: the reference output and the speed baseline."""
    model = target.model
    device = next(model.parameters()).device
    kw = _cache_kw(model)
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    cache, tokens = _cache(out), []
    nxt = int(out.logits[0, -1].argmax())
    while True:
        tokens.append(nxt)
        if nxt in eos or len(tokens) >= max_new:
            return tokens
        out = model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **{kw: cache})
        cache, nxt = _cache(out), int(out.logits[0, -1].argmax())


@torch.no_grad()
def speculative(target: Target, drafter: DFlashDrafter, prompt: list[int], max_new: int,
                eos: set[int]) -> tuple[list[int], list[int]]:
    """Returns (tokens, accepted-per-cycle including the bonus)."""
    model, c = target.model, drafter.config
    device = next(model.parameters()).device
    B = c.block_size
    kw = _cache_kw(model)
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, output_hidden_states=True)
    cache = _cache(out)
    feats = target.pick(out.hidden_states)[0]  # [P, k·D]
    tokens = [int(out.logits[0, -1].argmax())]  # the first token: the target's own
    cycles: list[int] = []
    base = len(prompt)  # tokens[i] sits at position base + i
    while tokens[-1] not in eos and len(tokens) < max_new:
        anchor_pos = base + len(tokens) - 1
        ctx_len = feats.shape[0]  # features known for positions < anchor_pos
        assert ctx_len == anchor_pos
        block = torch.full((B,), c.mask_token_id, dtype=torch.long, device=device)
        block[0] = tokens[-1]
        q_pos = torch.arange(anchor_pos, anchor_pos + B, device=device)
        mask = torch.ones(B, ctx_len + B, dtype=torch.bool, device=device)
        hidden = drafter(target.embed(block), feats, q_pos, torch.arange(ctx_len, device=device), mask)
        drafts = drafter.propose(hidden[1:], target.lm_head, anchor=block[0])  # [B−1] (DFlash 2: the selector's walk)
        verify_in = torch.cat([block[:1], drafts])[None]
        vout = model(input_ids=verify_in, use_cache=True, output_hidden_states=True, **{kw: cache})
        choice = vout.logits[0].argmax(-1)  # target's greedy next token after each block position
        accepted = 0
        while accepted < B - 1 and int(drafts[accepted]) == int(choice[accepted]):
            accepted += 1
        new = [int(t) for t in drafts[:accepted]] + [int(choice[accepted])]
        # stop exactly where greedy would: at eos or max_new
        for i, tok in enumerate(new):
            if tok in eos or len(tokens) + i + 1 >= max_new:
                new = new[: i + 1]
                break
        cycles.append(len(new))
        tokens.extend(new)
        vfeats = target.pick(vout.hidden_states)[0]
        feats = torch.cat([feats, vfeats[: accepted + 1]], 0)  # the anchor and the accepted drafts
        cache = _cache(vout)
        extra = cache.get_seq_length() - (anchor_pos + accepted + 1)  # the rejected drafts
        if extra > 0:
            cache.crop(-extra)  # a negative count removes that many (the form both old and new caches take)
    return tokens[:max_new], cycles


def evaluate(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], max_new: int,
             eos: set[int]) -> dict[str, Any]:
    drafter.eval()
    B = drafter.config.block_size
    hist = [0] * (B + 1)
    cycles_all: list[int] = []
    mismatches, t_greedy, t_spec = 0, 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        ref = greedy(target, p, max_new, eos)
        t_greedy += time.perf_counter() - t0
        t0 = time.perf_counter()
        got, cycles = speculative(target, drafter, p, max_new, eos)
        t_spec += time.perf_counter() - t0
        mismatches += int(got != ref)
        cycles_all += cycles
        for n in cycles:
            hist[n] += 1
    tau = sum(cycles_all) / max(1, len(cycles_all))
    return {"prompts": len(prompts), "tau": tau, "acceptance_histogram": hist, "speedup": t_greedy / max(t_spec, 1e-9),
            "lossless": mismatches == 0, "mismatches": mismatches, "cycles": len(cycles_all)}


def prompt_part(sample: Any) -> list[int]:
    """A tokenized sample's prompt: everything before its first supervised token."""
    first = next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask))
    return list(sample.input_ids[:first])

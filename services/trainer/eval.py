"""`dfpipe eval`: real speculative decoding with the trained drafter and the target on held-out prompts,
greedy (exact) or sampled (lossless speculative sampling).

Per cycle: the block [last token, MASK × (B−1)] sits right after the verified text; one drafter
pass proposes B−1 tokens; one target forward over the block verifies them (`verify`): greedy, the
longest prefix equal to the target's own greedy choices is accepted, plus the target's next token
(the bonus); sampled, draft i is accepted with probability min(1, p_i(x)/q_i(x)) and the first
rejection is replaced by a sample of the residual max(0, p_i − q_i) normalised (or of p after the
last draft when all are accepted), so the output follows the target's distribution exactly (Leviathan
et al. 2023). The accepted positions' target features join the draft context. τ = mean tokens per
cycle, bonus included. Greedy losslessness is checked token for token against plain greedy decoding;
sampled losslessness is the rule's, checked statistically by the tests.

The drafting step is a function `propose(drafter, hidden, anchor, lm_head, sampling, generator)`
returning the draft tokens and their proposal distribution q (None when greedy): a drafter with
another proposal (a DFlash 2 selector walk) passes its own and keeps this loop and `verify`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.machine import describe_machine
from shared.messages import EvalReport
from shared.runconfig import read_run_config
from shared.store import Store
from shared.topology import Keys, Subjects

from .data import held_out_prompts
from .drafters import load_drafter
from .features import Target
from .model import DFlashDrafter

log = logging.getLogger("dflash.eval")


@dataclass(frozen=True)
class Sampling:
    """How the target's logits become a distribution: temperature, then top-k, then top-p (as HF and the
    reference warp them). temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), not {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits → [..., V] the warped distribution (float32)."""
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        probs = scores.softmax(-1)
        if self.top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # the smallest prefix reaching top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


GREEDY = Sampling()

# draft tokens [n] and their proposal distribution q [n, V] over the target's vocabulary (None when greedy)
Proposal = tuple[torch.Tensor, "torch.Tensor | None"]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def propose_dflash(drafter: DFlashDrafter, hidden: torch.Tensor, anchor: int, lm_head: Any, sampling: Sampling,
                   generator: torch.Generator | None) -> Proposal:
    """DFlash's proposal: each slot independently, greedy or sampled from its own warped distribution
    (restricted to the draft vocabulary when the drafter has one). A DFlash 2 drafter walks its candidates
    from the `anchor` instead, greedy or sampled at the same temperature (`DFlash2Drafter.sample`)."""
    if sampling.greedy:  # DFlash 2: the selector's walk from the anchor
        return drafter.propose(hidden, lm_head, anchor=torch.as_tensor(anchor, device=hidden.device)), None
    if getattr(drafter, "candidate_selector", None) is not None:  # DFlash 2: the walk, sampled
        return drafter.sample(hidden, lm_head, torch.as_tensor(anchor, device=hidden.device), sampling.temperature,
                              generator)
    weight = drafter.head_rows(lm_head.weight)
    bias = getattr(lm_head, "bias", None)
    rows = sampling.probs(torch.nn.functional.linear(hidden, weight, None if bias is None else
                                                     (bias if drafter.draft_vocab is None else bias[drafter.draft_vocab])))
    picks = torch.multinomial(rows, 1, generator=generator)[:, 0]
    if drafter.draft_vocab is None:
        return picks, rows
    vocab = drafter.draft_vocab.to(rows.device)
    q = torch.zeros(rows.shape[0], lm_head.weight.shape[0], device=rows.device).index_copy_(1, vocab, rows)
    return vocab[picks], q


def verify(drafts: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """The acceptance rule, in one place. drafts [n], q [n, V] (None: greedy), target_logits [n+1, V]: the
    target's logits after the anchor and after each draft. Returns (drafts accepted, the token that follows
    them: the bonus or the correction)."""
    n = drafts.shape[0]
    if sampling.greedy:
        choice = target_logits.argmax(-1)
        accepted = 0
        while accepted < n and int(drafts[accepted]) == int(choice[accepted]):
            accepted += 1
        return accepted, int(choice[accepted])
    if q is None:
        raise ValueError("sampled verification needs the drafts' proposal distribution q")
    p = sampling.probs(target_logits)
    for i in range(n):
        x = int(drafts[i])
        u = float(torch.rand((), generator=generator))
        if u * float(q[i, x]) < float(p[i, x]):  # u < p/q without dividing by a q of 0
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = float(residual.sum())
        return i, _draw(residual / total if total > 0 else p[i], generator)
    return n, _draw(p[n], generator)


def _cache_kw(model: Any) -> str:
    """transformers ≥ 5.24 names the KV cache `cache` (`past_key_values` goes in 5.40); older ones the latter."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    return int(logits.argmax()) if sampling.greedy else _draw(sampling.probs(logits), generator)


@torch.no_grad()
def greedy(target: Target, prompt: list[int], max_new: int, eos: set[int], sampling: Sampling = GREEDY,
           generator: torch.Generator | None = None) -> list[int]:
    """Plain decoding with a KV cache (greedy, or sampled with `sampling`): the reference output and the
    speed baseline."""
    model = target.model
    device = next(model.parameters()).device
    kw = _cache_kw(model)
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    cache, tokens = _cache(out), []
    nxt = _next(out.logits[0, -1], sampling, generator)
    while True:
        tokens.append(nxt)
        if nxt in eos or len(tokens) >= max_new:
            return tokens
        out = model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True, **{kw: cache})
        cache, nxt = _cache(out), _next(out.logits[0, -1], sampling, generator)


@torch.no_grad()
def speculative(target: Target, drafter: DFlashDrafter, prompt: list[int], max_new: int, eos: set[int],
                sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                propose: Callable[..., Proposal] = propose_dflash) -> tuple[list[int], list[int]]:
    """Returns (tokens, accepted-per-cycle including the bonus)."""
    model, c = target.model, drafter.config
    device = next(model.parameters()).device
    B = c.block_size
    kw = _cache_kw(model)
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, output_hidden_states=True)
    cache = _cache(out)
    feats = target.pick(out.hidden_states)[0]  # [P, k·D]
    tokens = [_next(out.logits[0, -1], sampling, generator)]  # the first token: the target's own
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
        drafts, q = propose(drafter, hidden[1:], tokens[-1], target.lm_head, sampling, generator)  # [B−1]
        verify_in = torch.cat([block[:1], drafts])[None]
        vout = model(input_ids=verify_in, use_cache=True, output_hidden_states=True, **{kw: cache})
        accepted, following = verify(drafts, q, vout.logits[0], sampling, generator)
        new = [int(t) for t in drafts[:accepted]] + [following]
        # stop exactly where plain decoding would: at eos or max_new
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


def evaluate(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], max_new: int, eos: set[int],
             sampling: Sampling = GREEDY, seeds: int = 1, *, run: str, checkpoint_key: str = "") -> EvalReport:
    """τ, its acceptance histogram and the speedup over plain decoding, as the run's EvalReport. Greedy: one
    pass, each output checked against plain greedy decoding. Sampled: one pass per seed (seed s drives both the
    speculative run and the plain one it is timed against); τ is reported per seed with its mean and spread."""
    drafter.eval()
    B = drafter.config.block_size
    hist = [0] * (B + 1)
    cycles_all: list[int] = []
    taus: list[float] = []
    mismatches, t_plain, t_spec, n_plain, n_spec = 0, 0.0, 0.0, 0, 0
    for seed in range(1 if sampling.greedy else seeds):
        seed_cycles: list[int] = []
        for i, p in enumerate(prompts):
            gen = None if sampling.greedy else torch.Generator().manual_seed(seed * 1_000_003 + i)
            t0 = time.perf_counter()
            ref = greedy(target, p, max_new, eos, sampling, gen)
            t_plain += time.perf_counter() - t0
            t0 = time.perf_counter()
            got, cycles = speculative(target, drafter, p, max_new, eos, sampling, gen)
            t_spec += time.perf_counter() - t0
            n_plain, n_spec = n_plain + len(ref), n_spec + len(got)
            mismatches += int(sampling.greedy and got != ref)
            seed_cycles += cycles
            for n in cycles:
                hist[n] += 1
        taus.append(sum(seed_cycles) / max(1, len(seed_cycles)))
        cycles_all += seed_cycles
    tau = sum(cycles_all) / max(1, len(cycles_all))
    spread = (sum((t - sum(taus) / len(taus)) ** 2 for t in taus) / (len(taus) - 1)) ** 0.5 if len(taus) > 1 else 0.0
    # tokens per second, speculative over plain (greedy: the same tokens, so the ratio of times)
    speedup = (n_spec / max(t_spec, 1e-9)) / max(n_plain / max(t_plain, 1e-9), 1e-9)
    return EvalReport(run=run, checkpoint_key=checkpoint_key, prompts=len(prompts), tau=tau,
                      acceptance_histogram=hist, speedup=speedup,
                      lossless=mismatches == 0 if sampling.greedy else None, mismatches=mismatches,
                      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seeds=len(taus),
                      tau_per_seed=taus, tau_std=spread, max_new_tokens=max_new,
                      machine=describe_machine(str(next(drafter.parameters()).device.type)))


# --- a run's eval: `dfpipe eval` ------------------------------------------------------------------


class EvalRefused(Exception):
    """There is nothing to evaluate (no such run, no held-out sample): the reason, and the exit it means."""

    def __init__(self, message: str, exit_code: Exit) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def same_evaluation(report: EvalReport, ckpt: str, prompts: int, max_new: int, sampling: Sampling, seeds: int) -> bool:
    """Whether `report` already evaluated this checkpoint with these settings (then `dfpipe eval` reuses it)."""
    return (report.checkpoint_key == ckpt and report.prompts == prompts and report.max_new_tokens == max_new
            and (report.temperature, report.top_p, report.top_k) == (sampling.temperature, sampling.top_p, sampling.top_k)
            and (sampling.greedy or report.seeds == seeds))


def _reusable_report(store: Store, cfg: Config, ckpt: str, prompts: int, sampling: Sampling,
                     seeds: int) -> EvalReport | None:
    """The run's report when it already holds this checkpoint and these settings: a restart (compose `up`
    again, a rerun of the pipeline) does not redo minutes of decoding."""
    if not store.exists(Keys.eval_report(cfg.run)):
        return None
    old = msgspec.json.decode(store.get_bytes(Keys.eval_report(cfg.run)), type=EvalReport)
    return old if same_evaluation(old, ckpt, prompts, cfg.trainer.eval_max_new_tokens, sampling, seeds) else None


def _evaluate_checkpoint(cfg: Config, store: Store, ckpt: str, prompts: list[list[int]], sampling: Sampling,
                         seeds: int) -> EvalReport:
    """Load the checkpoint's drafter and the target, then decode (blocking: run it off the event loop)."""
    from shared.model import load_causal_lm, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("config.json", "model.safetensors"):
            store.get_file(f"{ckpt}drafter/{name}", Path(tmp) / name)
        drafter = load_drafter(Path(tmp), f"run {cfg.run}: checkpoint {ckpt}")
    lm = load_causal_lm(cfg.model.target)
    tok = load_tokenizer(cfg.model.target)
    eos = lm.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
    torch.manual_seed(0)
    return evaluate(Target(lm, drafter.config.target_layer_ids), drafter, prompts, cfg.trainer.eval_max_new_tokens,
                    eos, sampling, seeds, run=cfg.run, checkpoint_key=ckpt)


async def evaluate_run(cfg: Config, limit: int | None = None, sampling: Sampling = GREEDY, seeds: int = 1,
                       force: bool = False) -> tuple[EvalReport, bool]:
    """The run's latest checkpoint on its held-out prompts: the report, written to S3 and published, and
    whether it was reused (the run's report already held this checkpoint and these settings; `force` decodes
    again). Raises EvalRefused when there is nothing to evaluate."""
    store = await asyncio.to_thread(Store.open, cfg)
    async with await Bus.connect(cfg.bus, "eval", deadline_s=30) as bus:
        if missing := await bus.run_missing(cfg.run):
            raise EvalRefused(missing, Exit.USAGE)
        recorded = await asyncio.to_thread(read_run_config, store, cfg.run)
        if recorded is not None and recorded.model.target != cfg.model.target:
            log.warning("run %s was made with target %s; evaluating against %s (model.target)", cfg.run,
                        recorded.model.target, cfg.model.target)
        prompts = await held_out_prompts(cfg, store, bus, limit)
        if not prompts:
            raise EvalRefused(f"run {cfg.run} has no held-out samples (trainer.holdout_mod)", Exit.FAILED)
        ckpt = json.loads(await asyncio.to_thread(store.get_bytes, Keys.checkpoint_latest(cfg.run)))["key"]
        if not force and (old := await asyncio.to_thread(_reusable_report, store, cfg, ckpt, len(prompts),
                                                          sampling, seeds)):
            return old, True
        report = await asyncio.to_thread(_evaluate_checkpoint, cfg, store, ckpt, prompts, sampling, seeds)
        await asyncio.to_thread(store.put_bytes, Keys.eval_report(cfg.run), msgspec.json.encode(report),
                                "application/json")
        await bus.publish(Subjects.progress(cfg.run, "eval", "eval"), report)
        return report, False

"""Completion records -> training samples (input_ids, loss_mask), with drops counted by reason.

Token ids come from tokenizing each rendered piece on its own and concatenating:
`prompt+pre (0) | reasoning (train_on_reasoning) | answer+end-of-turn (1) | tail (0)`. Cutting at
the piece boundaries keeps the generation prompt's tokens exactly what the engine was given and
never lets BPE merge a prompt character into the answer.

Token-exact path: when a record carries the engine's `output_ids`, the sample is
`tokens(P) + output_ids (+ the stop token if the engine trimmed it) + tokens(tail)`, and the
record counts as retokenization drift when tokenizing the answer text would have given other ids.

The fast path tokenizes every piece of a shard in one batched call of the fast tokenizer;
`batched=False` tokenizes piece by piece (the reference the fast path must equal).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.config import Config
from shared.records import CompletionRecord, TokenizedSample, dedupe_completions

from . import checks
from .render import ChatRenderer, RenderedTurn, RenderMismatch, TemplateRaised


@dataclass(frozen=True)
class Drop:
    prompt_id: str
    reason: str
    example: str  # the start of the answer (the template's message for template_error), for `dfpipe drops`
    num_supervised: int | None = None  # known when dropped after tokenizing (the histogram shows the spike)


@dataclass
class ShardSamples:
    samples: list[TokenizedSample] = field(default_factory=list)
    drops: list[Drop] = field(default_factory=list)
    drift: int = 0  # token-exact records whose answer would re-tokenize differently
    exact: int = 0  # records that used the engine's output ids
    # (prompt_id, drop reason or None, start of the answer) for every non-duplicate record, in order: the gate's input
    outcomes: list[tuple[str, str | None, str]] = field(default_factory=list)

    def dropped(self) -> dict[str, int]:
        return dict(Counter(d.reason for d in self.drops))

    @classmethod
    def merged(cls, parts: list[ShardSamples]) -> ShardSamples:
        """Consecutive parts of one shard, built apart, as one."""
        return cls(samples=[s for p in parts for s in p.samples], drops=[d for p in parts for d in p.drops],
                   drift=sum(p.drift for p in parts), exact=sum(p.exact for p in parts))


@dataclass
class _Plan:
    rec: CompletionRecord
    turn: RenderedTurn
    pieces: list[tuple[str, int]]  # (text, mask) of the re-tokenized sample


class PartsBuilder(Protocol):
    """Builds a shard's records in consecutive parts, possibly on other cores, the parts in order (pool.BuildPool)."""

    def build(self, records: list[CompletionRecord], here: Callable[[list[CompletionRecord]], ShardSamples]
              ) -> list[ShardSamples]: ...


class SampleBuilder:
    """Turns one shard's records into samples with one tokenizer, template and mask policy."""

    def __init__(self, tokenizer: Any, cfg: Config) -> None:
        t = cfg.tokenizer
        self.thinking = cfg.sampling.enable_thinking
        self.renderer = ChatRenderer(tokenizer, enable_thinking=self.thinking)
        self.tok = tokenizer
        self.train_on_reasoning = t.train_on_reasoning
        self.truncated_policy = t.truncated_policy
        self.max_length = t.max_length
        self.min_supervised = checks.min_supervised_tokens(cfg)
        self.max_period = t.repetition_max_period
        self.min_tail = t.repetition_min_tail
        self.stop_ids = set(self.renderer.stop_ids)

    # --- rendering ------------------------------------------------------------------------------

    def _plans(self, records: list[CompletionRecord], out: ShardSamples) -> list[_Plan]:
        """The records that pass the pre-checks and fit the template's layout, as pieces to tokenize."""
        ready = []
        for rec in records:
            reason = checks.precheck(rec, thinking=self.thinking, truncated_policy=self.truncated_policy)
            if reason is not None:
                out.drops.append(Drop(rec.prompt_id, reason, rec.completion[:200]))
            else:
                ready.append(rec)
        plans = []
        turns = self.renderer.turns([(rec.messages, rec.completion, rec.reasoning) for rec in ready])
        for rec, turn in zip(ready, turns, strict=True):
            if isinstance(turn, TemplateRaised):
                out.drops.append(Drop(rec.prompt_id, checks.TEMPLATE_ERROR, str(turn)[:200]))
                continue
            if isinstance(turn, RenderMismatch):
                out.drops.append(Drop(rec.prompt_id, checks.RENDER_MISMATCH, rec.completion[:200]))
                continue
            pieces: list[tuple[str, int]] = [(turn.prompt + turn.pre, 0)]
            if turn.head and self.train_on_reasoning:
                pieces.append((turn.head + turn.answer, 1))
            else:
                if turn.head:
                    pieces.append((turn.head, 0))
                pieces.append((turn.answer, 1))
            pieces.append((turn.tail, 0))
            plans.append(_Plan(rec, turn, pieces))
        return plans

    # --- building -------------------------------------------------------------------------------

    def build(
        self, records: list[CompletionRecord], *, seen: Mapping[str, int] | None = None, batched: bool = True,
        pool: PartsBuilder | None = None,
    ) -> ShardSamples:
        """Samples for one shard, in record order. `seen` maps prompt_ids emitted before to the newest
        generation emitted: a record of that generation or older is a duplicate, a newer one (a
        deliberate regeneration) is a fresh sample that replaces it on read. With a `pool`, the fresh
        records are built in its processes (same samples, same drops, same order)."""
        keep = dedupe_completions([("", records)])
        seen = seen or {}

        def fresh(rec: CompletionRecord) -> bool:
            return keep.get(rec.prompt_id) is rec and rec.generation > seen.get(rec.prompt_id, -1)

        todo: list[CompletionRecord] = []
        duplicates = []
        for rec in records:
            (todo if fresh(rec) else duplicates).append(rec)
        if pool is None:
            out = self.build_fresh(todo, batched=batched)
        else:
            out = ShardSamples.merged(pool.build(todo, lambda part: self.build_fresh(part, batched=batched)))
        out.drops[:0] = [Drop(rec.prompt_id, checks.DUPLICATE, "") for rec in duplicates]
        # the gate compares answers (its collapse check counts identical ones): the completion, for every reason
        reasons = {d.prompt_id: d.reason for d in out.drops if d.reason != checks.DUPLICATE}
        out.outcomes = [(r.prompt_id, reasons.get(r.prompt_id), r.completion[:200]) for r in todo]
        return out

    def build_fresh(self, records: list[CompletionRecord], *, batched: bool = True) -> ShardSamples:
        """Samples for records already known to be fresh (no duplicates among them or before them)."""
        out = ShardSamples()
        plans = self._plans(records, out)
        texts = [t for p in plans for t, _ in p.pieces] + [p.turn.prompt for p in plans]
        encoded = self._encode_all(texts, batched)
        for plan in plans:
            sample = self._sample(plan, encoded, out)
            if sample is not None:
                out.samples.append(sample)
        return out

    def _encode_all(self, texts: list[str], batched: bool) -> dict[str, list[int]]:
        unique = list(dict.fromkeys(texts))
        if batched:
            ids = self.tok(unique, add_special_tokens=False)["input_ids"] if unique else []
            return dict(zip(unique, ids, strict=True))
        return {t: self.renderer.encode(t) for t in unique}

    def _sample(self, plan: _Plan, enc: dict[str, list[int]], out: ShardSamples) -> TokenizedSample | None:
        rec = plan.rec
        ids: list[int] = []
        mask: list[int] = []
        gen_ids: list[int] = []  # the re-tokenized generated part (drift reference)
        for i, (text, m) in enumerate(plan.pieces):
            piece = enc[text]
            if i == len(plan.pieces) - 1 and rec.truncated:
                piece = []  # a cut-off generation has no end of turn, so nothing after it either
            elif rec.truncated and m == 1:
                piece = piece[:-1]  # drop the stop token the template appended
            if 0 < i < len(plan.pieces) - 1:
                gen_ids += piece
            ids += piece
            mask += [m] * len(piece)
        if rec.output_ids is not None:
            exact = self._exact(plan, enc, gen_ids)
            out.exact += 1
            if exact is not None:
                e_ids, e_mask = exact
                if e_ids != ids:
                    out.drift += 1
                ids, mask = e_ids, e_mask
            else:
                out.drift += 1
        ids, mask, cut = checks.truncate(ids, mask, self.max_length)
        supervised = [t for t, m in zip(ids, mask, strict=True) if m]
        reason = None
        if len(supervised) < max(1, self.min_supervised):
            reason = checks.BELOW_MIN_SUPERVISED
        elif checks.is_degenerate(
            supervised[:-1] if supervised[-1] in self.stop_ids else supervised,
            max_period=self.max_period, min_tail=self.min_tail,
        ):
            reason = checks.DEGENERATE_REPETITION
        if reason is not None:
            out.drops.append(Drop(rec.prompt_id, reason, rec.completion[:200], len(supervised)))
            return None
        return TokenizedSample(
            prompt_id=rec.prompt_id, input_ids=ids, loss_mask=mask, num_tokens=len(ids),
            num_supervised=len(supervised), truncated=cut, generation=rec.generation,
        )

    def _exact(self, plan: _Plan, enc: dict[str, list[int]], gen_ids: list[int]) -> tuple[list[int], list[int]] | None:
        """tokens(P) + output_ids + tokens(tail), or None when the reasoning/answer split cannot be placed."""
        rec, turn = plan.rec, plan.turn
        out_ids = list(rec.output_ids or [])
        if not rec.truncated and (not out_ids or out_ids[-1] not in self.stop_ids):
            # The engine trimmed the stop token: put the template's back (the last token of the last supervised
            # piece, which is the answer, or reasoning and answer together when reasoning is trained on).
            out_ids.append(enc[plan.pieces[-2][0]][-1])
        gen_mask = [1] * len(out_ids)
        if turn.head and not self.train_on_reasoning:
            head_ids = enc[turn.head]
            if out_ids[: len(head_ids)] != head_ids:
                return None  # the reasoning does not re-tokenize to the same ids: cannot place the split
            gen_mask[: len(head_ids)] = [0] * len(head_ids)
        prompt_ids = enc[turn.prompt]
        tail_ids = [] if rec.truncated else enc[turn.tail]
        ids = prompt_ids + out_ids + tail_ids
        mask = [0] * len(prompt_ids) + gen_mask + [0] * len(tail_ids)
        return ids, mask

"""The run-level quality gate: stop a bad run within its first window, and say why.

Input: every sample's outcome in stream order (dropped for a quality reason, or kept) and the
start of its answer. The gate trips on the first of:

* first window: more than `threshold x window` of the first `window` samples were dropped; this
  fires as soon as the count is certain, e.g. after 41 bad samples of a 200-sample window;
* any later window: more than `threshold` of the last `window` samples were dropped;
* collapse: once a window is full, one identical answer makes up more than `identical_threshold`
  of it (a run whose every answer is the same long text passes every per-sample check).

A tripped gate is published as an `Alert(kind="quality_gate")` on the run's tokenize alert
subject (PROGRESS stream, so `dfpipe status` and the dashboard find it) with example samples, and
recorded in S3 beside the run's tokenized shards so a restarted service does not quietly go on.
`tokenizer.gate_override` keeps going, and says so with a warning Alert.
"""

from __future__ import annotations

import copy
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from shared.messages import Alert
from shared.topology import Streams, Subjects

STAGE = "tokenize"
KIND = "quality_gate"


@dataclass(frozen=True)
class GateVerdict:
    reason: str  # one line a person can act on
    examples: list[str]  # a few offending samples: "prompt_id [reason]: answer start"
    seen: int  # samples observed when it tripped


class QualityGate:
    def __init__(self, window: int, threshold: float, identical_threshold: float = 1.0) -> None:
        if window < 1 or not 0.0 <= threshold < 1.0:
            raise ValueError(f"gate_window must be >= 1 and gate_threshold in [0, 1), got {window}, {threshold}")
        self.window = window
        self.threshold = threshold
        self.identical_threshold = identical_threshold
        self.seen = 0
        self.first_window_bad = 0
        self.recent: deque[tuple[str, str | None, str]] = deque(maxlen=window)
        self.recent_bad = 0
        self.answers: Counter[str] = Counter()
        self.verdict: GateVerdict | None = None

    def copy(self) -> QualityGate:
        return copy.deepcopy(self)

    def observe(self, outcomes: list[tuple[str, str | None, str]]) -> GateVerdict | None:
        """Feed (prompt_id, drop reason or None, answer start) in order; the verdict once tripped."""
        for item in outcomes:
            if self.verdict is not None:
                break
            if len(self.recent) == self.window:
                old = self.recent[0]
                self.recent_bad -= old[1] is not None
                self.answers[old[2]] -= 1
                if not self.answers[old[2]]:
                    del self.answers[old[2]]
            self.recent.append(item)
            self.answers[item[2]] += 1
            self.seen += 1
            bad = item[1] is not None
            self.recent_bad += bad
            if self.seen <= self.window:
                self.first_window_bad += bad
                if self.first_window_bad > self.threshold * self.window:
                    self.verdict = self._dropped_verdict(
                        f"{self.first_window_bad} of the first {self.seen} samples", self.first_window_bad / self.seen
                    )
            elif self.recent_bad > self.threshold * self.window:
                self.verdict = self._dropped_verdict(
                    f"{self.recent_bad} of the last {self.window} samples (up to sample {self.seen})",
                    self.recent_bad / self.window,
                )
        if self.verdict is None and len(self.recent) == self.window:
            answer, n = max(self.answers.items(), key=lambda kv: kv[1])
            if n > self.identical_threshold * self.window:
                ex = [f"{pid}: {a!r}" for pid, _, a in self.recent if a == answer][:5]
                self.verdict = GateVerdict(
                    f"quality gate: {n} of the last {self.window} answers are the identical text {answer[:80]!r} "
                    f"({n / self.window:.0%}, over the {self.identical_threshold:.0%} limit): the target's "
                    "answers have collapsed",
                    ex, self.seen,
                )
        return self.verdict

    def _dropped_verdict(self, what: str, fraction: float) -> GateVerdict:
        reasons = Counter(r for _, r, _ in self.recent if r is not None)
        top = ", ".join(f"{r} {n}" for r, n in reasons.most_common())
        examples = [f"{pid} [{r}]: {a!r}" for pid, r, a in self.recent if r is not None][:5]
        return GateVerdict(
            f"quality gate: {what} were dropped ({fraction:.0%}, over the {self.threshold:.0%} threshold); "
            f"reasons: {top}",
            examples, self.seen,
        )


def gate_alert(run: str, worker: str, fingerprint: str, verdict: GateVerdict, *, overridden: bool) -> Alert:
    if overridden:
        return Alert(
            run=run, stage=STAGE, kind=KIND, severity="warning", worker=worker, examples=verdict.examples,
            message=f"{verdict.reason} [template {fingerprint}] -- OVERRIDDEN by tokenizer.gate_override: "
                    "tokenizing goes on",
        )
    return Alert(
        run=run, stage=STAGE, kind=KIND, severity="critical", worker=worker, examples=verdict.examples,
        message=f"{verdict.reason} [template {fingerprint}] -- tokenizing stopped; fix the data or template and "
                "replay, or set tokenizer.gate_override=true to go on",
    )


async def gate_alerts(bus: Any, run: str) -> list[Alert]:
    """Every quality-gate Alert of a run, oldest first (from the PROGRESS stream's history)."""
    out = []
    async for _, msg in bus.read_log(Streams.PROGRESS, Subjects.alert(run, STAGE), 1, Alert):
        if msg.kind == KIND:
            out.append(msg)
    return out

"""The dashboard's view model, folded from the real progress events: pure functions, no I/O.

`RunState` is what the listener keeps per run (each worker's latest event and a bounded time
series, alerts, checkpoints, eval reports); `apply` folds one event into it. The run's counts, rates,
ETAs, silent workers and engines are its one view (`run_view`: `shared.view.build_view`, what `dfpipe
status` and `dfpipe run` show too); the functions here only lay that view and the charts' series out.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from shared.config import ViewConfig
from shared.ledger import DurableCounts
from shared.messages import (
    Alert,
    EvalReport,
    FeederProgress,
    GeneratorProgress,
    ProgressMessage,
    TokenizerProgress,
    TrainerProgress,
)
from shared.view import LedgerFacts, RunView, build_view, empty_facts

HISTORY_POINTS = 2000  # per worker; older points are thinned, so a 30-day run still fits
STAGE_OF = {
    FeederProgress: "feed",
    GeneratorProgress: "generate",
    TokenizerProgress: "tokenize",
    TrainerProgress: "train",
    EvalReport: "eval",
}


@dataclass
class WorkerState:
    stage: str
    worker: str
    latest: ProgressMessage
    first_ts: float
    history: deque[ProgressMessage] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))

    @property
    def last_ts(self) -> float:
        return self.latest.ts


@dataclass
class RunState:
    run: str
    workers: dict[tuple[str, str], WorkerState] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    evals: list[EvalReport] = field(default_factory=list)
    checkpoints: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (step, ts)
    first_ts: float = 0.0
    last_ts: float = 0.0
    events: int = 0

    def copy(self) -> RunState:
        """A copy the page can read while the listener keeps folding (events themselves are never mutated)."""
        workers = {k: WorkerState(w.stage, w.worker, w.latest, w.first_ts, deque(w.history, maxlen=HISTORY_POINTS))
                   for k, w in self.workers.items()}
        return RunState(self.run, workers, list(self.alerts), list(self.evals), dict(self.checkpoints),
                        self.first_ts, self.last_ts, self.events)


def stage_of(msg: ProgressMessage) -> str:
    return msg.stage if isinstance(msg, Alert) else STAGE_OF[type(msg)]


def apply(runs: dict[str, RunState], msg: ProgressMessage) -> None:
    """Fold one event (in stream order) into the per-run state."""
    rs = runs.get(msg.run)
    if rs is None:
        rs = runs[msg.run] = RunState(msg.run, first_ts=msg.ts)
    rs.events += 1
    rs.first_ts = min(rs.first_ts, msg.ts) if rs.first_ts else msg.ts
    rs.last_ts = max(rs.last_ts, msg.ts)
    if isinstance(msg, Alert):
        rs.alerts.append(msg)
        del rs.alerts[:-200]
        return
    if isinstance(msg, EvalReport):
        rs.evals.append(msg)
    if isinstance(msg, TrainerProgress) and msg.checkpoint_key:
        rs.checkpoints.setdefault(msg.checkpoint_key, (msg.step, msg.ts))
    key = (stage_of(msg), msg.worker)
    ws = rs.workers.get(key)
    if ws is None:
        ws = rs.workers[key] = WorkerState(key[0], msg.worker, msg, msg.ts)
    if msg.ts >= ws.latest.ts:
        ws.latest = msg
    _append_thinned(ws.history, msg)


def _append_thinned(history: deque[ProgressMessage], msg: ProgressMessage) -> None:
    """Keep the series bounded: when full, drop every other point of the older half."""
    if len(history) == history.maxlen:
        keep = list(history)
        half = len(keep) // 2
        history.clear()
        history.extend(keep[:half:2] + keep[half:])
    history.append(msg)


def workers_of(rs: RunState, stage: str) -> list[WorkerState]:
    return sorted((w for (s, _), w in rs.workers.items() if s == stage), key=lambda w: w.worker)


# --- views -------------------------------------------------------------------------------------


def run_view(rs: RunState, facts: LedgerFacts | None, now: float, cfg: ViewConfig) -> RunView:
    """The run's one view (`shared.view`), from the ledger's facts and each worker's latest event: the page
    renders it and computes none of those numbers itself."""
    latest = [w.latest for w in rs.workers.values()]
    return build_view(rs.run, facts or empty_facts(), latest, now, cfg)


def elapsed_s(rs: RunState, now: float) -> float:
    return max(0.0, now - rs.first_ts) if rs.first_ts else 0.0


def generator_rows(view: RunView) -> list[dict[str, Any]]:
    rows = []
    for w in view.workers:
        if w.stage != "generate":
            continue
        rows.append({
            "worker": w.worker,
            "state": w.state,
            "completions": w.completions,
            "prompt tok/s": round(w.prompt_tokens_per_s, 1),
            "completion tok/s": round(w.tokens_per_s, 1),
            "in flight": w.in_flight,
            "concurrency": w.concurrency,
            "errors": w.errors,
            "shards": w.shards,
            "spec accept": w.spec_accept_length,
            "last heartbeat": f"{w.age_s:.0f}s ago",
            "silent": w.silent,
        })
    return rows


def engine_rows(view: RunView) -> list[dict[str, Any]]:
    """One row per inference engine: how full its generators keep it."""
    return [{"engine": e.engine, "generators": ", ".join(e.generators), "running": e.running,
             "max running": e.max_running, "fill": None if e.fill is None else f"{100 * e.fill:.0f}%",
             "queued": e.queued, "tok/s": e.tokens_per_s, "concurrency": e.concurrency} for e in view.engines]


def generator_series(rs: RunState) -> list[dict[str, Any]]:
    """Long-form rows for the tokens/s chart: one per (event, worker)."""
    return [
        {"time": m.ts, "worker": w.worker, "prompt tok/s": m.prompt_tokens_per_s,
         "completion tok/s": m.completion_tokens_per_s}
        for w in workers_of(rs, "generate") for m in w.history
    ]


def _sum_latest(workers: list[WorkerState], value: Any) -> int:
    return int(sum(value(w.latest) for w in workers))


def finish_reasons(rs: RunState) -> tuple[dict[str, int], float]:
    """Summed finish-reason counts and the truncated share (finish_reason=length) in percent."""
    total: dict[str, int] = {}
    for w in workers_of(rs, "generate"):
        for reason, n in w.latest.finish_reasons.items():  # type: ignore[union-attr]
            total[reason] = total.get(reason, 0) + n
    n = sum(total.values())
    return total, (100.0 * total.get("length", 0) / n if n else 0.0)


@dataclass
class QualityView:
    samples_in: int
    samples_kept: int
    supervised_tokens: int
    histogram: list[tuple[int, int]]  # (bucket lower bound, count), sorted
    dropped: dict[str, int]
    drift: int
    gate_tripped: bool
    gate_alerts: list[Alert]


def quality_view(rs: RunState, durable: DurableCounts | None = None) -> QualityView:
    """The tokenized data's quality: from the run's TokenizedShard events (`durable`) once there are any, so
    a restarted tokenizer does not start the panel at zero; before that, from the tokenizers' counters."""
    tok = workers_of(rs, "tokenize")
    gate = [a for a in rs.alerts if a.kind == "quality_gate"]
    tripped = any(w.latest.gate_tripped for w in tok) or bool(gate)  # type: ignore[union-attr]
    counted_hist, counted_dropped = Counter(), Counter()
    for w in tok:
        m: TokenizerProgress = w.latest  # type: ignore[assignment]
        counted_hist.update(m.supervised_histogram)
        counted_dropped.update(m.dropped)
    if durable is not None and durable.tokenized_shards > 0:
        # events published before they carried a histogram have none: the counters' then
        hist, dropped = Counter(durable.histogram) or counted_hist, Counter(durable.dropped)
        samples_in, kept, supervised, drift = durable.samples_in, durable.kept, durable.supervised_tokens, durable.drift
    else:
        hist, dropped = counted_hist, counted_dropped
        samples_in, kept = _sum_latest(tok, lambda m: m.samples_in), _sum_latest(tok, lambda m: m.samples_kept)
        supervised, drift = _sum_latest(tok, lambda m: m.supervised_tokens), _sum_latest(tok, lambda m: m.retokenization_drift)
    return QualityView(
        samples_in=samples_in, samples_kept=kept, supervised_tokens=supervised,
        histogram=sorted((int(float(b)), n) for b, n in hist.items()), dropped=dict(dropped.most_common()),
        drift=drift, gate_tripped=tripped, gate_alerts=gate,
    )


def trainer_series(rs: RunState) -> list[dict[str, Any]]:
    """Loss and τ by step; a report before the first step (the 'starting'/'waiting for data' placeholder, loss 0
    and τ 0) is no data point."""
    return [
        {"worker": w.worker, "step": m.step, "loss": m.loss, "estimated τ": m.estimated_tau,
         "tokens/s": m.tokens_per_s, "time": m.ts}
        for w in workers_of(rs, "train") for m in w.history if m.step > 0  # type: ignore[union-attr]
    ]


def checkpoint_rows(rs: RunState) -> list[dict[str, Any]]:
    return [{"step": step, "S3 key": key, "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))}
            for key, (step, ts) in sorted(rs.checkpoints.items(), key=lambda kv: kv[1][0])]


def eval_rows(rs: RunState) -> list[dict[str, Any]]:
    return [{"checkpoint": e.checkpoint_key, "prompts": e.prompts, "temperature": e.temperature, "τ": round(e.tau, 3),
             "speedup": round(e.speedup, 2),
             "lossless": e.lossless if e.lossless is not None else "by the sampling rule", "mismatches": e.mismatches}
            for e in rs.evals]


def other_alerts(rs: RunState) -> list[Alert]:
    return [a for a in rs.alerts if a.kind != "quality_gate"]


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m}m"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {s}s" if m else f"{s}s"

"""The dashboard's view model, folded from the real progress events: pure functions, no I/O.

`RunState` is what the listener keeps per run (each worker's latest event and a bounded time
series, alerts, checkpoints, eval reports); `apply` folds one event into it; the `*_view`
functions turn a `RunState` into the rows and numbers the page shows. Counters in progress
events are cumulative per worker, so a stage's total is the sum of its workers' latest values.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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

HISTORY_POINTS = 2000  # per worker; older points are thinned, so a 30-day run still fits
RATE_WINDOW_S = 300.0  # rates and ETA from the last five minutes of counters
STAGE_OF = {
    FeederProgress: "feed",
    GeneratorProgress: "generate",
    TokenizerProgress: "tokenize",
    TrainerProgress: "train",
    EvalReport: "eval",
}
STOPPED_STATES = {"stopped", "done", "finished"}


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


@dataclass
class StageTotal:
    stage: str
    label: str
    done: int
    total: int | None  # None: unknown yet
    rate_per_s: float
    eta_s: float | None
    help: str = ""  # where the number comes from, shown on hover

    @property
    def fraction(self) -> float:
        if not self.total:
            return 0.0
        return max(0.0, min(1.0, self.done / self.total))


def _counter_series(workers: list[WorkerState], value: Any) -> list[tuple[float, float]]:
    """(ts, sum over workers) at each event: each worker contributes its latest value at that time."""
    events = sorted(((m.ts, w.worker, m) for w in workers for m in w.history), key=lambda t: t[0])
    current: dict[str, float] = {}
    out = []
    for ts, worker, m in events:
        current[worker] = float(value(m))
        out.append((ts, sum(current.values())))
    return out


def rate(workers: list[WorkerState], value: Any, now: float, window_s: float = RATE_WINDOW_S) -> float:
    """Units per second of a summed cumulative counter over the last `window_s` seconds."""
    return series_rate(_counter_series(workers, value), now, window_s)


def series_rate(series: Sequence[tuple[float, float]], now: float, window_s: float = RATE_WINDOW_S) -> float:
    """Units per second of a cumulative (ts, value) series over its last `window_s` seconds."""
    if len(series) < 2:
        return 0.0
    end_ts, end_v = series[-1]
    recent = [(t, v) for t, v in series if t >= min(now, end_ts) - window_s]
    start_ts, start_v = recent[0] if len(recent) >= 2 else series[-2]
    if end_ts - start_ts <= 0:
        return 0.0
    return max(0.0, (end_v - start_v) / (end_ts - start_ts))


def _sum_latest(workers: list[WorkerState], value: Any) -> int:
    return int(sum(value(w.latest) for w in workers))


def stage_totals(rs: RunState, now: float, manifest: dict[str, Any] | None = None,
                 durable: DurableCounts | None = None) -> list[StageTotal]:
    """fed → generated → tokenized → trained, each against the stage before it (fed against the manifest).

    Generated and tokenized come from the run's shard events (`durable`) once there are any: unique
    prompts in S3, shards tokenized of shards written, exact through worker restarts and redeliveries.
    Before the first shard, from the workers' progress counters.
    """
    feed, gen = workers_of(rs, "feed"), workers_of(rs, "generate")
    tok, train = workers_of(rs, "tokenize"), workers_of(rs, "train")
    fed = _sum_latest(feed, lambda m: m.accepted)
    manifest_total = int(manifest["total_accepted"]) if manifest and "total_accepted" in manifest else None
    prompts = manifest_total if manifest_total is not None else (fed or None)
    trained = max((w.latest.samples_seen for w in train), default=0)

    def eta(done: int, of: int | None, rate_s: float) -> float | None:
        return (of - done) / rate_s if of is not None and rate_s > 0 and of >= done else None

    exact = durable is not None and durable.shards > 0
    source = ("from the run's shard events in S3" if exact else
              "from the workers' counters until the first shard is written (a restart resets them)")
    if exact:
        generated, gen_rate = durable.completed, series_rate(durable.completed_points, now)
        shards, tokenized, tok_rate = durable.shards, durable.tokenized_shards, series_rate(durable.tokenized_points, now)
        kept = durable.kept
    else:
        generated, gen_rate = _sum_latest(gen, lambda m: m.completions), rate(gen, lambda m: m.completions, now)
        shards, tokenized = _sum_latest(gen, lambda m: m.shards), _sum_latest(tok, lambda m: m.shards)
        tok_rate, kept = rate(tok, lambda m: m.shards, now), _sum_latest(tok, lambda m: m.samples_kept)

    out = []
    r = rate(feed, lambda m: m.accepted, now)
    out.append(StageTotal("feed", "fed", fed, prompts, r, eta(fed, prompts, r)))
    out.append(StageTotal("generate", "generated", generated, prompts, gen_rate, eta(generated, prompts, gen_rate),
                          f"unique prompts with a completion, {source}"))
    of = shards or None
    out.append(StageTotal("tokenize", "tokenized shards", tokenized, of, tok_rate, eta(tokenized, of, tok_rate),
                          f"completion shards tokenized of those written, {source}"))
    r = max((rate([w], lambda m: m.samples_seen, now) for w in train), default=0.0)
    of = kept or None
    out.append(StageTotal("train", "trained (samples seen)", trained, of, r, eta(trained, of, r)))
    return out


def elapsed_s(rs: RunState, now: float) -> float:
    return max(0.0, now - rs.first_ts) if rs.first_ts else 0.0


def is_silent(ws: WorkerState, now: float, silent_after_s: float) -> bool:
    """No heartbeat for `silent_after_s` while the worker still claimed to be running."""
    m = ws.latest
    finished = (isinstance(m, FeederProgress) and m.done) or getattr(m, "state", "running") in STOPPED_STATES
    return not finished and not isinstance(m, EvalReport) and now - m.ts > silent_after_s


def silent_workers(rs: RunState, now: float, silent_after_s: float) -> list[WorkerState]:
    return [w for w in rs.workers.values() if is_silent(w, now, silent_after_s)]


def generator_rows(rs: RunState, now: float, silent_after_s: float) -> list[dict[str, Any]]:
    rows = []
    for w in workers_of(rs, "generate"):
        m: GeneratorProgress = w.latest  # type: ignore[assignment]
        rows.append({
            "worker": w.worker,
            "state": m.state,
            "completions": m.completions,
            "prompt tok/s": round(m.prompt_tokens_per_s, 1),
            "completion tok/s": round(m.completion_tokens_per_s, 1),
            "in flight": m.in_flight,
            "errors": m.errors,
            "shards": m.shards,
            "spec accept": m.spec_accept_length,
            "last heartbeat": f"{max(0.0, now - m.ts):.0f}s ago",
            "silent": is_silent(w, now, silent_after_s),
        })
    return rows


def generator_series(rs: RunState) -> list[dict[str, Any]]:
    """Long-form rows for the tokens/s chart: one per (event, worker)."""
    return [
        {"time": m.ts, "worker": w.worker, "prompt tok/s": m.prompt_tokens_per_s,
         "completion tok/s": m.completion_tokens_per_s}
        for w in workers_of(rs, "generate") for m in w.history
    ]


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
    return [
        {"worker": w.worker, "step": m.step, "loss": m.loss, "estimated τ": m.estimated_tau,
         "tokens/s": m.tokens_per_s, "time": m.ts}
        for w in workers_of(rs, "train") for m in w.history  # type: ignore[union-attr]
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

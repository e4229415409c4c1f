"""`dfpipe status --run R`: where a run stands, rebuilt from the bus and S3 alone (no service state needed).

Completed = unique prompt_ids in the run's ShardWritten log (`DurableLog`, which the dashboard
folds too); in flight / queued from the shared
consumer; rates from each worker's latest progress event (workers silent for over two minutes
are listed but not counted); alerts (quality gate, crash loops) from the progress stream.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.js.errors

from shared.bus import Bus
from shared.config import Config
from shared.messages import (
    Alert,
    GeneratorProgress,
    Message,
    ShardWritten,
    Subjects,
    TokenizedShard,
    TrainerProgress,
)
from shared.store import Keys, Store

SILENT_S = 120.0
POINTS = 512  # (ts, count) points kept per counter for rates: minutes of history at any shard rate


@dataclass(frozen=True)
class DurableCounts:
    """A copy of a `DurableLog`'s numbers (no id sets), cheap enough to take on every page refresh."""

    completed: int  # unique prompt_ids in completion shards
    records: int  # completion records, including prompts written twice after a redelivery
    shards: int  # completion shards
    tokenized_shards: int  # completion shards with a tokenized shard
    kept: int  # training samples in the latest tokenized shard of each completion shard
    completed_points: tuple[tuple[float, int], ...]  # (event ts, completed) per shard, the latest POINTS
    tokenized_points: tuple[tuple[float, int], ...]  # (event ts, tokenized_shards)
    # Data quality over the same latest tokenized shards: records in, supervised tokens kept, drops by reason,
    # supervised tokens per sample (bucket -> samples), token-exact records whose text re-tokenizes otherwise.
    samples_in: int = 0
    supervised_tokens: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    histogram: dict[str, int] = field(default_factory=dict)
    drift: int = 0


class DurableLog:
    """What a run has durably produced, folded from its ShardWritten and TokenizedShard events.

    The events are the record (each says an object is in S3), so these counts survive what worker
    counters do not: a restarted worker starts its counters at zero, and a prompt redelivered after
    a crash is completed twice. Prompt ids are kept as 64-bit hashes: ~50 MB for a million prompts,
    with a chance of one collision below 1e-7.
    """

    def __init__(self) -> None:
        self.prompts: set[int] = set()
        self.shard_keys: set[str] = set()
        self.records = 0
        self.tokenized: dict[str, TokenizedShard] = {}  # completion shard key -> its latest tokenized shard
        self._quality = _QualityTotals()  # summed over self.tokenized, kept current event by event
        self.completed_points: deque[tuple[float, int]] = deque(maxlen=POINTS)
        self.tokenized_points: deque[tuple[float, int]] = deque(maxlen=POINTS)

    @property
    def completed(self) -> int:
        return len(self.prompts)

    def add(self, event: ShardWritten | TokenizedShard) -> None:
        if isinstance(event, ShardWritten):
            if event.key in self.shard_keys:  # the same shard announced again (a republish): nothing new
                return
            self.shard_keys.add(event.key)
            self.records += event.num_records
            self.prompts.update(hash(p) for p in event.prompt_ids)
            self.completed_points.append((event.ts, self.completed))
        else:
            previous = self.tokenized.get(event.source_key)
            if previous is not None and previous.key == event.key:
                return  # the same tokenized shard announced again (from S3, maybe without the numbers): nothing new
            if previous is not None:
                self._quality.add(previous, -1)
            self.tokenized[event.source_key] = event
            self._quality.add(event, 1)
            if previous is None:
                self.tokenized_points.append((event.ts, len(self.tokenized)))

    def counts(self) -> DurableCounts:
        q = self._quality
        return DurableCounts(
            self.completed, self.records, len(self.shard_keys), len(self.tokenized), q.kept, tuple(self.completed_points),
            tuple(self.tokenized_points), samples_in=q.samples_in, supervised_tokens=q.supervised_tokens,
            dropped=dict(+q.dropped), histogram=dict(+q.histogram), drift=q.drift,
        )


@dataclass
class _QualityTotals:
    kept: int = 0
    samples_in: int = 0
    supervised_tokens: int = 0
    drift: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    histogram: Counter[str] = field(default_factory=Counter)

    def add(self, e: TokenizedShard, sign: int) -> None:
        self.kept += sign * e.num_samples
        self.samples_in += sign * (e.num_samples + sum(e.dropped.values()))
        self.supervised_tokens += sign * e.num_supervised
        self.drift += sign * e.retokenization_drift
        for counter, items in ((self.dropped, e.dropped), (self.histogram, e.supervised_histogram)):
            for k, n in items.items():
                counter[k] += sign * n


class RunStatus(msgspec.Struct, kw_only=True):
    run: str
    total: int = 0  # accepted by the feeder (manifest)
    rejects: int = 0
    completed: int = 0  # unique prompt_ids in completion shards
    completion_records: int = 0  # including duplicates from redeliveries
    shards: int = 0
    in_flight: int = 0  # delivered, not acked
    queued: int = 0  # not yet delivered
    failed: int = 0  # engine/S3 errors reported by generators (each retried)
    dead_lettered: dict[str, int] = {}
    completion_tokens_per_s: float = 0.0
    completions_per_s: float = 0.0
    eta_s: float | None = None
    workers: list[dict[str, Any]] = []
    alerts: list[Alert] = []
    tokenized_samples: int = 0  # in the latest tokenized shard of each completion shard
    tokenized_shards: int = 0
    tokenized_records: int = 0  # completion records those shards were built from
    dropped: dict[str, int] = {}  # records not kept, by reason (duplicates included)
    trainer_step: int | None = None


async def run_status(cfg: Config, bus: Bus, store: Store | None, log: DurableLog | None = None) -> RunStatus:
    """`log`, when given, is the (empty) DurableLog to fold the run's shard events into, for callers that
    need more of them than the status holds."""
    run = cfg.run
    st = RunStatus(run=run)
    if store is not None:
        key = Keys.manifest(run)
        if await asyncio.to_thread(store.exists, key):
            manifest = msgspec.json.decode(await asyncio.to_thread(store.get_bytes, key))
            st.total = int(manifest.get("total_accepted", 0))
            st.rejects = int(manifest.get("total_rejected", 0))
    log = DurableLog() if log is None else log
    async for _, event in bus.replay("SHARDS", Subjects.shards(run), 1, ShardWritten):
        log.add(event)
    async for _, event in bus.replay("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard):
        log.add(event)
    counts = log.counts()
    st.tokenized_samples, st.tokenized_shards, st.tokenized_records = counts.kept, counts.tokenized_shards, counts.samples_in
    st.dropped = dict(sorted(counts.dropped.items(), key=lambda kv: -kv[1]))
    st.completed, st.shards, st.completion_records = log.completed, len(log.shard_keys), log.records
    try:
        info = await bus.js.consumer_info("PROMPTS", f"generate-{run}")
        st.in_flight, st.queued = info.num_ack_pending, info.num_pending
    except nats.js.errors.NotFoundError:  # no generator has started yet: everything fed is queued
        sinfo = await bus.js.stream_info("PROMPTS", subjects_filter=Subjects.prompts(run))
        st.queued = sum((sinfo.state.subjects or {}).values())
    for _, letter in await bus.dead_letters(run):
        st.dead_lettered[letter.stage] = st.dead_lettered.get(letter.stage, 0) + 1
    now = time.time()
    latest: list[tuple[int, Message]] = await bus.latest_per_subject("PROGRESS", Subjects.all_progress(run))
    for _, p in latest:
        age = now - p.ts
        if isinstance(p, GeneratorProgress):
            live = age < SILENT_S and p.state != "stopped"
            st.workers.append({"worker": p.worker, "completions": p.completions, "tokens_per_s": p.completion_tokens_per_s,
                               "in_flight": p.in_flight, "errors": p.errors, "state": p.state if live or
                               p.state == "stopped" else "silent", "age_s": round(age, 1)})
            st.failed += p.errors
            if live:
                st.completion_tokens_per_s += p.completion_tokens_per_s
                st.completions_per_s += p.completions_per_s
        elif isinstance(p, TrainerProgress):
            st.trainer_step = max(st.trainer_step or 0, p.step)
    remaining = max(0, st.total - st.completed)
    if remaining == 0 and st.total:
        st.eta_s = 0.0
    elif st.completions_per_s > 0:
        st.eta_s = remaining / st.completions_per_s
    alerts = [a async for _, a in bus.replay("PROGRESS", Subjects.all_alerts(run), 1, Alert)]
    latest_alert: dict[tuple[str, str, str], Alert] = {}
    for a in alerts:
        latest_alert[(a.stage, a.kind, a.worker)] = a
    st.alerts = list(latest_alert.values())
    return st


@dataclass
class Picture:
    """A run's stages as the bus and S3 have them: what `dfpipe run` shows and phases by, and what the
    trainer asks before it counts a pass over the data as an epoch."""

    status: RunStatus
    feed_done: bool
    shards: int
    tokenized_shards: int
    tokenized_samples: int
    tokenize_dead: int
    trainer: TrainerProgress | None
    alerts: list[Alert]


async def picture(cfg: Config, bus: Bus, store: Store) -> Picture:
    log = DurableLog()
    st = await run_status(cfg, bus, store, log)  # one replay of the shard logs serves the status and this
    shard_keys = log.shard_keys
    trainer = None
    for _, p in await bus.latest_per_subject("PROGRESS", f"dflash.{cfg.run}.train.progress.*"):
        if isinstance(p, TrainerProgress) and (trainer is None or p.step > trainer.step):
            trainer = p
    feed_done = await asyncio.to_thread(store.exists, Keys.manifest(cfg.run))
    return Picture(
        status=st, feed_done=feed_done, shards=len(shard_keys),
        tokenized_shards=len(log.tokenized.keys() & shard_keys),
        tokenized_samples=sum(t.num_samples for k, t in log.tokenized.items() if k in shard_keys),
        tokenize_dead=st.dead_lettered.get("tokenize", 0), trainer=trainer, alerts=st.alerts,
    )


def generation_done(p: Picture) -> bool:
    st = p.status
    return p.feed_done and st.total > 0 and st.completed + st.dead_lettered.get("generate", 0) >= st.total \
        and st.in_flight == 0


def tokenization_done(p: Picture) -> bool:
    return p.shards > 0 and p.tokenized_shards + p.tokenize_dead >= p.shards


def data_complete(p: Picture) -> bool:
    """The run's training data is all there: generation and tokenization are done, or nothing was ever
    fed or generated (then the tokenized shards announced by hand are the whole of it)."""
    st = p.status
    nothing_fed = not p.feed_done and st.total == 0 and st.queued == 0 and st.in_flight == 0 and p.shards == 0
    return nothing_fed or (generation_done(p) and tokenization_done(p))


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown (no live generator)"
    h, rem = divmod(int(s), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def format_status(st: RunStatus) -> str:
    pct = f" ({100 * st.completed / st.total:.1f}%)" if st.total else ""
    lines = [
        f"run {st.run}",
        f"  prompts     {st.total} accepted, {st.rejects} rejected",
        f"  completed   {st.completed}{pct} unique in {st.shards} shards ({st.completion_records} records)",
        f"  in flight   {st.in_flight}   queued {st.queued}   failed attempts {st.failed}",
        f"  dead letters {sum(st.dead_lettered.values())}"
        + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(st.dead_lettered.items())) + ")" if st.dead_lettered else ""),
        f"  rate        {st.completion_tokens_per_s:.1f} completion tokens/s, {st.completions_per_s:.2f} prompts/s",
        f"  ETA         {_duration(st.eta_s)}",
    ]
    if st.tokenized_shards:
        lines.append(f"  tokenized   {st.tokenized_samples} samples kept of {st.tokenized_records} records, "
                     f"{st.tokenized_shards}/{st.shards} shards")
        if st.dropped:
            lines.append("  dropped     " + ", ".join(f"{reason} {n}" for reason, n in st.dropped.items()))
    if st.trainer_step is not None:
        lines.append(f"  trainer     step {st.trainer_step}")
    for w in st.workers:
        lines.append(f"    {w['worker']:<20} {w['state']:<9} {w['completions']:>8} done  {w['tokens_per_s']:>8.1f} tok/s  "
                     f"in flight {w['in_flight']:<4} errors {w['errors']:<4} last seen {w['age_s']}s ago")
    for a in st.alerts:
        lines.append(f"  ALERT [{a.severity}] {a.stage}/{a.kind}: {a.message}")
        for ex in a.examples[:3]:
            lines.append(f"      e.g. {ex[:160]!r}")
    return "\n".join(lines)


async def _status(args: argparse.Namespace) -> int:
    import sys

    from shared.cli import load

    cfg = load(args)
    store = await asyncio.to_thread(Store.open, cfg, ensure_bucket=False)
    async with await Bus.connect(cfg.bus, "status", deadline_s=10) as bus:
        if missing := await bus.run_missing(cfg.run):
            print(f"dfpipe status: {missing}", file=sys.stderr)
            return 2
        st = await run_status(cfg, bus, store)
    print(msgspec.json.encode(st).decode() if args.json else format_status(st))
    return 1 if any(a.severity == "critical" for a in st.alerts) else 0


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("status", help="a run's progress: completed, in flight, dead letters, rate, ETA, alerts")
    p.add_argument("--run", required=True)
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.set_defaults(func=lambda args: asyncio.run(_status(args)))

"""`dfpipe status --run R`: where a run stands, rebuilt from the bus and S3 alone (no service state needed).

The run's durable facts (completed = unique prompt_ids in its ShardWritten log, tokenized shards, data
quality, dead letters, alerts, the feed manifest) and the prompts in flight / queued come from its ledger
(`shared.ledger.RunLedger`: a snapshot plus the events since, and the generate consumer's queue); rates
from each worker's latest progress event (workers silent for over two minutes are listed but not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.ledger import RunLedger, StageCounts
from shared.messages import Alert, GeneratorProgress, Message, TrainerProgress
from shared.store import Store
from shared.topology import ANY, Streams, Subjects

SILENT_S = 120.0


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


async def run_status(cfg: Config, bus: Bus, store: Store | None, ledger: RunLedger | None = None) -> RunStatus:
    """`ledger`: the caller's RunLedger, kept between calls so that each folds only what is new (without
    one, a fresh ledger starts from the snapshot)."""
    return (await _read(cfg, bus, store, ledger))[0]


async def _read(cfg: Config, bus: Bus, store: Store | None,
                ledger: RunLedger | None) -> tuple[RunStatus, RunLedger, TrainerProgress | None]:
    """The status, the refreshed ledger it came from, and the trainer's latest progress."""
    run = cfg.run
    st = RunStatus(run=run)
    ledger = ledger or RunLedger(cfg, bus, store)
    fold = await ledger.refresh()
    if ledger.manifest is not None:
        st.total = int(ledger.manifest.get("total_accepted", 0))
        st.rejects = int(ledger.manifest.get("total_rejected", 0))
    counts = fold.counts()
    st.tokenized_samples, st.tokenized_shards, st.tokenized_records = counts.kept, counts.tokenized_shards, counts.samples_in
    st.dropped = dict(sorted(counts.dropped.items(), key=lambda kv: -kv[1]))
    st.completed, st.shards, st.completion_records = counts.completed, counts.shards, counts.records
    st.in_flight, st.queued = ledger.in_flight, ledger.queued
    st.dead_lettered = dict(ledger.dead_lettered)
    now = time.time()
    trainer = None
    latest: list[tuple[int, Message]] = await bus.latest_per_subject(Streams.PROGRESS, Subjects.progress(run, ANY, ANY))
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
            if trainer is None or p.step > trainer.step:
                trainer = p
    remaining = max(0, st.total - st.completed)
    if remaining == 0 and st.total:
        st.eta_s = 0.0
    elif st.completions_per_s > 0:
        st.eta_s = remaining / st.completions_per_s
    st.alerts = fold.latest_alerts()
    return st, ledger, trainer


@dataclass
class RunOverview:
    """What `dfpipe run` shows and moves its phases by: the status, the stage numbers (`generation_done`,
    `tokenization_done` in shared.ledger), the tokenized samples, the trainer's latest progress, alerts."""

    status: RunStatus
    stages: StageCounts
    tokenized_samples: int
    trainer: TrainerProgress | None
    alerts: list[Alert]


async def run_overview(cfg: Config, bus: Bus, store: Store, ledger: RunLedger | None = None) -> RunOverview:
    """`ledger` as for `run_status`: a caller that polls keeps one."""
    st, ledger, trainer = await _read(cfg, bus, store, ledger)
    fold = ledger.ledger
    assert fold is not None
    return RunOverview(status=st, stages=ledger.stages(), tokenized_samples=fold.tokenized_samples_in_shards,
                       trainer=trainer, alerts=st.alerts)


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
            return Exit.USAGE
        ledger = RunLedger(cfg, bus, store)
        st = await run_status(cfg, bus, store, ledger)
        print(msgspec.json.encode(st).decode() if args.json else format_status(st), flush=True)
        await ledger.flush()  # a snapshot this call started (a long tail) is written before the process ends
    return Exit.ALERT if any(a.severity == "critical" for a in st.alerts) else Exit.OK


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("status", help="a run's progress: completed, in flight, dead letters, rate, ETA, alerts")
    p.add_argument("--run", required=True)
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.set_defaults(func=lambda args: asyncio.run(_status(args)))

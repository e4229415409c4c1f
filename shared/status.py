"""`dfpipe status --run R`: where a run stands, rebuilt from the bus and S3 alone (no service state needed).

What it shows is the run's one view (`shared.view.build_view`: counts, rates over `[view] rate_window_s`,
ETA per stage, silent workers, alerts, engines), the same numbers `dfpipe run`'s display and the dashboard
show; this module reads it (the run's ledger: a snapshot plus the events since) and renders it as text or
JSON (`--json`: the `RunView` itself, with its `schema` version).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.ledger import RunLedger, StageCounts
from shared.messages import Alert
from shared.store import Store
from shared.view import RunView, duration, rate_text, read_view, training_text

RunStatus = RunView  # the name callers knew it by


async def run_status(cfg: Config, bus: Bus, store: Store | None, ledger: RunLedger | None = None) -> RunView:
    """`ledger`: the caller's RunLedger, kept between calls so that each folds only what is new (without
    one, a fresh ledger starts from the snapshot)."""
    return await read_view(cfg, bus, ledger or RunLedger(cfg, bus, store))


@dataclass
class RunOverview:
    """What `dfpipe run` shows and moves its phases by: the view, and the stage numbers (`generation_done`,
    `tokenization_done` in shared.ledger)."""

    view: RunView
    stages: StageCounts
    tokenized_samples: int  # in the tokenized shards of the run's completion shards (what training will read)

    @property
    def status(self) -> RunView:
        return self.view

    @property
    def alerts(self) -> list[Alert]:
        return self.view.alerts


async def run_overview(cfg: Config, bus: Bus, store: Store, ledger: RunLedger | None = None) -> RunOverview:
    """`ledger` as for `run_status`: a caller that polls keeps one."""
    ledger = ledger or RunLedger(cfg, bus, store)
    view = await read_view(cfg, bus, ledger)
    assert ledger.ledger is not None
    return RunOverview(view=view, stages=ledger.stages(), tokenized_samples=ledger.ledger.tokenized_samples_in_shards)


def format_status(v: RunView) -> str:
    gen, tok = v.stage("generate"), v.stage("tokenize")
    pct = f" ({100 * v.completed / v.total:.1f}%)" if v.total else ""
    lines = [
        f"run {v.run}",
        f"  prompts     {v.total} accepted, {v.rejects} rejected",
        f"  completed   {v.completed}{pct} unique in {v.shards} shards ({v.completion_records} records)",
        f"  in flight   {v.in_flight}   queued {v.queued}   failed attempts {v.failed}",
        f"  dead letters {sum(v.dead_lettered.values())}"
        + (" (" + ", ".join(f"{k} {n}" for k, n in sorted(v.dead_lettered.items())) + ")" if v.dead_lettered else ""),
        f"  rate        {v.completion_tokens_per_s:.1f} completion tokens/s, {v.completions_per_s:.2f} prompts/s "
        f"(last {v.rate_window_s:.0f}s)",
        f"  ETA         {duration(gen.eta_s, 'unknown (no rate yet)')}",
    ]
    if v.tokenized_shards:
        lines.append(f"  tokenized   {v.tokenized_samples} samples kept of {v.tokenized_records} records, "
                     f"{v.tokenized_shards}/{v.shards} shards, {rate_text(tok.rate_per_s, tok.unit)}, ETA {duration(tok.eta_s)}")
        if v.dropped:
            lines.append("  dropped     " + ", ".join(f"{reason} {n}" for reason, n in v.dropped.items()))
    if v.training is not None:
        lines.append(f"  trainer     {training_text(v)}")
    for w in v.workers:
        if w.stage == "generate":
            lines.append(f"    {'generate/' + w.worker:<20} {w.state:<9} {w.completions:>8} done  {w.tokens_per_s:>8.1f} tok/s  "
                         f"in flight {w.in_flight:<4} errors {w.errors:<4} last seen {w.age_s}s ago")
        else:
            lines.append(f"    {w.stage + '/' + w.worker:<20} {w.state:<9} last seen {w.age_s}s ago")
    for e in v.engines:
        fill = f"{100 * e.fill:.0f}%" if e.fill is not None else "?"
        tps = f"{e.tokens_per_s:.0f}" if e.tokens_per_s is not None else "?"
        lines.append(f"  engine      {e.engine}: running {_n(e.running)}/{_n(e.max_running)} (fill {fill}), queued "
                     f"{_n(e.queued)}, {tps} tok/s, concurrency {e.concurrency} from {', '.join(e.generators)}")
    if v.silent:
        lines.append(f"  SILENT      {', '.join(v.silent)} (no report for over {v.silent_after_s:.0f}s)")
    for a in v.alerts:
        lines.append(f"  ALERT [{a.severity}] {a.stage}/{a.kind}: {a.message}")
        for ex in a.examples[:3]:
            lines.append(f"      e.g. {ex[:160]!r}")
    return "\n".join(lines)


def _n(x: Any) -> str:
    return "?" if x is None else str(x)


async def _status(args: argparse.Namespace) -> int:
    import sys

    from shared.cli import load, reader_config

    cfg = reader_config(load(args))
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

"""`dfpipe feed`: queue a prompt set for a run."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any


async def _feed(args: argparse.Namespace) -> int:
    from shared.bus import Bus
    from shared.cli import load
    from shared.store import Keys, Store

    from .feed import Feeder
    from .sources import SourceError

    cfg = load(args)
    store = await asyncio.to_thread(Store.open, cfg)
    async with await Bus.connect(cfg.bus, "feeder", deadline_s=30) as bus:
        await bus.ensure_streams()
        try:
            summary = await Feeder(cfg, bus, store, worker=args.worker).feed(args.prompts)
        except SourceError as e:
            print(f"dfpipe feed: {e}")
            return 2
    s = summary
    print(f"run {s.run}: read {s.read}, accepted {s.accepted} ({s.published} new, {s.already_fed} fed before), "
          f"duplicates {s.duplicates}, rejected {s.rejected} in {s.seconds:.1f}s")
    for reason, n in s.reject_reasons.items():
        print(f"  reject  {n:>7}  {reason}")
    if s.rejected:
        print(f"  rejects: {store.uri(Keys.rejects(s.run))}")
    print(f"  manifest: {store.uri(Keys.manifest(s.run))}")
    return 0


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("feed", help="read prompts (JSONL/JSON/Parquet, local or s3://) and queue them for a run")
    p.add_argument("prompts", nargs="+", help="prompt files: path or s3://bucket/key")
    p.add_argument("--run", required=True)
    p.add_argument("--worker", default="feeder")
    p.set_defaults(func=lambda args: asyncio.run(_feed(args)))

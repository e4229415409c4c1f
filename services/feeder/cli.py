"""`dfpipe feed`: queue a prompt set for a run.

Exit codes: 0 every source fed (rejected records are listed, not fatal); 2 a source was refused as a
whole (no such file or object, bucket missing or credentials refused, unreadable, or none of its
records has a prompt) while the other sources were still fed and the manifest written; 3 the feeder's
own S3 (the run's bucket) refused it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from shared.exits import Exit


async def _feed(args: argparse.Namespace) -> int:
    from shared.bus import Bus
    from shared.cli import load
    from shared.store import Store
    from shared.topology import Keys

    from .feed import Feeder

    cfg = load(args)
    store = await asyncio.to_thread(Store.open, cfg)
    async with await Bus.connect(cfg.bus, "feeder", deadline_s=30) as bus:
        await bus.ensure_streams()
        s = await Feeder(cfg, bus, store, worker=args.worker).feed(args.prompts)
    print(f"run {s.run}: read {s.read}, accepted {s.accepted} ({s.published} new, {s.already_fed} fed before), "
          f"duplicates {s.duplicates}, rejected {s.rejected}, blank {s.blank} in {s.seconds:.1f}s")
    for code, n in s.reject_reasons.items():
        print(f"  reject  {n:>7}  {code:<20} first: {s.reject_examples.get(code, '')[:200]}")
    if s.rejected:
        print(f"  rejects: {store.uri(Keys.rejects(s.run))}")
    print(f"  manifest: {store.uri(Keys.manifest(s.run))}")
    for source, why in s.refused.items():
        print(f"dfpipe feed: refused {source}: {why}", file=sys.stderr)
    return Exit.USAGE if s.refused else Exit.OK  # a source was refused (missing, unreadable, foreign); the others were fed


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("feed", help="read prompts (JSONL/JSON/Parquet, local or s3://) and queue them for a run")
    p.add_argument("prompts", nargs="+", help="prompt files: path or s3://bucket/key")
    p.add_argument("--run", required=True)
    p.add_argument("--worker", default="feeder")
    p.set_defaults(func=lambda args: asyncio.run(_feed(args)))

"""`dfpipe generate` (a worker per GPU) and `dfpipe replay generate` (dead letters, or one bad shard)."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from typing import Any

import msgspec

from shared.exits import Exit

from .backends import backend_kinds, check_kind


def _generate(args: argparse.Namespace) -> int:
    from shared.cli import load
    from shared.topology import check_name

    from .service import run_generator

    cfg = load(args)
    g = cfg.generator
    overrides: dict[str, Any] = {}
    if args.backend:
        overrides["backend"] = args.backend
    if args.engine_url:
        overrides["engine_url"] = args.engine_url
    if args.launch:
        overrides["launch"] = True
    if overrides:
        cfg = msgspec.structs.replace(cfg, generator=msgspec.structs.replace(g, **overrides))
    check_kind(cfg.generator.backend)
    worker = check_name("worker", args.worker or f"{socket.gethostname().split('.')[0]}-gpu{args.gpu or 0}")
    stats = asyncio.run(run_generator(cfg, worker, gpu=args.gpu))
    print(f"generator {worker}: {stats.acked} completed, {stats.retried} retried, {stats.dead_lettered} dead-lettered, "
          f"{stats.requeued_on_shutdown} requeued")
    return Exit.OK


async def _replay(args: argparse.Namespace) -> int:
    from shared.bus import Bus
    from shared.cli import load
    from shared.messages import PromptTask
    from shared.records import read_completions
    from shared.store import KeyNotFound, Store
    from shared.topology import Subjects

    cfg = load(args)
    async with await Bus.connect(cfg.bus, "replay", deadline_s=30) as bus:
        if missing := await bus.run_missing(cfg.run):
            print(f"dfpipe replay generate: {missing}", file=sys.stderr)
            return Exit.USAGE
        await bus.ensure_streams()
        if args.failed:
            n = await bus.replay_dead_letters(cfg.run, "generate")
            print(f"re-published {n} dead-lettered prompt(s) of run {cfg.run}")
            return Exit.OK
        store = await asyncio.to_thread(Store.open, cfg)
        try:
            records = read_completions(await asyncio.to_thread(store.get_bytes, args.shard))
        except KeyNotFound:
            print(f"dfpipe replay generate: no shard {args.shard!r} in bucket {store.bucket!r}", file=sys.stderr)
            return Exit.USAGE
        generation = 1 + max((r.generation for r in records), default=0)
        tasks = [PromptTask(run=cfg.run, prompt_id=r.prompt_id, messages=r.messages, source=args.shard,
                            generation=generation) for r in records]
        acks = await bus.publish_many(
            [(Subjects.prompts(cfg.run), t, f"regen:{args.shard}:{generation}:{t.prompt_id}") for t in tasks]
        )
        fresh = sum(not a.duplicate for a in acks)
        print(f"re-published {fresh} prompt(s) of {args.shard} as generation {generation} "
              f"({len(acks) - fresh} already queued); the new completions replace these on read")
    return Exit.OK


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("generate", help="a generator worker: prompts → engine → completion shards in S3")
    p.add_argument("--run", required=True)
    p.add_argument("--worker", default=os.environ.get("DFLASH_WORKER"), help="unique worker name (default host-gpuN)")
    p.add_argument("--gpu", type=int, default=None, help="GPU index for this worker's engine")
    p.add_argument("--backend", choices=backend_kinds(), default=None)
    p.add_argument("--engine-url", default=None, help="sglang/openai server URL")
    p.add_argument("--launch", action="store_true", help="sglang: start a server for this GPU")
    p.set_defaults(func=_generate)

    r = replay.add_parser("generate", help="re-queue dead-lettered prompts (--failed) or one shard's (--shard KEY)")
    r.add_argument("--run", required=True)
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--failed", action="store_true")
    what.add_argument("--shard", metavar="KEY", help="completions shard key, e.g. runs/R/completions/w0/00000003.parquet")
    r.set_defaults(func=lambda args: asyncio.run(_replay(args)))

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
from shared.gpus import GpuGroup, LayoutError, parse_layout

from .backends import backend_kinds, check_kind


def engine_group(gpu: int | None, gpus: str | None, tp: int) -> GpuGroup | None:
    """The one GPU group this worker's engine runs on (`--gpu N`, or `--gpus` + `--tp` naming one group)."""
    if gpu is not None and gpus:
        raise LayoutError("give --gpu N or --gpus GROUP, not both")
    if gpus is None:
        if tp != 1:
            raise LayoutError(f"--tp {tp} needs --gpus naming the group's {tp} GPUs")
        return GpuGroup((gpu,)) if gpu is not None else None
    groups = parse_layout(gpus, tp)
    if len(groups) != 1:
        raise LayoutError(f"--gpus {gpus!r} --tp {tp} is {len(groups)} groups; one `dfpipe generate` runs one engine "
                          "(start one per group, or let `dfpipe run --gpus` start them)")
    return groups[0]


def _generate(args: argparse.Namespace) -> int:
    from shared.cli import load
    from shared.topology import check_name

    from .service import run_generator

    try:
        group = engine_group(args.gpu, args.gpus, args.tp)
    except LayoutError as e:
        print(f"dfpipe generate: {e}", file=sys.stderr)
        return Exit.USAGE
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
    label = group.label if group else "0"
    worker = check_name("worker", args.worker or f"{socket.gethostname().split('.')[0]}-gpu{label}")
    stats = asyncio.run(run_generator(cfg, worker, gpus=group))
    print(f"generator {worker}: {stats.acked} completed, {stats.retried} retried, {stats.dead_lettered} dead-lettered, "
          f"{stats.requeued_on_shutdown} requeued")
    return Exit.OK


async def _replay(args: argparse.Namespace) -> int:
    from shared.bus import Bus
    from shared.cli import load
    from shared.store import Store
    from shared.topology import Subjects

    from .requeue import NotAShard, requeue_shard

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
            rq = await requeue_shard(cfg, bus, store, args.shard, args.prompts)
        except (NotAShard, ValueError) as e:  # includes a named source that cannot be read (SourceError)
            print(f"dfpipe replay generate: {e}", file=sys.stderr)
            return Exit.USAGE
        acks = await bus.publish_many([(Subjects.prompts(cfg.run), t, rq.msg_id(t)) for t in rq.tasks])
        fresh = sum(not a.duplicate for a in acks)
        if rq.lost:
            print(f"{rq.key}: {rq.lost}; its prompts were found again in {', '.join(rq.sources)}")
        print(f"re-published {fresh} prompt(s) of {rq.key} as generation {rq.generation} "
              f"({len(acks) - fresh} already queued); the new completions replace these on read")
        if rq.missing:
            shown = ", ".join(rq.missing[:5]) + (" ..." if len(rq.missing) > 5 else "")
            print(f"dfpipe replay generate: {len(rq.missing)} prompt(s) of {rq.key} are in none of the sources "
                  f"({shown}): name the files they came from with --prompts", file=sys.stderr)
            return Exit.FAILED
    return Exit.OK


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.feeder.sources import SourceError
    from shared.calibration import encode
    from shared.cli import load
    from shared.store import Store
    from shared.topology import Keys, check_name

    from .calibrate import (
        Sweep,
        calibrate_configured,
        calibration_of,
        compare_layouts,
        describe,
        parse_layouts,
        sample_prompts,
    )

    cfg = load(args)
    cfg = msgspec.structs.replace(cfg, run=check_name("run", args.run))
    c = cfg.calibrate
    max_c = args.max_concurrency or c.max_concurrency
    backend = "sglang" if args.launch else (args.backend or cfg.generator.backend)
    if backend == "synthetic":
        print("dfpipe calibrate: the synthetic backend is a load generator, not an engine to measure", file=sys.stderr)
        return Exit.USAGE
    # the client must be able to hold the sweep's highest level in flight
    gen = msgspec.structs.replace(cfg.generator, backend=backend, max_inflight=max(cfg.generator.max_inflight, max_c))
    cfg = msgspec.structs.replace(cfg, generator=gen)
    try:
        layouts = parse_layouts(args.layouts) if args.launch else []
        if args.launch and not args.gpus:
            raise LayoutError("--launch needs --gpus: the GPUs the layouts are compared on")
        prompts, total = sample_prompts(args.prompts, cfg, args.sample or c.sample)
    except (LayoutError, SourceError, ValueError) as e:
        print(f"dfpipe calibrate: {e}", file=sys.stderr)
        return Exit.USAGE
    sweep = Sweep(start=args.start, max_concurrency=max_c)
    print(f"calibrating with {len(prompts)} of the {total:,} prompts in {', '.join(args.prompts)} "
          f"(max_new_tokens {cfg.sampling.max_new_tokens})")
    if args.launch:
        compared = asyncio.run(compare_layouts(cfg, args.gpus, layouts, prompts, sweep))
        result = calibration_of(cfg, backend, len(prompts), [], compared)
    else:
        urls = [u for u in (args.engine_urls or "").split(",") if u.strip()] or list(cfg.layout.engine_urls)
        if not urls and backend != "hf":
            urls = [cfg.generator.engine_url or "http://127.0.0.1:30000"]
        result = calibration_of(cfg, backend, len(prompts), asyncio.run(calibrate_configured(cfg, prompts, sweep, urls)))
    print(describe(result, total))
    data = encode(result)
    if args.json:
        Path(args.json).write_bytes(data)
    if not args.no_save:
        store = Store.open(cfg)
        store.put_bytes(Keys.calibration(cfg.run), data, "application/json")
        print(f"saved to {store.uri(Keys.calibration(cfg.run))}: `dfpipe plan --calibration {cfg.run}` states the job's "
              "ETA from it, and the run's generators start at the measured concurrency")
    return Exit.OK


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("generate", help="a generator worker: prompts → engine → completion shards in S3")
    p.add_argument("--run", required=True)
    p.add_argument("--worker", default=os.environ.get("DFLASH_WORKER"),
                   help="unique worker name (default host-gpuN, host-gpuA-B for a group)")
    p.add_argument("--gpu", type=int, default=None, help="GPU index for this worker's engine")
    p.add_argument("--gpus", default=None, help="the GPU group of this worker's engine, e.g. 2-3 (or 2,3 --tp 2): "
                                                "CUDA_VISIBLE_DEVICES=2,3 and --tp-size 2 for a launched SGLang")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with --gpus)")
    p.add_argument("--backend", choices=backend_kinds(), default=None)
    p.add_argument("--engine-url", default=None, help="sglang/openai server URL")
    p.add_argument("--launch", action="store_true", help="sglang: start a server for this GPU")
    p.set_defaults(func=_generate)

    c = sub.add_parser("calibrate", help="measure the engines on a sample of the run's own prompts at rising "
                                         "concurrency: peak tokens/s, knee, latency, lengths; --launch compares layouts")
    c.add_argument("--run", required=True, help="the run whose prefix keeps the result")
    c.add_argument("--prompts", nargs="+", required=True, help="the run's prompt files (or s3:// objects)")
    c.add_argument("--sample", type=int, default=0, help="prompts to sample (default calibrate.sample)")
    c.add_argument("--backend", choices=["hf", "sglang", "openai"], default=None)
    c.add_argument("--engine-urls", default=None, help="comma-separated engines to measure (default: the configured)")
    c.add_argument("--start", type=int, default=1, help="the sweep's first concurrency (then doubling)")
    c.add_argument("--max-concurrency", type=int, default=0, help="the sweep's bound (default calibrate.max_concurrency)")
    c.add_argument("--launch", action="store_true", help="start SGLang servers for each layout on --gpus and compare")
    c.add_argument("--gpus", default=None, help="with --launch: the GPUs the layouts share, e.g. 0,1,2,3")
    c.add_argument("--layouts", default="tp1", help="with --launch: e.g. tp1,tp2,tp1+mtp,tp2+mtp")
    c.add_argument("--json", default=None, help="also write the result to this file")
    c.add_argument("--no-save", action="store_true", help="do not write runs/<run>/calibration.json")
    c.set_defaults(func=_calibrate)

    r = replay.add_parser("generate", help="re-queue dead-lettered prompts (--failed) or one shard's (--shard KEY)")
    r.add_argument("--run", required=True)
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--failed", action="store_true")
    what.add_argument("--shard", metavar="KEY", help="completions shard key, e.g. runs/R/completions/w0/00000003.parquet")
    r.add_argument("--prompts", nargs="+", default=None, metavar="SOURCE",
                   help="with --shard: where a lost shard's prompts are found again (default: the run's own sources)")
    r.set_defaults(func=lambda args: asyncio.run(_replay(args)))

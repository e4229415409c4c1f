"""`dfpipe run` (prompts → trained drafter, supervised) and `dfpipe chaos` (the fault-injection suite)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from services.generator.backends import backend_kinds, check_kind
from shared.exits import Exit


def _gpus(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants a comma-separated list of GPU indices, not {value!r}") from None


def _run(args: argparse.Namespace) -> int:
    import msgspec

    from services.feeder.sources import SourceError, check_source
    from shared.cli import load
    from shared.config import load_config
    from shared.stack import is_external, stack_up
    from shared.topology import check_name

    from .run import BUNDLED_PROMPTS, DEMO_CONFIG, RunRequest, run_pipeline

    if not args.prompts and not args.config and not os.environ.get("DFLASH_CONFIG"):
        args.config = str(DEMO_CONFIG)
        print(f"no --prompts and no --config: the bundled demo ({BUNDLED_PROMPTS.name}, CC0) with {DEMO_CONFIG}")
    base = load_config(args.config)
    check_kind(args.backend or base.generator.backend)  # a typo is said now, not as a generator's crash loop
    env: dict[str, str] = {}
    if not is_external():
        stack = stack_up(base)  # reuses a running embedded stack
        env.update(stack.env())
        env["DFLASH_DATA_DIR"] = str(stack.root)
    cfg = load(args)
    cfg = msgspec.structs.replace(cfg, run=check_name("run", args.run))
    for source in args.prompts or []:  # a missing file or bucket, refused credentials: said now, not as a crash loop
        try:
            check_source(source, cfg)
        except SourceError as e:
            print(f"dfpipe run: {e}", file=sys.stderr)
            return Exit.USAGE
    env["DFLASH_RUN"] = cfg.run
    if args.config:
        env["DFLASH_CONFIG"] = os.path.abspath(args.config)
    prompts = args.prompts or [str(BUNDLED_PROMPTS)]
    if args.gpus:
        generators: list[int | None] = list(args.gpus)
    else:
        generators = [None] * args.generators
    request = RunRequest(prompts=[p if p.startswith("s3://") else os.path.abspath(p) for p in prompts],
                         generators=generators, backend=args.backend, train=not args.no_train,
                         dashboard=not args.no_dashboard)
    return asyncio.run(run_pipeline(cfg, request, env=env, show=not args.plain))


def _chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .chaos import ChaosSettings, report_json, run_chaos

    s = ChaosSettings(prompts=args.prompts, generators=args.generators, max_faults=args.faults,
                      fault_every_s=args.every, seed=args.seed, timeout_s=args.timeout)
    report = run_chaos(s, Path(args.dir) if args.dir else None)
    print(report.format())
    if args.json:
        Path(args.json).write_bytes(report_json(report))
    return Exit.OK if report.ok else Exit.FAILED


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("run", help="prompts → completions → tokenized samples → trained drafter → eval, supervised")
    p.add_argument("--prompts", nargs="*", default=None, help="prompt files (default: the bundled demo set)")
    p.add_argument("--run", required=True, help="run name; re-running the same name resumes it")
    p.add_argument("--gpus", type=_gpus, default=None, help="e.g. 0,1,2,3: one generator per GPU")
    p.add_argument("--generators", type=int, default=1, help="generators on CPU when no --gpus")
    p.add_argument("--backend", choices=backend_kinds(), default=None)
    p.add_argument("--no-train", action="store_true", help="stop after tokenization")
    p.add_argument("--no-dashboard", action="store_true")
    p.add_argument("--plain", action="store_true", help="log lines instead of the live display")
    p.set_defaults(func=_run)
    c = sub.add_parser("chaos", help="a small real run on its own embedded stack with kill -9s, a NATS restart "
                                     "and an S3 outage; checks that nothing was lost or duplicated")
    c.add_argument("--prompts", type=int, default=40, help="bundled prompts to run")
    c.add_argument("--generators", type=int, default=2)
    c.add_argument("--faults", type=int, default=8, help="faults to inject (each kind at least once)")
    c.add_argument("--every", type=float, default=8.0, help="seconds between faults")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--timeout", type=float, default=1200.0)
    c.add_argument("--dir", default=None, help="keep the stack, logs and data here (default: a temp dir)")
    c.add_argument("--json", default=None, help="write the report as JSON to this file")
    c.set_defaults(func=_chaos)

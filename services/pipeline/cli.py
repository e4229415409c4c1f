"""`dflash run` (prompts → trained drafter, supervised) and `dflash chaos` (the fault-injection suite)."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any


def _gpus(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants a comma-separated list of GPU indices, not {value!r}") from None


def _run(args: argparse.Namespace) -> int:
    import msgspec

    from shared.cli import load
    from shared.config import load_config
    from shared.messages import check_name
    from shared.stack import is_external, stack_up

    from .run import BUNDLED_PROMPTS, RunPlan, run_pipeline

    base = load_config(args.config)
    env: dict[str, str] = {}
    if not is_external():
        stack = stack_up(base)  # reuses a running embedded stack
        env.update(stack.env())
        env["DFLASH_DATA_DIR"] = str(stack.root)
    cfg = load(args)
    cfg = msgspec.structs.replace(cfg, run=check_name("run", args.run))
    env["DFLASH_RUN"] = cfg.run
    if args.config:
        env["DFLASH_CONFIG"] = os.path.abspath(args.config)
    prompts = args.prompts or [str(BUNDLED_PROMPTS)]
    if args.gpus:
        generators: list[int | None] = list(args.gpus)
    else:
        generators = [None] * args.generators
    plan = RunPlan(prompts=[p if p.startswith("s3://") else os.path.abspath(p) for p in prompts],
                   generators=generators, backend=args.backend, train=not args.no_train,
                   dashboard=not args.no_dashboard)
    if not args.prompts:
        print(f"no --prompts given: using the bundled demo set ({BUNDLED_PROMPTS}, CC0)")
    return asyncio.run(run_pipeline(cfg, plan, env=env, show=not args.plain))


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("run", help="prompts → completions → tokenized samples → trained drafter → eval, supervised")
    p.add_argument("--prompts", nargs="*", default=None, help="prompt files (default: the bundled demo set)")
    p.add_argument("--run", required=True, help="run name; re-running the same name resumes it")
    p.add_argument("--gpus", type=_gpus, default=None, help="e.g. 0,1,2,3: one generator per GPU")
    p.add_argument("--generators", type=int, default=1, help="generators on CPU when no --gpus")
    p.add_argument("--backend", choices=["hf", "sglang", "openai"], default=None)
    p.add_argument("--no-train", action="store_true", help="stop after tokenization")
    p.add_argument("--no-dashboard", action="store_true")
    p.add_argument("--plain", action="store_true", help="log lines instead of the live display")
    p.set_defaults(func=_run)

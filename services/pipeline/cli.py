"""`dfpipe run` (prompts → trained drafter, supervised) and `dfpipe chaos` (the fault-injection suite)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from services.generator.backends import backend_kinds, check_kind
from shared.exits import Exit


def _gpu_list(value: str) -> list[int]:
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a comma-separated list of GPU indices, not {value!r}") from None


def _placed(cfg: Any, args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The config with the command line's placement applied, and one GPU group (or None: CPU) per generator;
    a layout that cannot run raises LayoutError, before anything starts."""
    import msgspec

    from shared.gpus import LayoutError, parse_layout

    from .layout import engine_urls, fit_problem, gpu_memory_bytes, target_bytes_bf16, training_gpus

    layout = cfg.layout
    if args.engine_urls:
        layout = msgspec.structs.replace(layout, engine_urls=[u for u in args.engine_urls.split(",") if u.strip()])
    if args.train_gpus is not None:
        layout = msgspec.structs.replace(layout, train_gpus=args.train_gpus)
    if args.train_ranks is not None:
        layout = msgspec.structs.replace(layout, cpu_train_ranks=args.train_ranks)
    generator = msgspec.structs.replace(cfg.generator, launch=True) if args.launch else cfg.generator
    cfg = msgspec.structs.replace(cfg, layout=layout, generator=generator)
    if args.gpus:
        groups: list[Any] = list(parse_layout(args.gpus, args.tp))
    elif args.tp != 1:
        raise LayoutError(f"--tp {args.tp} needs --gpus")
    else:
        groups = [None] * args.generators
    backend = args.backend or cfg.generator.backend
    if backend == "hf" and any(g is not None and g.tp > 1 for g in groups):
        raise LayoutError("the hf backend runs one GPU per engine; GPU groups (--tp > 1) need --backend sglang")
    engine_urls(cfg, groups, args.backend)
    gpus = training_gpus(cfg, groups)
    if not args.no_train and gpus:
        from shared.model import resolve_target

        if problem := fit_problem(target_bytes_bf16(resolve_target(cfg.model.target)), gpu_memory_bytes(gpus), groups):
            raise LayoutError(problem)
    return cfg, groups


def _say_placement(cfg: Any, groups: list[Any], args: argparse.Namespace) -> None:
    """Where the engines and the training go, said once at the start (and whose engines are whose)."""
    from .layout import engines_launched, training_gpus

    if not any(g is not None for g in groups):
        return
    tp = groups[0].tp
    print(f"{len(groups)} engine(s) of {tp} GPU(s) each (" + ", ".join(g.visible_devices for g in groups) + ")"
          + (f", tensor parallel {tp}" if tp > 1 else ""))
    if args.no_train:
        return
    gpus = training_gpus(cfg, groups)
    where = f"GPUs {','.join(map(str, gpus))} ({len(gpus)} rank(s))" if gpus else "the CPU"
    if engines_launched(cfg, args.backend):
        print(f"training: on {where} once generation is done and this run's engines are stopped")
    else:
        print(f"training: on {where}; the engines at {', '.join(cfg.layout.engine_urls) or cfg.generator.engine_url or 'the configured URL'} "
              "are not this run's to stop: if they sit on those GPUs, name others with --train-gpus")


def _run(args: argparse.Namespace) -> int:
    started_at = time.monotonic()  # trainer.run_budget_s counts the whole command: stack start included
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
    from shared.gpus import LayoutError

    try:  # a layout that cannot run is said before the stack starts
        _placed(base, args)
    except LayoutError as e:
        print(f"dfpipe run: {e}", file=sys.stderr)
        return Exit.USAGE
    env: dict[str, str] = {}
    if not is_external():
        stack = stack_up(base)  # reuses a running embedded stack
        env.update(stack.env())
        env["DFLASH_DATA_DIR"] = str(stack.root)
    cfg = load(args)
    cfg = msgspec.structs.replace(cfg, run=check_name("run", args.run))
    try:
        cfg, generators = _placed(cfg, args)
    except LayoutError as e:
        print(f"dfpipe run: {e}", file=sys.stderr)
        return Exit.USAGE
    _say_placement(cfg, generators, args)
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
    request = RunRequest(prompts=[p if p.startswith("s3://") else os.path.abspath(p) for p in prompts],
                         generators=generators, backend=args.backend, train=not args.no_train,
                         dashboard=not args.no_dashboard, started_at=started_at)
    _say_expected(cfg, request)
    return asyncio.run(run_pipeline(cfg, request, env=env, show=not args.plain))


def _say_expected(cfg: Any, request: Any) -> None:
    """A CPU run of the in-process backend: how long it should take here, from a half-second probe (and the
    eval's share, which `trainer.run_budget_s` keeps free at the end)."""
    if (request.backend or cfg.generator.backend) != "hf" or any(g is not None for g in request.generators):
        return
    import torch

    if cfg.model.device.startswith("cuda") or (cfg.model.device == "auto" and torch.cuda.is_available()):
        return
    from .expect import count_prompts, expect, probe_gflops

    prompts = count_prompts(request.prompts)
    if prompts:
        expected = expect(cfg, prompts, train=request.train, probe=probe_gflops())
        request.expected_eval_s = dict(expected.stages).get("eval")
        print(expected.line(), flush=True)


def _chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .chaos import ChaosSettings, report_json, run_chaos

    s = ChaosSettings(prompts=args.prompts, generators=args.generators, max_faults=args.faults,
                      fault_every_s=args.every, seed=args.seed, timeout_s=args.timeout, cluster=args.cluster,
                      backend=args.backend)
    report = run_chaos(s, Path(args.dir) if args.dir else None)
    print(report.format())
    if args.json:
        Path(args.json).write_bytes(report_json(report))
    return Exit.OK if report.ok else Exit.FAILED


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("run", help="prompts → completions → tokenized samples → trained drafter → eval, supervised")
    p.add_argument("--prompts", nargs="*", default=None, help="prompt files (default: the bundled demo set)")
    p.add_argument("--run", required=True, help="run name; re-running the same name resumes it")
    p.add_argument("--gpus", default=None, help="GPU groups, one engine + generator each: 0,1,2,3 (one per GPU), "
                                                "0,1,2,3 --tp 2 or 0-1,2-3 (two engines, tensor parallel 2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: --gpus cut into groups of this many")
    p.add_argument("--engine-urls", default=None, help="comma-separated engine URLs, one per group (engines you run)")
    p.add_argument("--launch", action="store_true", help="sglang: each generator starts its group's server")
    p.add_argument("--train-gpus", type=_gpu_list, default=None,
                   help="GPUs to train on (default: every GPU of --gpus, once the engines are stopped)")
    p.add_argument("--train-ranks", type=int, default=None,
                   help="CPU only: train under torchrun with this many gloo ranks (layout.cpu_train_ranks)")
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
    c.add_argument("--cluster", action="store_true", help="on a 3-node NATS cluster (R3) and a multi-process "
                   "SeaweedFS, adding leader kills, a frozen node and a volume server kill")
    c.add_argument("--backend", choices=["hf", "synthetic"], default="hf", help="the generators' backend")
    c.add_argument("--dir", default=None, help="keep the stack, logs and data here (default: a temp dir)")
    c.add_argument("--json", default=None, help="write the report as JSON to this file")
    c.set_defaults(func=_chaos)

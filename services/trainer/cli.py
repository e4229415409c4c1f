"""`dfpipe train`, `dfpipe eval` and `dfpipe plan`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from shared.exits import Exit


def _train(args: argparse.Namespace) -> int:
    from shared.bus import LeaseHeld
    from shared.cli import load

    from .loop import run_trainer

    cfg = load(args)
    try:
        p = asyncio.run(run_trainer(cfg))
    except LeaseHeld as e:  # another trainer is training this run: two would overwrite each other's checkpoints
        print(f"dfpipe train: run {cfg.run} is already being trained: {e}; this trainer does not start (it may "
              f"once that one stops, or within trainer.lease_ttl_s = {cfg.trainer.lease_ttl_s:g}s of its death)",
              file=sys.stderr)
        return Exit.BUSY
    print(f"trainer {cfg.run}: step {p.step}, loss {p.loss:.4f}, estimated τ {p.estimated_tau:.2f}, "
          f"state {p.state}, checkpoint {p.checkpoint_key}")
    return Exit.OK if p.state == "done" else Exit.STOPPED  # "stopped": resumable, not finished


def _eval(args: argparse.Namespace) -> int:
    from shared.cli import load

    from .eval import EvalRefused, Sampling, evaluate_run

    try:
        sampling = Sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        raise SystemExit(f"dfpipe eval: {e}") from None
    if args.seeds < 1:
        raise SystemExit(f"dfpipe eval: --seeds must be >= 1, not {args.seeds}")
    cfg = load(args)
    try:
        r, reused = asyncio.run(evaluate_run(cfg, args.prompts, sampling, args.seeds, force=args.force))
    except EvalRefused as e:
        print(f"dfpipe eval: {e}", file=sys.stderr)
        return e.exit_code
    if reused:
        print(f"eval {cfg.run}: checkpoint {r.checkpoint_key} was already evaluated with these settings; "
              "its report is kept (--force evaluates again)")
    cycles = sum(r.acceptance_histogram)
    if sampling.greedy:
        print(f"eval {cfg.run}: τ = {r.tau:.3f} over {cycles} cycles on {r.prompts} held-out prompts; "
              f"speedup {r.speedup:.2f}x vs greedy; lossless: {r.lossless} ({r.mismatches} mismatches)")
    else:
        per_seed = ", ".join(f"{t:.3f}" for t in r.tau_per_seed)
        print(f"eval {cfg.run}: temperature {sampling.temperature}, top-p {sampling.top_p}, top-k {sampling.top_k}: "
              f"τ = {r.tau:.3f} ± {r.tau_std:.3f} (sd over {r.seeds} seeds: {per_seed}) over {cycles} "
              f"cycles on {r.prompts} held-out prompts; speedup {r.speedup:.2f}x vs plain sampling "
              f"(tokens/s); lossless by the rejection rule (sampled outputs are not compared token by token)")
    print(f"  acceptance histogram (tokens per cycle): {r.acceptance_histogram}")
    return Exit.OK if r.lossless is not False else Exit.FAILED


def _plan(args: argparse.Namespace) -> int:
    from .cost import RunCost, format_cost

    rate, gpus, per, completion = args.tokens_per_s, args.gpus, "GPU", args.avg_completion_tokens
    if args.calibration:
        from shared.calibration import load_calibration
        from shared.cli import load
        from shared.store import Store

        cfg = load(argparse.Namespace(config=args.config, run=args.calibration))
        calibration = load_calibration(Store.open(cfg), cfg.run)
        if calibration is None:
            print(f"run {args.calibration} has no calibration: `dfpipe calibrate --run {args.calibration} --prompts ...`",
                  file=sys.stderr)
            return Exit.FAILED
        gpus, per = args.engines or len(calibration.engines), "engine"
        rate, completion = calibration.tokens_per_s_per_engine, calibration.mean_completion_tokens
        eta = calibration.eta_s(args.samples, gpus)
        print(f"calibrated (run {cfg.run}, {calibration.backend}, {calibration.prompts_sampled} prompts sampled"
              + (f", layout {calibration.recommended}" if calibration.recommended else "") + f"): {args.samples:,} "
              f"prompts × {completion:,.0f} tokens ÷ ({rate:,.1f} tokens/s × {gpus} engine(s)) = "
              f"{eta / 86400:,.2f} days")
    if args.live_run:
        from shared.bus import Bus
        from shared.cli import load
        from shared.messages import GeneratorProgress
        from shared.topology import ANY, Streams, Subjects

        cfg = load(argparse.Namespace(config=args.config, run=args.live_run))

        async def live() -> tuple[float, int]:
            async with await Bus.connect(cfg.bus, "plan", deadline_s=10) as bus:
                latest = await bus.latest_per_subject(Streams.PROGRESS, Subjects.progress(cfg.run, "generate", ANY))
            rates = [p.completion_tokens_per_s for _, p in latest if isinstance(p, GeneratorProgress)
                     and p.state == "running"]
            return (sum(rates) / len(rates) if rates else 0.0), len(rates)

        rate, n = asyncio.run(live())
        if not n:
            print(f"no running generator in run {args.live_run}")
            return Exit.FAILED
        print(f"live: {n} generator(s) of run {args.live_run}, {rate:.1f} tok/s each on average")
    p = RunCost(samples=args.samples, avg_tokens=args.avg_tokens, avg_completion_tokens=completion or args.avg_tokens,
                target_layers=args.layers, hidden=args.hidden, feature_layers=args.feature_layers, gpus=gpus,
                tokens_per_s_per_gpu=rate, target_params_b=args.params_b, epochs=args.epochs, per=per)
    print(json.dumps(p.report(), indent=2) if args.json else format_cost(p))
    return Exit.OK


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("train", help="train the DFlash drafter on a run's tokenized shards (online target features); "
                                     "multi-GPU: DFLASH_RUN=R torchrun --nproc_per_node N -m shared.cli train")
    # The run may come from DFLASH_RUN: torchrun's own parser claims any `--run...` option before the script's.
    p.add_argument("--run", required="DFLASH_RUN" not in os.environ, default=os.environ.get("DFLASH_RUN"))
    p.set_defaults(func=_train)
    e = sub.add_parser("eval", help="speculative decoding with the latest checkpoint: τ, speedup, losslessness")
    e.add_argument("--run", required=True)
    e.add_argument("--prompts", type=int, default=None, help="held-out prompts to use")
    e.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, checked token for token; > 0: lossless speculative sampling")
    e.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    e.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0: off (with --temperature)")
    e.add_argument("--seeds", type=int, default=3, help="sampled runs: seeds to repeat over (τ's spread)")
    e.add_argument("--force", action="store_true",
                   help="evaluate again even when the run's report already holds this checkpoint and these settings")
    e.set_defaults(func=_eval)
    pl = sub.add_parser("plan", help="capacity planner: generation ETA, offline storage, online training cost")
    pl.add_argument("--samples", type=int, default=902_087)
    pl.add_argument("--avg-tokens", type=float, default=2000)
    pl.add_argument("--avg-completion-tokens", type=float, default=2500)
    pl.add_argument("--layers", type=int, default=64, help="target layers")
    pl.add_argument("--hidden", type=int, default=5120, help="target hidden size")
    pl.add_argument("--feature-layers", type=int, default=5)
    pl.add_argument("--gpus", type=int, default=4)
    pl.add_argument("--tokens-per-s", type=float, default=400.0, help="generation tokens/s per GPU")
    pl.add_argument("--params-b", type=float, default=27.0, help="target parameters, billions")
    pl.add_argument("--epochs", type=int, default=6)
    pl.add_argument("--live-run", default=None, help="take tokens/s per GPU from this run's live generators")
    pl.add_argument("--calibration", default=None, metavar="RUN",
                    help="take tokens/s per engine and the mean completion length from this run's `dfpipe calibrate`")
    pl.add_argument("--engines", type=int, default=0, help="with --calibration: engines to plan for (default: as "
                                                            "calibrated)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_plan)

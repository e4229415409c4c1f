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
    from shared.cli import load

    from .loop import run_trainer

    cfg = load(args)
    p = asyncio.run(run_trainer(cfg))
    print(f"trainer {cfg.run}: step {p.step}, loss {p.loss:.4f}, estimated τ {p.estimated_tau:.2f}, "
          f"state {p.state}, checkpoint {p.checkpoint_key}")
    return Exit.OK if p.state == "done" else Exit.STOPPED  # "stopped": resumable, not finished


def same_evaluation(report: Any, ckpt: str, prompts: int, max_new: int, sampling: Any, seeds: int) -> bool:
    """Whether `report` already evaluated this checkpoint with these settings (then `dfpipe eval` reuses it)."""
    return (report.checkpoint_key == ckpt and report.prompts == prompts and report.max_new_tokens == max_new
            and (report.temperature, report.top_p, report.top_k) == (sampling.temperature, sampling.top_p, sampling.top_k)
            and (sampling.greedy or report.seeds == seeds))


async def _eval_async(cfg: Any, limit: int | None, sampling: Any = None, seeds: int = 1, force: bool = False) -> dict:
    """The eval's numbers (`reused`: True when the run's report already had them: same checkpoint and settings)."""
    import msgspec
    import torch

    from shared.bus import Bus
    from shared.machine import describe_machine
    from shared.messages import EvalReport
    from shared.store import Store
    from shared.topology import Keys, Subjects

    from .data import held_out_prompts
    from .drafters import load_drafter
    from .eval import GREEDY, evaluate
    from .features import Target

    store = await asyncio.to_thread(Store.open, cfg)
    async with await Bus.connect(cfg.bus, "eval", deadline_s=30) as bus:
        if missing := await bus.run_missing(cfg.run):
            print(f"dfpipe eval: {missing}", file=sys.stderr)
            raise SystemExit(Exit.USAGE)
        prompts = await held_out_prompts(cfg, store, bus, limit)
        if not prompts:
            raise SystemExit(f"dfpipe eval: run {cfg.run} has no held-out samples (trainer.holdout_mod)")
        ckpt = json.loads(await asyncio.to_thread(store.get_bytes, Keys.checkpoint_latest(cfg.run)))["key"]
        sampling = sampling or GREEDY
        max_new = cfg.trainer.eval_max_new_tokens
        if not force and await asyncio.to_thread(store.exists, Keys.eval_report(cfg.run)):
            # a restart (compose `up` again, a rerun of the pipeline) does not redo minutes of decoding for the
            # same checkpoint: the report already holds them
            old = msgspec.json.decode(await asyncio.to_thread(store.get_bytes, Keys.eval_report(cfg.run)),
                                      type=EvalReport)
            if same_evaluation(old, ckpt, len(prompts), max_new, sampling, seeds):
                return {**msgspec.to_builtins(old), "cycles": sum(old.acceptance_histogram), "reused": True}

        def run() -> dict:
            import tempfile
            from pathlib import Path

            from shared.model import load_causal_lm, load_tokenizer

            with tempfile.TemporaryDirectory() as tmp:
                for name in ("config.json", "model.safetensors"):
                    store.get_file(f"{ckpt}drafter/{name}", Path(tmp) / name)
                drafter = load_drafter(Path(tmp), f"run {cfg.run}: checkpoint {ckpt}")
            lm = load_causal_lm(cfg.model.target)
            tok = load_tokenizer(cfg.model.target)
            eos = lm.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos if eos is not None else tok.eos_token_id])
            torch.manual_seed(0)
            return evaluate(Target(lm, drafter.config.target_layer_ids), drafter, prompts, max_new, eos, sampling,
                            seeds)

        r = await asyncio.to_thread(run)
        report = EvalReport(run=cfg.run, checkpoint_key=ckpt, prompts=r["prompts"], tau=r["tau"],
                            acceptance_histogram=r["acceptance_histogram"], speedup=r["speedup"],
                            lossless=r["lossless"], mismatches=r["mismatches"], temperature=r["temperature"],
                            top_p=r["top_p"], top_k=r["top_k"], seeds=r["seeds"], tau_per_seed=r["tau_per_seed"],
                            tau_std=r["tau_std"], max_new_tokens=max_new,
                            machine=describe_machine("cpu"))  # the eval decodes on the CPU (load_causal_lm)
        await asyncio.to_thread(store.put_bytes, Keys.eval_report(cfg.run), msgspec.json.encode(report),
                                "application/json")
        await bus.publish(Subjects.progress(cfg.run, "eval", "eval"), report)
        return {**r, "reused": False}


def _eval(args: argparse.Namespace) -> int:
    from shared.cli import load

    from .eval import Sampling

    try:
        sampling = Sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        raise SystemExit(f"dfpipe eval: {e}") from None
    if args.seeds < 1:
        raise SystemExit(f"dfpipe eval: --seeds must be >= 1, not {args.seeds}")
    cfg = load(args)
    r = asyncio.run(_eval_async(cfg, args.prompts, sampling, args.seeds, force=args.force))
    if r["reused"]:
        print(f"eval {cfg.run}: checkpoint {r['checkpoint_key']} was already evaluated with these settings; "
              "its report is kept (--force evaluates again)")
    if sampling.greedy:
        print(f"eval {cfg.run}: τ = {r['tau']:.3f} over {r['cycles']} cycles on {r['prompts']} held-out prompts; "
              f"speedup {r['speedup']:.2f}x vs greedy; lossless: {r['lossless']} ({r['mismatches']} mismatches)")
    else:
        per_seed = ", ".join(f"{t:.3f}" for t in r["tau_per_seed"])
        print(f"eval {cfg.run}: temperature {sampling.temperature}, top-p {sampling.top_p}, top-k {sampling.top_k}: "
              f"τ = {r['tau']:.3f} ± {r['tau_std']:.3f} (sd over {r['seeds']} seeds: {per_seed}) over {r['cycles']} "
              f"cycles on {r['prompts']} held-out prompts; speedup {r['speedup']:.2f}x vs plain sampling "
              f"(tokens/s); lossless by the rejection rule (sampled outputs are not compared token by token)")
    print(f"  acceptance histogram (tokens per cycle): {r['acceptance_histogram']}")
    return Exit.OK if r["lossless"] is not False else Exit.FAILED


def _plan(args: argparse.Namespace) -> int:
    from .cost import RunCost, format_cost

    rate = args.tokens_per_s
    if args.live_run:
        from shared.bus import Bus
        from shared.cli import load
        from shared.messages import GeneratorProgress
        from shared.topology import ANY, Subjects

        cfg = load(argparse.Namespace(config=args.config, run=args.live_run))

        async def live() -> tuple[float, int]:
            async with await Bus.connect(cfg.bus, "plan", deadline_s=10) as bus:
                latest = await bus.latest_per_subject("PROGRESS", Subjects.progress(cfg.run, "generate", ANY))
            rates = [p.completion_tokens_per_s for _, p in latest if isinstance(p, GeneratorProgress)
                     and p.state == "running"]
            return (sum(rates) / len(rates) if rates else 0.0), len(rates)

        rate, n = asyncio.run(live())
        if not n:
            print(f"no running generator in run {args.live_run}")
            return Exit.FAILED
        print(f"live: {n} generator(s) of run {args.live_run}, {rate:.1f} tok/s each on average")
    p = RunCost(samples=args.samples, avg_tokens=args.avg_tokens, avg_completion_tokens=args.avg_completion_tokens
             or args.avg_tokens, target_layers=args.layers, hidden=args.hidden, feature_layers=args.feature_layers,
             gpus=args.gpus, tokens_per_s_per_gpu=rate, target_params_b=args.params_b, epochs=args.epochs)
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
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=_plan)

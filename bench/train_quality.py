"""Drafter quality: τ on held-out prompts after at most 30 minutes of training on these machines.

The whole pipeline on its own embedded stack (`dfpipe run` with bench/quality.toml): SmolLM2-135M-
Instruct regenerates its answers to QUALITY_PROMPTS prompts (the bundled 350 and more of the same
kinds, bench/quality_prompts.py), the tokenizer builds samples, the trainer
trains a block-size-8 drafter for at most `trainer.max_train_s` (1800 s), and `dfpipe eval` decodes
held-out prompts speculatively (greedy, checked lossless against plain greedy). Target: τ ≥ 2.0.
Writes bench/results/train_quality.json.

`--dir D --run R` keeps the stack in D; with `--no-train` the call stops after tokenization, and a
later call with the same D and R resumes the run there (generation is not repeated), so the data
can be regenerated once and trained on under another trainer config. `--retrain` trains such a
run again from scratch under the current bench/quality.toml: it removes the run's checkpoints and
eval report and the trainer's durable consumer (so the shard announcements come back), and reports
only this call's training.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from common import ROOT, bench_config, bench_stack, table, write_result
from quality_prompts import quality_prompts

CONFIG = ROOT / "bench" / "quality.toml"
PROMPTS = int(os.environ.get("QUALITY_PROMPTS", "1500"))


async def forget_training(cfg, store) -> int:
    """A run's training undone: its checkpoints, eval report and the trainer's consumer `train-<run>`."""
    import contextlib

    import nats.js.errors

    from shared.bus import Bus, consumer_for
    from shared.topology import Keys

    keys = [*store.list(Keys.checkpoints_prefix(cfg.run)), *[k for k in [Keys.eval_report(cfg.run)] if store.exists(k)]]
    for key in keys:
        store.delete(key)
    spec = consumer_for("train", cfg.run)
    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await bus.js.delete_consumer(spec.stream, spec.durable)
    return len(keys)


async def figures(cfg, since: float) -> dict:
    from shared.bus import Bus
    from shared.messages import GeneratorProgress, TokenizedShard, TrainerProgress
    from shared.topology import Subjects

    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        tok = [e async for _, e in bus.replay("TOKENIZED", Subjects.tokenized(cfg.run), 1, TokenizedShard)]
        gen, train = [], []
        async for _, p in bus.replay("PROGRESS", Subjects.whole_run(cfg.run), 1):
            if isinstance(p, GeneratorProgress):
                gen.append(p)
            elif isinstance(p, TrainerProgress) and p.state == "running" and p.ts >= since:
                train.append(p)
    return {
        "samples": sum(e.num_samples for e in tok), "tokens": sum(e.num_tokens for e in tok),
        "supervised_tokens": sum(e.num_supervised for e in tok),
        "generation_s": round(max(p.ts for p in gen) - min(p.ts for p in gen), 1) if gen else None,
        "train_steps": train[-1].step if train else 0,
        "train_wall_s": round(train[-1].ts - train[0].ts, 1) if len(train) > 1 else None,
        "final_loss": round(train[-1].loss, 4) if train else None,
        "estimated_tau_train": train[-1].estimated_tau if train else None,
    }


def main() -> int:
    from shared.config import load_config
    from shared.messages import EvalReport
    from shared.store import Store
    from shared.topology import Keys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="keep the stack here (default: a temp dir)")
    ap.add_argument("--run", default=None, help="run name (default: a new one)")
    ap.add_argument("--no-train", action="store_true", help="stop after tokenization")
    ap.add_argument("--retrain", action="store_true", help="train the kept run --run again from scratch")
    args = ap.parse_args()
    if args.retrain and (args.no_train or not (args.dir and args.run)):
        ap.error("--retrain needs --dir and --run of a kept run, and no --no-train")
    with bench_stack(args.dir) as stack:
        run = args.run or f"quality{int(time.time()) % 100000}"
        env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root), "DFLASH_MODEL__DEVICE": "cpu"}
        log = ROOT / "bench" / "results" / f"train_quality{'-generate' if args.no_train else ''}.log"
        prompts = stack.root / "prompts.jsonl"
        prompts.write_text("".join(msgspec.json.encode(o).decode() + "\n" for o in quality_prompts(PROMPTS)))
        base = load_config(CONFIG, env={})
        cfg = bench_config(stack, run, trainer=msgspec.to_builtins(base.trainer))
        if args.retrain:
            print(f"retrain {run}: removed {asyncio.run(forget_training(cfg, Store.open(cfg)))} objects of its training")
        t0, since = time.monotonic(), time.time()
        with log.open("a") as out:
            rc = subprocess.call([sys.executable, "-m", "shared.cli", "--config", str(CONFIG), "run",
                                  "--prompts", str(prompts), "--run", run, "--no-dashboard", "--plain",
                                  *(["--no-train"] if args.no_train else [])],
                                 env=env, stdout=out, stderr=subprocess.STDOUT)
        total_s = time.monotonic() - t0
        if args.no_train:
            print(f"generated and tokenized run {run} in {stack.root} ({total_s:.0f} s, exit {rc})")
            return rc
        f = asyncio.run(figures(cfg, since))
        store = Store.open(cfg)
        report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport) \
            if store.exists(Keys.eval_report(run)) else None
    t = base.trainer
    result = {
        "dflash_run_exit": rc, "total_s": round(total_s, 1), "retrained": args.retrain, "prompts": PROMPTS, "block_size": t.block_size, "drafter_layers": t.num_layers,
        "drafter_init": t.init, "target_autocast": t.target_autocast, "token_budget": t.token_budget,
        "anchors_per_sequence": t.anchors_per_sequence, "soft_labels": t.soft_labels, "draft_vocab": t.draft_vocab, "lr": t.lr, "train_budget_s": t.max_train_s, **f,
        "eval_prompts": report.prompts if report else 0, "tau": round(report.tau, 3) if report else None,
        "acceptance_histogram": report.acceptance_histogram if report else None,
        "speedup": round(report.speedup, 3) if report else None, "lossless": report.lossless if report else None,
        "target_tau": 2.0, "met": bool(report and report.tau >= 2.0 and t.max_train_s <= 1800),
    }
    path = write_result("train_quality", result)
    print(table([("metric", "value")] + [(k, str(v)) for k, v in result.items()]))
    print(f"wrote {path}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

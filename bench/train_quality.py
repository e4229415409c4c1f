"""Drafter quality: τ on held-out prompts after at most 30 minutes of training on these machines.

The whole pipeline on its own embedded stack (`dflash run` with bench/quality.toml): SmolLM2-135M-
Instruct regenerates its answers to the bundled prompts, the tokenizer builds samples, the trainer
trains a block-size-8 drafter for at most `trainer.max_train_s` (1800 s), and `dflash eval` decodes
held-out prompts speculatively (greedy, checked lossless against plain greedy). Target: τ ≥ 2.0.
Writes bench/results/train_quality.json.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import msgspec
from common import ROOT, bench_config, bench_stack, table, write_result

CONFIG = ROOT / "bench" / "quality.toml"


async def figures(cfg) -> dict:
    from shared.bus import Bus
    from shared.messages import GeneratorProgress, Subjects, TokenizedShard, TrainerProgress

    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        tok = [e async for _, e in bus.replay("TOKENIZED", Subjects.tokenized(cfg.run), 1, TokenizedShard)]
        gen, train = [], []
        async for _, p in bus.replay("PROGRESS", f"dflash.{cfg.run}.>", 1):
            if isinstance(p, GeneratorProgress):
                gen.append(p)
            elif isinstance(p, TrainerProgress) and p.state == "running":
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
    from shared.store import Keys, Store

    with bench_stack() as stack:
        run = f"quality{int(time.time()) % 100000}"
        env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root), "DFLASH_MODEL__DEVICE": "cpu"}
        log = ROOT / "bench" / "results" / "train_quality.log"
        t0 = time.monotonic()
        with log.open("w") as out:
            rc = subprocess.call([sys.executable, "-m", "shared.cli", "--config", str(CONFIG), "run",
                                  "--prompts", str(ROOT / "services/pipeline/data/prompts.jsonl"), "--run", run,
                                  "--no-dashboard", "--plain"], env=env, stdout=out, stderr=subprocess.STDOUT)
        total_s = time.monotonic() - t0
        base = load_config(CONFIG, env={})
        cfg = bench_config(stack, run, trainer=msgspec.to_builtins(base.trainer))
        f = asyncio.run(figures(cfg))
        store = Store.open(cfg)
        report = msgspec.json.decode(store.get_bytes(Keys.eval_report(run)), type=EvalReport) \
            if store.exists(Keys.eval_report(run)) else None
    t = base.trainer
    result = {
        "dflash_run_exit": rc, "total_s": round(total_s, 1), "block_size": t.block_size, "drafter_layers": t.num_layers,
        "train_budget_s": t.max_train_s, **f,
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

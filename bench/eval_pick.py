"""What the eval's new prompt pick changed: the same checkpoints decoded on the held-out prompts picked both ways.

Until Dec 2026 `dfpipe eval` decoded the `eval_prompts` smallest held-out prompt_ids over every tokenized shard
(it read them all: at 914K, the whole dataset on a fresh machine). It now takes the first held-out prompts
in the order the log announced the shards, reading shards only until it has them (services/trainer/data.py
`held_out_prompts`). Both are deterministic; they pick different prompts. This decodes each checkpoint named
(greedy, as `dfpipe eval`) on both picks, so the τ a bench reports after the change can be read against the
figures before it: the difference the pick alone makes, on one checkpoint.

    python bench/eval_pick.py --dir /path/to/quality-stack --run q2 --checkpoints runs/q2/kept/dflash/ latest
    python bench/eval_pick.py --dir D --run R --keep dflash   # copy the latest checkpoint to runs/R/kept/dflash/
                                       # (bench/train_quality.py now keeps each architecture's final one there itself)

Greedy decoding is deterministic, so τ here does not depend on how busy the machine is (the speedup does:
it is not reported). Writes bench/results/eval_pick.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
from common import ROOT, bench_config, bench_stack, keep_latest, table, write_result

CONFIG = ROOT / "bench" / "quality.toml"


def smallest_ids_pick(store: Any, keys: list[str], holdout_mod: int, want: int) -> list[list[int]]:
    """The pick before Dec 2026: the `want` smallest held-out prompt_ids over every shard (at least 2 supervised
    tokens), their prompt parts."""
    from services.trainer.data import load_samples, prompt_part

    held = load_samples(store, keys, holdout_mod=holdout_mod, train=False)
    rows = sorted((s for s in held if sum(s.loss_mask) >= 2), key=lambda s: s.prompt_id)
    return [prompt_part(s) for s in rows[:want]]


async def picks(cfg: Any) -> tuple[list[list[int]], list[list[int]]]:
    from services.trainer.data import held_out_prompts, shard_keys_in_log_order
    from shared.bus import Bus
    from shared.store import Store

    store = Store.open(cfg)
    async with await Bus.connect(cfg.bus, "bench-eval-pick", deadline_s=30) as bus:
        new = await held_out_prompts(cfg, store, bus)
        keys = await shard_keys_in_log_order(bus, cfg.run)
    old = await asyncio.to_thread(smallest_ids_pick, store, keys, cfg.trainer.holdout_mod, cfg.trainer.eval_prompts)
    return new, old


def main() -> int:
    from services.trainer.eval import GREEDY, _evaluate_checkpoint
    from shared.config import load_config
    from shared.store import Store
    from shared.topology import Keys

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="the stack folder a quality bench kept (--dir)")
    ap.add_argument("--run", required=True)
    ap.add_argument("--checkpoints", nargs="+", default=["latest"], help="checkpoint prefixes, or latest")
    ap.add_argument("--keep", default=None, help="only copy the latest checkpoint to runs/R/kept/NAME/")
    args = ap.parse_args()
    base = load_config(CONFIG)
    with bench_stack(args.dir) as stack:
        cfg = bench_config(stack, args.run, trainer=msgspec.to_builtins(base.trainer))
        if args.keep:
            print(f"kept {keep_latest(cfg, args.keep)}")
            return 0
        new, old = asyncio.run(picks(cfg))
        store = Store.open(cfg)
        shared = len({tuple(p) for p in new} & {tuple(p) for p in old})
        result: dict[str, Any] = {"run": args.run, "eval_prompts": cfg.trainer.eval_prompts,
                                  "holdout_mod": cfg.trainer.holdout_mod,
                                  "eval_max_new_tokens": cfg.trainer.eval_max_new_tokens,
                                  "prompts_in_both_picks": shared, "checkpoints": {}}
        rows = [("checkpoint", "τ log-order pick (now)", "τ smallest-ids pick (before)", "lossless")]
        for name in args.checkpoints:
            ckpt = json.loads(store.get_bytes(Keys.checkpoint_latest(cfg.run)))["key"] if name == "latest" else name
            figures = {}
            for pick, prompts in (("log_order", new), ("smallest_ids", old)):
                report = _evaluate_checkpoint(cfg, store, ckpt, prompts, GREEDY, 1)
                figures[pick] = {"tau": round(report.tau, 4), "acceptance_histogram": report.acceptance_histogram,
                                 "lossless": report.lossless, "prompts": report.prompts}
            source = f"{ckpt}SOURCE"
            figures["source"] = store.get_bytes(source).decode() if store.exists(source) else ckpt
            result["checkpoints"][ckpt] = figures
            rows.append((ckpt, f"{figures['log_order']['tau']:.3f}", f"{figures['smallest_ids']['tau']:.3f}",
                         str(figures["log_order"]["lossless"] and figures["smallest_ids"]["lossless"])))
    print(f"{shared} of {len(new)} prompts are in both picks")
    print(table(rows))
    write_result("eval_pick", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

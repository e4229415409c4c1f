"""Drafter quality: DFlash and DFlash 2 trained on the same regenerated data for the same 30 minutes, as served.

The whole pipeline on its own embedded stack (`dfpipe run` with bench/quality.toml): SmolLM2-135M-
Instruct regenerates its answers to QUALITY_PROMPTS prompts (the bundled 350 and more of the same
kinds, bench/quality_prompts.py) once, the tokenizer builds samples, and then for each architecture
(`trainer.arch`, set through DFLASH_TRAINER__ARCH) the trainer trains a block-size-8 drafter from scratch
for at most `trainer.max_train_s` (1800 s) in a servable config (no draft vocabulary, which the
reference and the engines do not read), and is evaluated three ways on the same held-out prompts:

- `dfpipe eval`, greedy (run by `dfpipe run`): τ, histogram, speedup, lossless against plain greedy;
- z-lab's reference (`dflash==0.1.0`, installed by tests/reference.py): its `from_pretrained` of the
  checkpoint (loading report) and its `dflash_generate` loop, greedy, prompt by prompt against our
  loop's cycles (the last block cut at our token limit, as tests/test_interop.py explains);
- `dfpipe eval --temperature 0.7 --top-p 0.95 --seeds N`: τ with its spread over seeds, speedup.

Targets: the reference's τ equals ours; τ(DFlash 2) > τ(DFlash); τ ≥ 2.0 (the moonshot).
Writes bench/results/train_quality.json; with a sampled regeneration (DFLASH_SAMPLING__TEMPERATURE=0.7, set
for both calls) train_quality-t0.7.json, so the greedy-data figures are kept beside it.

`--dir D --run R` keeps the stack in D; with `--no-train` the call stops after tokenization, and a
later call with the same D and R trains on that data (generation is not repeated). Each architecture's
training starts from scratch: the run's checkpoints, eval report and the trainer's durable consumer
are removed first (so the shard announcements come back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from common import ROOT, bench_config, bench_stack, keep_latest, table, write_result
from quality_prompts import quality_prompts

CONFIG = ROOT / "bench" / "quality.toml"
PROMPTS = int(os.environ.get("QUALITY_PROMPTS", "1500"))
ARCHS = ("dflash", "dflash2")


async def forget_training(cfg, store) -> int:
    """A run's training undone: its checkpoints, eval report and the trainer's consumer `train-<run>`."""
    from shared.bus import Bus, consumer_for
    from shared.topology import Keys

    keys = [*store.list(Keys.checkpoints_prefix(cfg.run)), *[k for k in [Keys.eval_report(cfg.run)] if store.exists(k)]]
    for key in keys:
        store.delete(key)
    spec = consumer_for("train", cfg.run)
    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        await bus.delete_consumer(spec.stream, spec.durable)
    return len(keys)


async def data_figures(cfg) -> dict:
    """The regenerated data: samples and tokens as tokenized, and how long generation took."""
    from shared.bus import Bus
    from shared.messages import GeneratorProgress, TokenizedShard
    from shared.topology import Streams, Subjects

    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        tok = [e async for _, e in bus.read_log(Streams.TOKENIZED, Subjects.tokenized(cfg.run), 1, TokenizedShard)]
        gen = [p async for _, p in bus.read_log(Streams.PROGRESS, Subjects.whole_run(cfg.run), 1)
               if isinstance(p, GeneratorProgress)]
    return {"samples": sum(e.num_samples for e in tok), "tokens": sum(e.num_tokens for e in tok),
            "supervised_tokens": sum(e.num_supervised for e in tok),
            "generation_s": round(max(p.ts for p in gen) - min(p.ts for p in gen), 1) if gen else None}


async def training_figures(cfg, since: float) -> dict:
    """This call's training, from the trainer's own progress events since `since`."""
    from shared.bus import Bus
    from shared.messages import TrainerProgress
    from shared.topology import Streams, Subjects

    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        train = [p async for _, p in bus.read_log(Streams.PROGRESS, Subjects.whole_run(cfg.run), 1)
                 if isinstance(p, TrainerProgress) and p.state == "running" and p.ts >= since]
    return {"train_steps": train[-1].step if train else 0,
            "train_wall_s": round(train[-1].ts - train[0].ts, 1) if len(train) > 1 else None,
            "final_loss": round(train[-1].loss, 4) if train else None,
            "estimated_tau_train": train[-1].estimated_tau if train else None}


async def eval_prompts(cfg) -> list[list[int]]:
    """The held-out prompts `dfpipe eval` decodes (the same function picks them)."""
    from services.trainer.data import held_out_prompts
    from shared.bus import Bus
    from shared.store import Store

    async with await Bus.connect(cfg.bus, "bench", deadline_s=10) as bus:
        return await held_out_prompts(cfg, Store.open(cfg), bus)


def cut_at(cycles: list[int], budget: int) -> list[int]:
    """A cycle list as a loop that stops after `budget` tokens (those after the prefill's) would count it."""
    out, total = [], 0
    for n in cycles:
        out.append(min(n, budget - total))
        total += out[-1]
        if total >= budget:
            break
    return out


def reference_check(cfg, prompts: list[list[int]]) -> dict:
    """The latest checkpoint loaded by the reference's own class, decoded greedily by its `dflash_generate`
    and by our loop, fp32 on CPU: loading report, τ and histogram by each, and the prompts whose cycles differ."""
    import torch

    from services.trainer.drafters import load_drafter
    from services.trainer.eval import speculative
    from services.trainer.features import Target
    from shared.model import load_causal_lm
    from shared.store import Store
    from shared.topology import Keys
    from tests.reference import reference_model_module

    ref = reference_model_module()
    store = Store.open(cfg)
    ckpt = json.loads(store.get_bytes(Keys.checkpoint_latest(cfg.run)))["key"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name in ("config.json", "model.safetensors"):
            store.get_file(f"{ckpt}drafter/{name}", d / name)
        arch = json.loads((d / "config.json").read_text())["architectures"][0]
        model, info = getattr(ref, arch).from_pretrained(d, output_loading_info=True, dtype=torch.float32)
        model.eval()
        ours = load_drafter(d).eval()
    lm = load_causal_lm(cfg.model.target)
    eos = lm.generation_config.eos_token_id
    eos = sorted(set(eos if isinstance(eos, list) else [eos]))
    target = Target(lm, ours.config.target_layer_ids)
    B, max_new = ours.config.block_size, cfg.trainer.eval_max_new_tokens
    hist_ref, hist_ours, differ, t_ref = [0] * (B + 1), [0] * (B + 1), [], 0.0
    for i, prompt in enumerate(prompts):
        _, cycles = speculative(target, ours, prompt, max_new, set(eos))
        t0 = time.perf_counter()
        # B−1 more tokens of budget, so that the reference never shrinks its last block (tests/test_interop.py)
        r = ref.dflash_generate(model, lm, torch.tensor([prompt]), max_new + B - 1, eos, temperature=0.0,
                                return_stats=True)
        t_ref += time.perf_counter() - t0
        theirs = cut_at(list(r.acceptance_lengths), max_new - 1)
        for n in theirs:
            hist_ref[n] += 1
        for n in cycles:
            hist_ours[n] += 1
        if theirs != cycles:
            differ.append({"prompt": i, "reference": theirs, "ours": cycles})
    tau = lambda h: round(sum(n * c for n, c in enumerate(h)) / max(1, sum(h)), 3)  # noqa: E731
    return {"reference_class": arch, "checkpoint": ckpt,
            "loading": {k: sorted(info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")},
            "tau": tau(hist_ref), "acceptance_histogram": hist_ref, "ours_tau": tau(hist_ours),
            "ours_histogram": hist_ours, "prompts_differing": differ, "reference_decode_s": round(t_ref, 1)}


def eval_report(cfg) -> dict | None:
    from shared.messages import EvalReport
    from shared.store import Store
    from shared.topology import Keys

    store = Store.open(cfg)
    if not store.exists(Keys.eval_report(cfg.run)):
        return None
    r = msgspec.json.decode(store.get_bytes(Keys.eval_report(cfg.run)), type=EvalReport)
    out = {k: getattr(r, k) for k in ("prompts", "acceptance_histogram", "lossless", "temperature", "top_p",
                                        "seeds", "tau_per_seed")}
    return {**out, "tau": round(r.tau, 3), "tau_std": round(r.tau_std, 3), "speedup": round(r.speedup, 3)}


def train_and_evaluate(cfg, env: dict, prompts_file: Path, arch: str, log: Path, seeds: int) -> dict:
    """One architecture from scratch on the run's data: train + greedy eval (`dfpipe run`), the reference's
    check, then sampled eval (`dfpipe eval`)."""
    from shared.store import Store

    print(f"{arch}: removed {asyncio.run(forget_training(cfg, Store.open(cfg)))} objects of earlier training")
    env = {**env, "DFLASH_TRAINER__ARCH": arch}
    base = [sys.executable, "-m", "shared.cli", "--config", str(CONFIG)]
    since, t0 = time.time(), time.monotonic()
    with log.open("a") as out:
        rc = subprocess.call([*base, "run", "--prompts", str(prompts_file), "--run", cfg.run, "--no-dashboard",
                              "--plain"], env=env, stdout=out, stderr=subprocess.STDOUT)
    run_s = time.monotonic() - t0
    result: dict[str, Any] = {"dflash_run_exit": rc, "run_s": round(run_s, 1),
                              **asyncio.run(training_figures(cfg, since)), "greedy": eval_report(cfg)}
    t0 = time.monotonic()
    result["reference"] = reference_check(cfg, asyncio.run(eval_prompts(cfg)))
    result["reference_s"] = round(time.monotonic() - t0, 1)
    t0 = time.monotonic()
    with log.open("a") as out:
        result["sampled_eval_exit"] = subprocess.call(
            [*base, "eval", "--run", cfg.run, "--temperature", "0.7", "--top-p", "0.95", "--seeds", str(seeds)],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    result["sampled_eval_s"] = round(time.monotonic() - t0, 1)
    result["sampled"] = eval_report(cfg)
    # the next architecture removes this one's checkpoints: its final one stays for later looks (eval_pick.py)
    try:
        result["kept"] = keep_latest(cfg, arch)
    except Exception as e:  # no checkpoint to keep: the figures above still stand
        result["kept"] = f"not kept: {type(e).__name__}: {e}"
    return result


def main() -> int:
    from shared.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="keep the stack here (default: a temp dir)")
    ap.add_argument("--run", default=None, help="run name (default: a new one)")
    ap.add_argument("--no-train", action="store_true", help="stop after tokenization")
    ap.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS), help="architectures to train")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the temperature-0.7 eval")
    args = ap.parse_args()
    with bench_stack(args.dir) as stack:
        run = args.run or f"quality{int(time.time()) % 100000}"
        env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root), "DFLASH_MODEL__DEVICE": "cpu"}
        base = load_config(CONFIG)  # DFLASH_* overrides apply here as in the pipeline it starts
        name = "train_quality" + (f"-t{base.sampling.temperature:g}" if base.sampling.temperature else "")
        log = ROOT / "bench" / "results" / f"{name}{'-generate' if args.no_train else ''}.log"
        prompts = stack.root / "prompts.jsonl"
        prompts.write_text("".join(msgspec.json.encode(o).decode() + "\n" for o in quality_prompts(PROMPTS)))
        cfg = bench_config(stack, run, trainer=msgspec.to_builtins(base.trainer))
        if args.no_train:
            t0 = time.monotonic()
            with log.open("a") as out:
                rc = subprocess.call([sys.executable, "-m", "shared.cli", "--config", str(CONFIG), "run", "--prompts",
                                      str(prompts), "--run", run, "--no-dashboard", "--plain", "--no-train"],
                                     env=env, stdout=out, stderr=subprocess.STDOUT)
            print(f"generated and tokenized run {run} in {stack.root} ({time.monotonic() - t0:.0f} s, exit {rc})")
            return rc
        archs = {a: train_and_evaluate(cfg, env, prompts, a, log, args.seeds) for a in args.arch}
        data = asyncio.run(data_figures(cfg))
    t = base.trainer
    greedy = {a: (r["greedy"] or {}).get("tau") for a, r in archs.items()}
    result = {
        "prompts": PROMPTS, "data": data, "regeneration_temperature": base.sampling.temperature,
        "regeneration_top_p": base.sampling.top_p,
        "config": {"block_size": t.block_size, "drafter_layers": t.num_layers, "drafter_init": t.init,
                   "target_autocast": t.target_autocast, "token_budget": t.token_budget,
                   "anchors_per_sequence": t.anchors_per_sequence, "soft_labels": t.soft_labels,
                   "draft_vocab": t.draft_vocab, "lr": t.lr, "train_budget_s": t.max_train_s,
                   "eval_prompts": t.eval_prompts, "eval_max_new_tokens": t.eval_max_new_tokens,
                   "dflash2": {"conv_kernel_size": t.conv_kernel_size, "conv_group_size": t.conv_group_size,
                               "selector_rank": t.selector_rank, "selector_top_k": t.selector_top_k}},
        **archs,
        "targets": {
            "reference_equals_ours": {a: bool(r["greedy"]) and not r["reference"]["prompts_differing"]
                                      and r["reference"]["tau"] == r["greedy"]["tau"]
                                      and r["reference"]["acceptance_histogram"] == r["greedy"]["acceptance_histogram"]
                                      for a, r in archs.items()},
            "reference_loads_clean": {a: not any(r["reference"]["loading"].values()) for a, r in archs.items()},
            "dflash2_beats_dflash": (greedy["dflash2"] > greedy["dflash"]) if None not in greedy.values()
            and len(greedy) == 2 else None,
            "moonshot_tau_2_at_block_8": {a: tau is not None and tau >= 2.0 for a, tau in greedy.items()},
        },
    }
    path = write_result(name, result)
    rows = [("", *archs)]
    for label, get in [("τ greedy (dfpipe eval)", lambda r: r["greedy"]["tau"]),
                       ("τ greedy (reference loop)", lambda r: r["reference"]["tau"]),
                       ("τ T=0.7 (mean ± sd)", lambda r: f"{r['sampled']['tau']} ± {r['sampled']['tau_std']}"),
                       ("speedup greedy", lambda r: r["greedy"]["speedup"]),
                       ("speedup T=0.7", lambda r: r["sampled"]["speedup"]),
                       ("histogram greedy", lambda r: r["greedy"]["acceptance_histogram"]),
                       ("train steps", lambda r: r["train_steps"]), ("train s", lambda r: r["train_wall_s"]),
                       ("lossless greedy", lambda r: r["greedy"]["lossless"])]:
        rows.append((label, *[_safe(get, r) for r in archs.values()]))
    print(table(rows))
    print(f"data: {data}\ntargets: {result['targets']}\nwrote {path}")
    return 0 if all(r["dflash_run_exit"] == 0 for r in archs.values()) else 1


def _safe(get, r: dict) -> str:
    try:
        return str(get(r))
    except (KeyError, TypeError):
        return "-"


if __name__ == "__main__":
    sys.exit(main())

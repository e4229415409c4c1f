"""Training speed: tokens/s of the trainer's own step (`DrafterStep`: target forward, drafter forward and
backward, the optimizer) vs tokens/s of the target forward alone, on the same sequences, alternated in one run.

Real SmolLM2-135M-Instruct target, real tokenized samples (SmolLM2 chat template), CPU. The target
forward alone runs as the step runs it (one batched forward, under the config's `target_autocast`:
bf16 where the CPU has bf16 matmul units), so the ratio is the drafter's share of the same work.
Shapes: the production default (B=16, 5 layers, 512 anchors) as DFlash and as DFlash 2, and the
demo's config (services/pipeline/data/demo.toml: DFlash 2, B=8, 2 layers from the target's, 128
anchors, soft labels; also as DFlash), none with a draft vocabulary (servers do not read one).
Target: ratio ≥ 0.5. Each shape's step is also profiled once (torch.profiler, the ranges step.py names:
target forward, drafter forward, head + CE, selector, backward, optimizer): their shares of the step, applied
to the unprofiled step time. `BENCH_TRAIN_SHAPES=demo` runs the demo's shapes only (`BENCH_TRAIN_DEMO=FILE`: another demo config). To measure as an AVX2-only
CPU on one with AVX-512/AMX, restrict every kernel library: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 (recorded in the result, with the CPU's flags and the bf16 probe's timing).
Writes bench/results/train_speed.json (or train_speed-<BENCH_TRAIN_TAG>.json).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from common import ROOT, cpu_description, table, write_result

ROUNDS = int(os.environ.get("BENCH_TRAIN_ROUNDS", "3"))
SEQUENCES = int(os.environ.get("BENCH_TRAIN_SEQUENCES", "8"))
DEMO = Path(os.environ.get("BENCH_TRAIN_DEMO", ROOT / "services/pipeline/data/demo.toml"))  # another shape to compare
SHAPES = {"default DFlash (B=16, 5 layers, 512 anchors)": (None, "dflash"),
          "default DFlash 2": (None, "dflash2"),
          "demo.toml DFlash 2 (B=8, 2 layers, 128 anchors, soft labels)": (DEMO, "dflash2"),
          "demo.toml as DFlash": (DEMO, "dflash"),
          }
ANSWER = ("Here is a careful answer. First, consider what the question asks and which facts matter. "
          "Then work through the steps one at a time, checking each against what is known. ") * 4


def samples(tok, cfg) -> list:
    import json

    from services.tokenizer.samples import SampleBuilder
    from shared.records import ChatMessage, CompletionRecord

    lines = (ROOT / "services/pipeline/data/prompts.jsonl").read_text().splitlines()[:SEQUENCES]
    prompts = [r["messages"][-1]["content"] if "messages" in r else r["prompt"] for r in map(json.loads, lines)]
    recs = [CompletionRecord(run="bench", prompt_id=f"p{i}", messages=[ChatMessage(role="user", content=p)],
                             completion=ANSWER) for i, p in enumerate(prompts)]
    return SampleBuilder(tok, cfg).build(recs).samples


def main() -> int:
    import msgspec

    from services.trainer.build import autocast_dtype, bf16_is_faster
    from services.trainer.dist import Dist
    from services.trainer.drafters import new_drafter
    from services.trainer.features import Target
    from services.trainer.model import feature_layer_ids, resolve_mask_token_id
    from services.trainer.step import PHASES, DrafterStep
    from shared.config import load_config
    from shared.model import load_causal_lm, load_tokenizer

    torch.manual_seed(0)
    shapes = {k: v for k, v in SHAPES.items() if os.environ.get("BENCH_TRAIN_SHAPES") != "demo" or "demo" in k}
    base = load_config(env={})
    tok, lm = load_tokenizer(base.model.target), load_causal_lm(base.model.target, device="cpu")
    for p in lm.parameters():
        p.requires_grad_(False)
    seqs = samples(tok, base)  # the same sequences for every shape
    tokens = sum(s.num_tokens for s in seqs)
    rows, results = [("drafter", "target tok/s", "train tok/s", "ratio", "ms/step")], {}
    parts_rows = [("drafter", *PHASES, "other")]
    for name, (path, arch) in shapes.items():
        t = msgspec.structs.replace(load_config(path, env={}).trainer, arch=arch)
        ids = list(t.target_layer_ids) or feature_layer_ids(lm.config.num_hidden_layers, t.num_feature_layers)
        target = Target(lm, ids)
        drafter = new_drafter(t, lm.config, num_layers=t.num_layers, block_size=t.block_size, layer_ids=ids,
                              mask_token_id=resolve_mask_token_id(tok, lm.config.vocab_size))
        if t.init == "target":
            drafter.init_from_target(lm.get_decoder().layers)
        opt = torch.optim.AdamW(drafter.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        amp, target_amp = autocast_dtype(t.autocast, torch.device("cpu")), autocast_dtype(t.target_autocast,
                                                                                         torch.device("cpu"))
        step = DrafterStep(t, target, drafter, opt, "cpu", Dist(), amp, target_amp)
        micro = [[(i, s) for i, s in enumerate(seqs)]]  # one micro-batch of every sequence
        t_target = t_train = 0.0
        for r in range(ROUNDS + 1):  # round 0 warms up
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=target_amp or torch.float32, enabled=target_amp is not None):
                target.features_many([torch.tensor(s.input_ids[: t.max_length]) for s in seqs])
            t1 = time.perf_counter()
            step(micro, r)
            t2 = time.perf_counter()
            if r:
                t_target, t_train = t_target + t1 - t0, t_train + t2 - t1
        target_tps, train_tps = ROUNDS * tokens / t_target, ROUNDS * tokens / t_train
        step_ms = 1000 * t_train / ROUNDS
        shares = profile_shares(lambda step=step, micro=micro: step(micro, ROUNDS + 1), PHASES)
        parts_ms = {k: round(v * step_ms, 1) for k, v in shares.items()}
        parts_rows.append((name, *(f"{parts_ms[k]:.0f} ({100 * shares[k]:.0f}%)" for k in (*PHASES, "other"))))
        results[name] = {"arch": arch, "block_size": t.block_size, "layers": t.num_layers,
                         "anchors": t.anchors_per_sequence, "soft_labels": t.soft_labels, "init": t.init,
                         "drafter_autocast": str(amp), "target_autocast": str(target_amp),
                         "target_tokens_per_s": round(target_tps, 1),
                         "train_tokens_per_s": round(train_tps, 1), "ratio": round(train_tps / target_tps, 3),
                         "met": train_tps / target_tps >= 0.5, "step_ms": round(step_ms, 1),
                         "step_parts_ms": parts_ms}
        rows.append((name, f"{target_tps:.0f}", f"{train_tps:.0f}", f"{train_tps / target_tps:.2f}", f"{step_ms:.0f}"))
        del drafter, opt, step
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    probe = bf16_is_faster()
    tag = os.environ.get("BENCH_TRAIN_TAG")
    path = write_result(f"train_speed-{tag}" if tag else "train_speed", {
        "sequences": len(seqs), "tokens_per_round": tokens, "rounds": ROUNDS, "cpu_bf16_matmul": bf16,
        "bf16_probe": {"fp32_s": round(probe.fp32_s, 4), "bf16_s": round(probe.bf16_s, 4), "faster": probe.faster},
        "cpu": cpu_description(), "load_avg_1m": round(os.getloadavg()[0], 2), "target_ratio": 0.5,
        "shapes": results})
    print(table(rows))
    print(table(parts_rows))
    print(f"wrote {path}")
    return 0


def profile_shares(run_step, phases: tuple[str, ...]) -> dict[str, float]:
    """One profiled step: each named range's share of the step's wall time (ranges do not nest), and "other"."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    wall_us = (time.perf_counter() - t0) * 1e6
    totals = {k: 0.0 for k in phases}
    for e in prof.key_averages():
        if e.key in totals:
            totals[e.key] += e.cpu_time_total
    shares = {k: v / wall_us for k, v in totals.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares



if __name__ == "__main__":
    sys.exit(main())

"""The demo's per-stage costs on this machine: generation tokens/s (the `hf` backend's own batched generate at
demo.toml's batch size and sampling, fewer tokens) and the bf16 probe, with the CPU's flags, the kernel
restriction in force and the load. Combined with bench/train_speed.py's steps/min at the demo shape (one
sequence per step) into bench/results/demo.json by `--combine`.

Measure as an AVX2-only CPU on one with AVX-512/AMX: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 (torch reads them when it loads). Writes bench/results/demo_stages[-TAG].json.
"""

from __future__ import annotations

import json
import os
import sys
import time

from common import ROOT, write_result

BATCHES = int(os.environ.get("BENCH_DEMO_BATCHES", "1"))
MAX_NEW = int(os.environ.get("BENCH_DEMO_MAX_NEW", "48"))  # fewer than demo.toml's: the rate is per token
DEMO = ROOT / "services/pipeline/data/demo.toml"


def main() -> int:
    import msgspec
    from train_speed import cpu_description

    from services.generator.backends.base import GenRequest
    from services.generator.backends.hf import HFBackend
    from services.trainer.build import bf16_is_faster
    from shared.config import load_config
    from shared.records import ChatMessage

    cfg = load_config(DEMO, env={})
    cfg = msgspec.structs.replace(cfg, sampling=msgspec.structs.replace(cfg.sampling, max_new_tokens=MAX_NEW))
    backend = HFBackend(cfg)
    backend._load()
    lines = (ROOT / "services/pipeline/data/prompts.jsonl").read_text().splitlines()
    n = cfg.generator.batch_size
    reqs = []
    for i, line in enumerate(lines[: n * BATCHES]):
        rec = json.loads(line)
        messages = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
        reqs.append(GenRequest(prompt_id=f"p{i}", messages=[ChatMessage(**m) for m in messages]))
    tokens, seconds = 0, 0.0
    for b in range(BATCHES):
        batch = reqs[b * n:(b + 1) * n]
        t0 = time.perf_counter()
        out = backend.generate_batch(batch, [backend.prompt_ids(r) for r in batch])
        seconds += time.perf_counter() - t0
        tokens += sum(r.completion_tokens for r in out)
    probe = bf16_is_faster()
    tag = os.environ.get("BENCH_DEMO_TAG")
    result = {"batch_size": n, "batches": BATCHES, "max_new_tokens": MAX_NEW, "completion_tokens": tokens,
              "seconds": round(seconds, 2), "generation_tokens_per_s": round(tokens / seconds, 2),
              "bf16_probe": {"fp32_s": round(probe.fp32_s, 4), "bf16_s": round(probe.bf16_s, 4),
                             "faster": probe.faster},
              "cpu": cpu_description(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    path = write_result(f"demo_stages-{tag}" if tag else "demo_stages", result)
    print(f"generation: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.1f} tok/s at batch {n} "
          f"(load {result['load_avg_1m']}); bf16 probe {probe}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pipeline overhead: the same `hf` engine driven by a bare loop vs by feed → generator → shards in S3.

Same model object, same prompts, greedy decoding with a fixed max_new_tokens, same concurrency
(max_inflight and batch size), measured in one run and alternated (bare, pipeline, bare,
pipeline) so machine noise hits both. Target: pipeline tokens/s ≥ 0.95 × bare tokens/s.
Writes bench/results/generate.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, bench_config, bench_stack, table, write_result

N_PROMPTS = int(os.environ.get("BENCH_GEN_PROMPTS", "48"))
MAX_NEW = int(os.environ.get("BENCH_GEN_MAX_NEW", "32"))
INFLIGHT = 8


def load_prompts() -> list[str]:
    lines = (ROOT / "services/pipeline/data/prompts.jsonl").read_text().splitlines()
    out = []
    for line in lines:
        rec = json.loads(line)
        if "prompt" in rec:
            out.append(rec["prompt"])
        if len(out) == N_PROMPTS:
            break
    return out


async def bare(backend, prompts: list[str]) -> tuple[int, float]:
    from services.generator.backends import GenRequest
    from shared.messages import ChatMessage

    sem = asyncio.Semaphore(INFLIGHT)

    async def one(i: int, text: str) -> int:
        async with sem:
            r = await backend.generate(GenRequest(prompt_id=str(i), messages=[ChatMessage(role="user", content=text)]))
            return r.completion_tokens

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return tokens, time.perf_counter() - t0


async def pipeline(backend, stack, prompts: list[str], round_: int, tmp: Path) -> tuple[int, float]:
    from services.feeder.feed import Feeder
    from services.generator.service import generator_service
    from shared.bus import Bus
    from shared.messages import ShardWritten, decode
    from shared.service import serve
    from shared.store import Store
    from shared.topology import Subjects

    cfg = bench_config(stack, f"benchgen{round_}{os.getpid()}",
                       generator={"max_inflight": INFLIGHT, "batch_size": INFLIGHT, "shard_records": 16},
                       sampling={"max_new_tokens": MAX_NEW, "temperature": 0.0})
    src = tmp / f"p{round_}.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    store = Store.open(cfg)
    async with await Bus.connect(cfg.bus, "bench") as bus:
        await bus.ensure_streams()
        done: set[str] = set()
        all_written = asyncio.Event()

        async def on_shard(msg) -> None:  # a plain subscription: no polling competing with the engine for CPU
            done.update(decode(msg.data, ShardWritten).prompt_ids)
            if len(done) >= len(prompts):
                all_written.set()

        sub = await bus.nc.subscribe(Subjects.shards(cfg.run), cb=on_shard)
        t0 = time.perf_counter()  # feed + generate + shard writes: the pipeline's whole path
        await Feeder(cfg, bus, store).feed([str(src)])
        stop = asyncio.Event()
        worker = asyncio.create_task(serve(generator_service(cfg, "bench", backend, owns_engine=False), cfg, stop=stop))
        await all_written.wait()
        seconds = time.perf_counter() - t0
        stop.set()
        gen = await worker
        await sub.unsubscribe()
        return gen.completion_tokens, seconds


async def main() -> int:
    from services.generator.backends.hf import HFBackend

    prompts = load_prompts()
    with tempfile.TemporaryDirectory() as tmp, bench_stack() as stack:
        cfg = bench_config(stack, "benchgen", generator={"max_inflight": INFLIGHT, "batch_size": INFLIGHT},
                           sampling={"max_new_tokens": MAX_NEW, "temperature": 0.0})
        backend = HFBackend(cfg)
        await backend.start()
        await bare(backend, prompts[:INFLIGHT])  # warm-up
        rounds = []
        for r in range(2):
            bt, bs = await bare(backend, prompts)
            pt, ps = await pipeline(backend, stack, prompts, r, Path(tmp))
            rounds.append({"bare_tokens": bt, "bare_s": round(bs, 2), "pipeline_tokens": pt, "pipeline_s": round(ps, 2)})
        await backend.close()
    bare_rate = sum(r["bare_tokens"] for r in rounds) / sum(r["bare_s"] for r in rounds)
    pipe_rate = sum(r["pipeline_tokens"] for r in rounds) / sum(r["pipeline_s"] for r in rounds)
    ratio = pipe_rate / bare_rate
    print(table([("driver", "completion tokens/s", "rounds"),
                 ("bare loop (no bus, no S3)", f"{bare_rate:.1f}", str(len(rounds))),
                 ("feed → generator → S3 shards", f"{pipe_rate:.1f}", str(len(rounds))),
                 ("ratio (target >= 0.95)", f"{ratio:.3f}", "met" if ratio >= 0.95 else "MISSED")]))
    path = write_result("generate", {"prompts": len(prompts), "max_new_tokens": MAX_NEW, "max_inflight": INFLIGHT,
                                     "rounds": rounds, "bare_tokens_per_s": round(bare_rate, 2),
                                     "pipeline_tokens_per_s": round(pipe_rate, 2), "ratio": round(ratio, 4),
                                     "target_ratio": 0.95, "met": ratio >= 0.95})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

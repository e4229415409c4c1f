"""How full the generator keeps a batching engine by itself, per simulator profile.

For each profile (bench/engine_sim.py): the engine's peak tokens/s at its best fixed concurrency with a perfect
client (the engine alone, no HTTP: `model_peak`, an upper bound no client beats), then one `dfpipe generate`
(sglang backend, in-process) against the simulator as a subprocess with no hand-set concurrency, and one with
today's former default (a fixed 16 in flight), and one at the peak's best fixed concurrency through the same
generator (what the client path costs there, so a miss is placed). All measured in the engine's simulated time over the steady
state (without the first and last 5% of the requests). Prompts are this repo's short ones (~35 tokens with the
SmolLM2 template); the peak is computed for the same mean prompt length.

    python bench/engine_fill.py [--profiles test-batch,test-kv,h100-27b-fp8,rtxpro6000-27b] [--prompts N] [--tag T]

Writes bench/results/engine_fill.json. Timings are taken on a shared 2-core machine: the compression per
profile (simulated seconds per real second) is set so the generator needs ~8-15 completions/s at the peak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_config, bench_stack, table, write_result
from bench.engine_sim import PROFILES, EngineSimProcess, model_peak

# profile: (compression for this machine, prompts, max_new_tokens)
RUNS = {
    "test-batch": (0.5, 300, 160),
    "test-kv": (0.5, 300, 160),
    "h100-27b-fp8": (8.0, 320, 4096),
    # KV-capped near 80 running ~2,000-token answers: 300 prompts are under four batches, so the start's
    # over-admission and the drain weigh (auto 0.882, fixed 96 via the generator 0.925); 1,200 reach a steady state
    "rtxpro6000-27b": (24.0, 1200, 4096),
    "h100-27b-bf16": (24.0, 250, 4096),
    "h100-8b": (4.0, 600, 4096),
}


async def one_run(stack, name: str, profile: str, compression: float, n: int, max_new: int, generator: dict,
                  *, sim_extra: list[str] | None = None, wait_s: float = 3600.0, flavor: str = "sglang") -> dict:
    """One generator against the simulator until every prompt has an outcome — in a shard, or dead-lettered (a
    dead letter is acked too: waiting for n completed prompts would wait for ever) — or `wait_s` has passed;
    then its stop, bounded: a generator that does not return within its drain + 60 s is reported, not waited on."""
    from services.feeder.feed import Feeder
    from services.generator.service import run_generator
    from shared.bus import Bus
    from shared.messages import GeneratorProgress, ShardWritten
    from shared.records import read_completions
    from shared.store import Store
    from shared.topology import Streams, Subjects

    with EngineSimProcess(profile, compression=compression, enable_metrics=flavor == "sglang", flavor=flavor,
                          extra=sim_extra) as sim:
        cfg = bench_config(stack, name, generator={
            "backend": "sglang", "engine_url": sim.url, "shard_records": 64, "shard_seconds": 5.0,
            "engine_poll_s": 0.25, "progress_every_s": 1.0, **generator},
            sampling={"max_new_tokens": max_new, "temperature": 0.7})
        async with await Bus.connect(cfg.bus, "bench", deadline_s=30) as bus:
            await bus.ensure_streams()
            store = Store.open(cfg)
            with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
                f.write("".join(json.dumps({"prompt": f"Explain idea {i} of run {name} in detail."}) + "\n"
                                for i in range(n)))
            await Feeder(cfg, bus, store).feed([f.name])
            stop = asyncio.Event()
            t0 = time.monotonic()
            worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
            completed: set[str] = set()
            dead = 0
            while len(completed) + dead < n and time.monotonic() - t0 < wait_s:
                await asyncio.sleep(1.0)
                completed = {p async for _, e in bus.read_log(Streams.SHARDS, Subjects.shards(name), 1, ShardWritten)
                             for p in e.prompt_ids}
                dead = len({d.stream_seq for _, d in await bus.dead_letters(name, "generate")})
                if worker.done():
                    worker.result()
            wall = time.monotonic() - t0
            stop.set()
            t_stop = time.monotonic()
            returned, _ = await asyncio.wait([worker], timeout=cfg.generator.drain_s + 60)
            stop_s = time.monotonic() - t_stop
            if returned:
                worker.result()
            else:
                print(f"{name}: the generator did not return {stop_s:.0f}s after its stop", flush=True)
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
            events = [e async for _, e in bus.read_log(Streams.SHARDS, Subjects.shards(name), 1, ShardWritten)]
            records = [r for e in events for r in read_completions(store.get_bytes(e.key))]
            levels = [p.concurrency async for _, p in bus.read_log(
                Streams.PROGRESS, Subjects.progress(name, "generate", "w0"), 1, GeneratorProgress)]
        stats = sim.stats()
    unique = len({r.prompt_id for r in records})
    return {"tokens_per_s": round(stats.steady.get("tokens_per_s", 0.0), 1),
            "mean_running": round(stats.steady.get("mean_running", 0.0), 1),
            "completions": len(records), "unique": unique, "dead_lettered": dead, "wall_s": round(wall, 1),
            "all_outcomes": len(completed) + dead >= n, "stop_s": round(stop_s, 1), "returned": bool(returned),
            "sim_s": round(stats.sim_time_s, 1), "retracted": stats.requests_retracted,
            "level_max": max(levels, default=0), "level_last": levels[-1] if levels else 0,
            "mean_prompt_tokens": round(sum(r.prompt_tokens for r in records) / max(1, len(records)), 1),
            "mean_completion_tokens": round(sum(r.completion_tokens for r in records) / max(1, len(records)), 1),
            "truncated": sum(r.finish_reason == "length" for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default="test-batch,test-kv,h100-27b-fp8,rtxpro6000-27b")
    ap.add_argument("--prompts", type=int, default=0, help="override each profile's prompt count")
    ap.add_argument("--tag", default="", help="write bench/results/engine_fill-TAG.json (a partial run)")
    ap.add_argument("--no-metrics", type=int, default=0, metavar="N",
                    help="also N prompts through the openai backend to test-batch with no /metrics at all (an "
                         "OpenAI server such as `transformers serve`): the throughput-only climb, vs the same peak")
    args = ap.parse_args()
    results = {}
    rows = [("profile", "peak tok/s (best fixed c)", "auto tok/s", "auto/peak", "fixed 16 tok/s", "16/peak",
             "best c via generator /peak", "auto level max", "wall s", "dead letters a/16")]
    with bench_stack() as stack:
        for i, profile in enumerate(p for p in args.profiles.split(",") if p):
            compression, n, max_new = RUNS[profile]
            load_before = os.getloadavg()  # the machine is shared: the row says how busy it was
            n = args.prompts or n
            auto = asyncio.run(one_run(stack, f"fill{i}a", profile, compression, n, max_new, {}))
            fixed = asyncio.run(one_run(stack, f"fill{i}f", profile, compression, n, max_new,
                                        {"adaptive": False, "max_inflight": 16}))
            p = replace(PROFILES[profile])
            sweep = model_peak(p, [8, 16, 32, 48, 64, 96, 128, 192, 256], requests=max(400, n),
                               max_new_tokens=max_new, prompt_len=round(auto["mean_prompt_tokens"]))
            best_c, best = max(sweep.items(), key=lambda kv: kv[1]["tokens_per_s"])
            peak = best["tokens_per_s"]
            # the best fixed level through the same generator, HTTP and machine: what the client path itself
            # costs at that level (the peak above has no client), so a miss is placed on the controller or not
            at_best = asyncio.run(one_run(stack, f"fill{i}b", profile, compression, n, max_new,
                                          {"adaptive": False, "max_inflight": best_c}))
            results[profile] = {
                "source": p.source, "compression": compression, "prompts": n, "max_new_tokens": max_new,
                "peak_tokens_per_s": round(peak, 1), "best_fixed_concurrency": best_c,
                "sweep": {c: round(v["tokens_per_s"], 1) for c, v in sweep.items()},
                "auto": auto, "auto_over_peak": round(auto["tokens_per_s"] / peak, 3),
                "fixed16": fixed, "fixed16_over_peak": round(fixed["tokens_per_s"] / peak, 3),
                "fixed_best_via_generator": at_best,
                "fixed_best_via_generator_over_peak": round(at_best["tokens_per_s"] / peak, 3),
                "auto_over_fixed_best_via_generator": round(auto["tokens_per_s"] / max(at_best["tokens_per_s"], 1e-9), 3),
                "load_avg_1_5_15": {"before": [round(x, 2) for x in load_before],
                                    "after": [round(x, 2) for x in os.getloadavg()]},
                "exactly_once": auto["unique"] == auto["completions"] == n and fixed["unique"] == fixed["completions"] == n,
            }
            rows.append((profile, f"{peak:.0f} (c={best_c})", f"{auto['tokens_per_s']:.0f}",
                         f"{auto['tokens_per_s'] / peak:.3f}", f"{fixed['tokens_per_s']:.0f}",
                         f"{fixed['tokens_per_s'] / peak:.3f}", f"{at_best['tokens_per_s'] / peak:.3f}",
                         str(auto["level_max"]), str(auto["wall_s"]),
                         f"{auto['dead_lettered']}/{fixed['dead_lettered']}"))
            print(table(rows[:1] + rows[-1:]), flush=True)
            path = write_result("engine_fill" + (f"-{args.tag}" if args.tag else ""), {  # after each profile: a later one that fails keeps these
                "note": "peak = the simulated engine alone at its best fixed concurrency (no HTTP, a perfect "
                        "client); auto = one generator with no hand-set concurrency; fixed16 = the former default. "
                        "Simulated time, steady state (first/last 5% of requests excluded). Shared 2-core machine.",
                "target": 0.95, "profiles": results})
        if args.no_metrics:
            results["test-batch/no-metrics"] = no_metrics_run(stack, args.no_metrics)
            path = write_result("engine_fill" + (f"-{args.tag}" if args.tag else ""), {
                "target": 0.95, "profiles": results})
    print(table(rows))
    print(f"wrote {path}")


def no_metrics_run(stack, n: int) -> dict:
    """The openai backend (chat) against a server that reports nothing: the level climbs on measured completion
    tokens/s alone (services/generator/engine_fill.py, throughput mode). The peak is the engine alone, as above."""
    compression, _, max_new = RUNS["test-batch"]
    auto = asyncio.run(one_run(stack, "fillnm", "test-batch", compression, n, max_new,
                               {"backend": "openai", "openai_endpoint": "chat"}, flavor="openai"))
    sweep = model_peak(replace(PROFILES["test-batch"]), [16, 32, 48, 64, 96, 128], requests=max(400, n),
                       max_new_tokens=max_new, prompt_len=round(auto["mean_prompt_tokens"]))
    best_c, best = max(sweep.items(), key=lambda kv: kv[1]["tokens_per_s"])
    peak = best["tokens_per_s"]
    print(table([("no metrics (openai)", "prompts", "peak tok/s (best c)", "auto tok/s", "auto/peak", "level max",
                  "level last", "wall s"),
                 ("test-batch", str(n), f"{peak:.0f} (c={best_c})", f"{auto['tokens_per_s']:.0f}",
                  f"{auto['tokens_per_s'] / peak:.3f}", str(auto["level_max"]), str(auto["level_last"]),
                  str(auto["wall_s"]))]), flush=True)
    return {"backend": "openai (chat), server with no /metrics", "compression": compression, "prompts": n,
            "peak_tokens_per_s": round(peak, 1), "best_fixed_concurrency": best_c, "auto": auto,
            "auto_over_peak": round(auto["tokens_per_s"] / peak, 3),
            "exactly_once": auto["unique"] == auto["completions"] == n}


if __name__ == "__main__":
    main()

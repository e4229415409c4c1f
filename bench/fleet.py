"""Mission-size generation, simulated: N prompts through 4 generators (processes, `dfpipe generate`) on 4 simulated
engines (bench/engine_sim.py, one profile), with faults: one engine restart (its running requests lost), 1% 5xx
answers on every engine, a kill -9 of one generator mid-run (restarted, as `dfpipe run` would).

    python bench/fleet.py --prompts 914000          # the mission (hours here); default: a size this machine finishes
    python bench/fleet.py --prompts 600 --profile test-batch --compression 0.5 --shard-records 16 --quick
                                                    # the CI-sized path (tests/test_fleet.py runs the same)

Profile h100-27b-fp8 (cited in engine_sim.py): completions lognormal around 2,000 tokens (sigma 0.6) capped at
max_new_tokens 8192 (→ the truncation tail, finish_reason length). Payloads carry at most 16 output ids (plus
the stop id) whatever the simulated length (`--ids-cap`): 1.8 billion real ids through S3 is not this machine's
job; token counts (meta_info.completion_tokens) are the simulated ones. Time compression: stated in the result
(default 8: at the engine's peak ~1 completion per simulated second, 8 per real second per generator).

Reports: exactly-once (unique completions in shards = prompts fed; duplicates from the kill are counted and
resolved on read by prompt_id), each engine's steady-state tokens/s and fill against its peak (the engine alone
at its best fixed concurrency), simulated days to finish vs `dfpipe plan`'s prediction from a calibration at the
start (the profile's peak tokens/s and the sample's mean completion length), and the generator processes' CPU
seconds and peak memory per engine. Results in bench/results/fleet.json (or fleet-quick.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, bench_config, bench_stack, proc_numbers, table, write_result
from bench.engine_sim import PROFILES, EngineSimProcess, model_peak

ENGINES = 4
IDS_CAP = 16


def calibrate(profile: str, max_new: int) -> dict[str, float]:
    """What a calibration at the start measures: the engine's peak tokens/s at its best fixed concurrency (here: the
    simulator alone, 400 requests per level)."""
    sweep = model_peak(profile, [16, 32, 64, 96, 128, 160], requests=400, max_new_tokens=max_new, prompt_len=35)
    best_c, best = max(sweep.items(), key=lambda kv: kv[1]["tokens_per_s"])
    return {"tokens_per_s": best["tokens_per_s"], "concurrency": best_c}


def plan_days(prompts: int, mean_completion: float, tokens_per_s: float) -> float:
    """`dfpipe plan`'s generation ETA (services/trainer/cost.py) for this fleet."""
    from services.trainer.cost import RunCost

    cost = RunCost(samples=prompts, avg_tokens=mean_completion, avg_completion_tokens=mean_completion,
                   target_layers=64, hidden=5120, feature_layers=5, gpus=ENGINES, tokens_per_s_per_gpu=tokens_per_s,
                   target_params_b=27.0, epochs=1)
    return cost.report()["generation_days"]


async def fleet(n: int, compression: float, logs: Path, quick: bool, profile: str = "h100-27b-fp8",
                shard_records: int = 256) -> dict[str, Any]:
    from services.feeder.feed import Feeder
    from shared.bus import Bus
    from shared.messages import ShardWritten
    from shared.records import read_completions
    from shared.store import Store
    from shared.topology import Streams, Subjects

    max_new = PROFILES[profile].max_new_tokens
    calib = calibrate(profile, max_new)
    result: dict[str, Any] = {"prompts": n, "profile": profile, "compression": compression, "ids_cap": IDS_CAP,
                              "engines": ENGINES, "calibration": calib}
    sims = [EngineSimProcess(profile, compression=compression, enable_metrics=True, seed=i, ids_cap=IDS_CAP,
                             extra=["--error-rate", "0.01"]) for i in range(ENGINES)]
    with bench_stack() as stack:
        for s in sims:
            s.start()
        try:
            run = "fleet"
            cfg = bench_config(stack, run)
            env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root), "PYTHONPATH": str(ROOT),
                   "DFLASH_GENERATOR__BACKEND": "sglang", "DFLASH_GENERATOR__SHARD_RECORDS": str(shard_records),
                   "DFLASH_GENERATOR__SHARD_SECONDS": "5" if quick else "20", "DFLASH_GENERATOR__ACK_WAIT_S": "30",
                   "DFLASH_GENERATOR__MAX_DELIVER": "10", "DFLASH_GENERATOR__ENGINE_POLL_S": "0.5",
                   "DFLASH_SAMPLING__MAX_NEW_TOKENS": str(max_new), "DFLASH_SAMPLING__TEMPERATURE": "0.7"}

            def start_generator(i: int) -> subprocess.Popen[bytes]:
                log = open(logs / f"g{i}.log", "ab")  # noqa: SIM115 — the child owns it
                return subprocess.Popen([sys.executable, "-m", "shared.cli", "generate", "--run", run, "--worker",
                                         f"g{i}", "--engine-url", sims[i].url, "--backend", "sglang"],
                                        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

            async with await Bus.connect(cfg.bus, "bench-fleet", deadline_s=30) as bus:
                await bus.ensure_streams()
                store = Store.open(cfg)
                src = logs / "prompts.jsonl"
                with open(src, "w") as f:
                    for i in range(n):
                        f.write(json.dumps({"prompt": f"Fleet prompt {i}: explain topic {i * 7919 % 1000003}."}) + "\n")
                t0 = time.monotonic()
                feeder = asyncio.create_task(Feeder(cfg, bus, store).feed([str(src)]))
                procs = {i: [start_generator(i)] for i in range(ENGINES)}
                cpu: dict[int, float] = {}
                peak_mb: dict[int, float] = {}
                events: list[str] = []
                done_ids: set[str] = set()
                records_seen = 0
                seq = 1
                restarted = killed = False
                while len(done_ids) < n:
                    await asyncio.sleep(2.0)
                    async for s, e in bus.read_log(Streams.SHARDS, Subjects.shards(run), seq, ShardWritten):
                        seq = s + 1
                        records_seen += e.num_records
                        done_ids.update(e.prompt_ids)
                    for i, ps in procs.items():
                        for p in ps:
                            got = proc_numbers(p.pid)
                            if got:
                                peak_mb[i] = max(peak_mb.get(i, 0.0), got[0])
                                cpu[(i, p.pid)] = got[1]
                    if not restarted and len(done_ids) >= n // 3:
                        restarted = True
                        sims[0].restart(2.0)
                        events.append(f"engine 0 restarted at {len(done_ids)} completions (running requests lost)")
                    if not killed and len(done_ids) >= n // 2:
                        killed = True
                        procs[1][-1].send_signal(signal.SIGKILL)
                        procs[1][-1].wait()
                        events.append(f"generator g1 killed -9 at {len(done_ids)} completions; restarted")
                        procs[1].append(start_generator(1))
                    for i, ps in procs.items():
                        if ps[-1].poll() is not None and not (killed and i == 1 and ps[-1].returncode == -9):
                            raise RuntimeError(f"generator g{i} exited {ps[-1].returncode}; see {logs}/g{i}.log")
                    if time.monotonic() - t0 > (600 if quick else 6 * 3600):
                        raise RuntimeError(f"fleet: {len(done_ids)}/{n} after {time.monotonic() - t0:.0f}s")
                wall = time.monotonic() - t0
                await feeder
                for ps in procs.values():
                    ps[-1].send_signal(signal.SIGTERM)
                for ps in procs.values():
                    ps[-1].wait(120)
                shard_events = [e async for _, e in bus.read_log(Streams.SHARDS, Subjects.shards(run), 1, ShardWritten)]
                tokens = truncated = 0
                sample = shard_events[:: max(1, len(shard_events) // 40)]
                for e in shard_events:
                    tokens += e.completion_tokens
                    truncated += e.truncated
                ids_per_record = [len(r.output_ids or []) for e in sample[:5] for r in read_completions(store.get_bytes(e.key))]
            stats = [s.stats() for s in sims]
        finally:
            for s in sims:
                s.stop()
    unique = len(done_ids)
    records = sum(e.num_records for e in shard_events)
    mean_completion = tokens / max(1, records)
    fills = [st.steady.get("tokens_per_s", 0.0) / calib["tokens_per_s"] for st in stats]
    sim_days = max(st.last_finish_s - st.first_arrival_s for st in stats) / 86400
    planned = plan_days(n, mean_completion, calib["tokens_per_s"])
    gen_cpu = {i: sum(v for (j, _), v in cpu.items() if j == i) for i in range(ENGINES)}
    result.update({
        "wall_s": round(wall, 1), "events": events,
        "exactly_once": unique == n, "unique_completions": unique, "records_written": records,
        "duplicates_resolved_on_read": records - unique,
        "mean_completion_tokens": round(mean_completion, 1), "truncated": truncated,
        "truncation_rate": round(truncated / max(1, records), 4), "ids_per_record_sampled_max": max(ids_per_record),
        "engine_tokens_per_s": [round(st.steady.get("tokens_per_s", 0.0), 1) for st in stats],
        "engine_mean_running": [round(st.steady.get("mean_running", 0.0), 1) for st in stats],
        "fill_vs_peak": [round(f, 3) for f in fills], "mean_fill_vs_peak": round(sum(fills) / len(fills), 3),
        "faults": [st.faults_injected for st in stats], "retracted": [st.requests_retracted for st in stats],
        "restarts": [st.restarts for st in stats], "tokens_for_nobody": [st.tokens_for_nobody for st in stats],
        "simulated_days": round(sim_days, 4), "plan_days": round(planned, 4),
        "simulated_over_plan": round(sim_days / planned, 3) if planned else None,
        "projected_914k_days": round(914_000 / n * sim_days, 2),
        "generator_cpu_s_per_engine": {f"g{i}": round(v, 1) for i, v in gen_cpu.items()},
        "generator_cpu_s_per_1000_completions": round(1000 * sum(gen_cpu.values()) / max(1, records), 2),
        "generator_peak_rss_mb_per_engine": {f"g{i}": round(v) for i, v in peak_mb.items()},
    })
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--compression", type=float, default=8.0)
    ap.add_argument("--profile", default="h100-27b-fp8")
    ap.add_argument("--shard-records", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="the CI-sized path: results to fleet-quick.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dflash-fleet-") as tmp:
        r = asyncio.run(fleet(args.prompts, args.compression, Path(tmp), args.quick, args.profile, args.shard_records))
    rows = [("prompts", "exactly once", "dups on read", "mean fill/peak", "sim days", "plan days", "914K days",
             "gen CPU s/1000", "gen RSS MB"),
            (str(r["prompts"]), str(r["exactly_once"]), str(r["duplicates_resolved_on_read"]),
             str(r["mean_fill_vs_peak"]), str(r["simulated_days"]), str(r["plan_days"]),
             str(r["projected_914k_days"]), str(r["generator_cpu_s_per_1000_completions"]),
             str(max(r["generator_peak_rss_mb_per_engine"].values(), default=0)))]
    print(table(rows))
    print("\n".join(r["events"]))
    path = write_result("fleet-quick" if args.quick else "fleet", r)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The whole control plane at the mission's scale: feed → 4 synthetic generators → tokenizer → status →
the trainer's data loading, step schedule and a few real optimizer steps, on the embedded stack.

    python bench/scale.py --prompts 100000        # one size per invocation; merged into bench/results/scale.json

The services are the real ones, run as `dfpipe run` runs them (services/pipeline/supervisor.py: one process
each, restarted after a crash); the engine is `--backend synthetic` (a load generator: pseudo-completions
of 40..80 tokens, as token ids). Mid-run, one generator and then the tokenizer are killed with SIGKILL;
the run must still end exactly-once: unique completions = accepted prompts, one sample per kept prompt.

Measured per size: wall time and prompts/s of each stage, CPU ms per prompt and peak RSS of every process,
`dfpipe status` latency at the end (cold: a fresh process; warm: a second process, and the status API's
second call in one process), the dashboard listener's catch-up and snapshot latency, the trainer's data
memory (anonymous apart from mapped files), its index and plan times. Targets (DESIGN.md, Scale) are for
914,000 prompts; smaller sizes show the per-prompt cost curve. The stack's JetStream fsync is the embedded
default, "always"; BENCH_NATS_SYNC=2m runs it with nats-server's own (the result records which).
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

from common import NATS_SYNC, ROOT, bench_config, bench_stack, proc_numbers, table, write_result

from services.pipeline.run import RunRequest, service_specs
from services.pipeline.supervisor import Supervisor
from shared.config import Config
from shared.store import Store
from shared.topology import Keys, Streams, durable

GENERATORS = 4
TARGETS = {"status_warm_s": 1.0, "status_cold_s": 3.0, "trainer_data_anon_mb": 1024, "prompts_per_s": 500}
# The control plane's settings for the bench (the services' own defaults otherwise), written to a TOML file
# the service processes read: shards of 512 completions (a synthetic engine fills one in about a second),
# prompts redelivered 10 s after a worker dies (the kill below), shards 15 s after a tokenizer dies.
SETTINGS = {
    "generator": {"backend": "synthetic", "shard_records": 512, "shard_seconds": 10.0, "max_inflight": 64,
                  "ack_wait_s": 10.0, "progress_every_s": 3.0},
    "tokenizer": {"ack_wait_s": 15.0, "max_ack_pending": 8, "processes": 2},
    "trainer": {"num_layers": 1, "block_size": 8, "anchors_per_sequence": 8, "token_budget": 1024,
                "max_length": 512, "holdout_mod": 20, "autocast": "off"},
    "model": {"device": "cpu"},
}


def prompts_file(path: Path, n: int) -> Path:
    """N distinct one-turn prompts (distinct text → distinct prompt_ids)."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Scale prompt {i}: write three sentences about item {i * 7919 % 1000003}."})
                    + "\n")
    return path


def toml_of(settings: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in settings.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


class Meter:
    """Peak RSS and CPU time of every process, by service name; a restarted service's processes add up."""

    def __init__(self) -> None:
        self.peak_mb: dict[str, float] = {}
        self.cpu_s: dict[tuple[str, int], float] = {}

    def sample(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            got = proc_numbers(pid)
            if got is not None:
                self.peak_mb[name] = max(self.peak_mb.get(name, 0.0), got[0])
                self.cpu_s[(name, pid)] = got[1]

    def cpu_by_service(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (name, _), s in self.cpu_s.items():
            out[name] = out.get(name, 0.0) + s
        return out


DURABLE_STATUS_KEYS = ("total", "rejects", "completed", "completion_records", "shards", "dead_lettered",
                       "tokenized_samples", "tokenized_shards", "tokenized_records", "dropped")


async def consumer_counts(bus: Any, stream: str, consumer: str) -> tuple[int, int] | None:
    """(pending, ack pending) of a consumer; None before it exists."""
    info = await bus.consumer_state(stream, consumer)
    return None if info is None else (info.pending, info.ack_pending)


async def drive(cfg: Config, stack: Any, prompts: Path, env: dict[str, str], logs: Path, faults: bool) -> dict[str, Any]:
    """Run the services until every prompt is tokenized; stage times, faults made, per-process numbers."""
    from shared.bus import Bus

    run = cfg.run
    request = RunRequest(prompts=[str(prompts)], generators=[None] * GENERATORS, backend="synthetic",
                         train=False, dashboard=False, extra_env=env)
    sup = Supervisor(service_specs(cfg, request), logs, crash_limit=5, backoff_base_s=0.5, grace_s=30.0)
    meter = Meter()
    times: dict[str, float] = {}
    kills: list[dict[str, Any]] = []
    t0 = time.monotonic()
    sup.start()
    async with await Bus.connect(cfg.bus, "bench-scale", deadline_s=30) as bus:
        await bus.ensure_streams()
        total: int | None = None
        try:
            while True:
                meter.sample({**{n: st.pid for n, st in sup.services.items() if st.pid},
                              **{f"stack:{n}": p for n, p in stack.pids.items()}})
                now = time.monotonic() - t0
                states = sup.state()
                if "crash_loop" in states.values():
                    raise RuntimeError(f"a service is crash-looping: {states}; logs in {logs}")
                if states["feeder"] == "done" and "feed" not in times:
                    times["feed"] = now
                    store = await asyncio.to_thread(Store.open, cfg)
                    manifest = await asyncio.to_thread(store.get_bytes, Keys.manifest(run))
                    total = json.loads(manifest)["total_accepted"]
                gen = await consumer_counts(bus, Streams.PROMPTS, durable("generate", run))
                tok = await consumer_counts(bus, Streams.SHARDS, durable("tokenize", run))
                if total and gen is not None:
                    done = total - gen[0] - gen[1]
                    if faults and not kills and done >= 0.3 * total:
                        kills.append(kill(sup, "generator-1", now, done))
                    elif faults and len(kills) == 1 and done >= 0.5 * total:
                        kills.append(kill(sup, "tokenizer", now, done))
                    if gen == (0, 0) and "generate" not in times and len(kills) >= (2 if faults else 0):
                        times["generate"] = now
                if "generate" in times and tok == (0, 0):
                    times["tokenize"] = now
                    break
                await asyncio.sleep(0.5)
        finally:
            meter.sample({n: st.pid for n, st in sup.services.items() if st.pid})
            await sup.stop()
    restarts = {n: st.starts - 1 for n, st in sup.services.items() if st.starts > 1}
    return {"times": times, "kills": kills, "restarts": restarts, "peak_rss_mb": meter.peak_mb,
            "cpu_s": meter.cpu_by_service(), "accepted": total}


def kill(sup: Supervisor, name: str, at_s: float, done: int) -> dict[str, Any]:
    pid = sup.services[name].pid
    if pid is not None:
        os.killpg(pid, signal.SIGKILL)  # its own session (start_new_session): the service and its pool processes
    return {"service": name, "pid": pid, "at_s": round(at_s, 1), "prompts_done": done}


def timed_status(env: dict[str, str], run: str) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "shared.cli", "status", "--run", run, "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    elapsed = time.perf_counter() - t
    if out.returncode not in (0, 1):
        raise RuntimeError(f"dfpipe status failed: {out.stderr[-2000:]}")
    return elapsed, json.loads(out.stdout)


async def status_api_latency(cfg: Config) -> list[float]:
    """Two polls of the status API in one process with one ledger (the second is the warm one: it folds only the tail)."""
    from shared.bus import Bus
    from shared.ledger import RunLedger
    from shared.status import run_status

    store = await asyncio.to_thread(Store.open, cfg, ensure_bucket=False)
    out = []
    async with await Bus.connect(cfg.bus, "bench-status", deadline_s=10) as bus:
        ledger = RunLedger(cfg, bus, store)  # kept between polls, as `dfpipe run` and the dashboard keep theirs
        for _ in range(2):
            t = time.perf_counter()
            await run_status(cfg, bus, store, ledger)
            out.append(time.perf_counter() - t)
    return out


def dashboard_latency(cfg: Config, shards: int, timeout_s: float = 600.0) -> dict[str, float]:
    """The dashboard's listener: time until its snapshot shows every shard (a page opened cold), then the
    snapshot call itself (every page refresh)."""
    from dashboard.listener import Listener

    t = time.perf_counter()
    listener = Listener(cfg, cfg.run)
    try:
        while True:
            snap = listener.snapshot()
            d = snap.durable.get(cfg.run)
            if d is not None and d.shards >= shards and d.tokenized_shards >= shards:
                break
            if time.perf_counter() - t > timeout_s:
                raise TimeoutError(f"the dashboard did not catch up with {shards} shards in {timeout_s:.0f}s")
            time.sleep(0.1)
        catch_up = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(10):
            listener.snapshot()
        return {"catch_up_s": round(catch_up, 3), "snapshot_s": round((time.perf_counter() - t) / 10, 5)}
    finally:
        listener.close()


def memory_mb() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon:", "RssFile:", "VmHWM:")):
            name, kb = line.split(":")[0], int(line.split()[1])
            fields[name] = kb / 1024
    return fields


async def trainer_probe(cfg: Config, steps: int) -> dict[str, Any]:
    """In its own process: the trainer's data plane at this size, then `steps` real optimizer steps."""
    import numpy as np
    import torch

    from services.trainer.data import SampleIndex, ShardCache, epoch_order, shard_keys
    from services.trainer.loop import Trainer
    from services.trainer.schedule import StepSchedule, warmup_steps
    from shared.bus import Bus

    torch.manual_seed(0)
    store = await asyncio.to_thread(Store.open, cfg)
    async with await Bus.connect(cfg.bus, "bench-trainer", deadline_s=30) as bus:
        keys = await shard_keys(bus, cfg.run)
        base = memory_mb()
        index = SampleIndex(store, ShardCache.for_config(cfg))
        t = time.perf_counter()
        await asyncio.to_thread(index.add, keys)  # fetch + convert every shard (first time on this node)
        index_s = time.perf_counter() - t
        t = time.perf_counter()
        train = index.select(keys, holdout_mod=cfg.trainer.holdout_mod, train=True)
        held = index.select(keys, holdout_mod=cfg.trainer.holdout_mod, train=False)
        select_s = time.perf_counter() - t
        everything = index.select(keys, holdout_mod=0, train=True)  # every kept prompt: train and held out
        rows = sum(len(m) for m in index._meta.values())
        after = memory_mb()
        t = time.perf_counter()
        reindexed = SampleIndex(store, ShardCache.for_config(cfg))  # a restart: every shard already on disk
        reindexed.add(keys)
        reindex_s = time.perf_counter() - t
        del reindexed

        trainer = await asyncio.to_thread(Trainer, cfg, bus, store)
        trainer.index = index
        t = time.perf_counter()
        order = epoch_order(len(train), cfg.trainer.seed, 0)
        per_epoch = trainer.packing.steps_per_epoch(train.num_tokens)
        pass_steps = trainer.packing.pass_steps(trainer.packing.lengths(train.num_tokens, order))
        plan_s = time.perf_counter() - t
        trainer.schedule = StepSchedule(total=steps, warmup=warmup_steps(steps, cfg.trainer.warmup_ratio))
        trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.opt, trainer.schedule.lr_lambda())
        losses, step_s = [], []
        for _ in range(steps):
            t = time.perf_counter()
            out = await asyncio.to_thread(trainer.take_step, train, order)
            step_s.append(time.perf_counter() - t)
            losses.append(round(out.loss, 4))
        pids = everything._rows["prompt_id"]
        return {
            "shards": len(keys), "rows": rows, "unique_prompts": len(np.unique(pids)), "kept": len(everything),
            "train_samples": len(train), "held_out_samples": len(held),
            "tokens": int(everything.num_tokens.sum()), "index_s": round(index_s, 3), "select_s": round(select_s, 3),
            "reindex_from_disk_s": round(reindex_s, 3), "plan_s": round(plan_s, 3), "steps_per_epoch": per_epoch,
            "pass_steps": pass_steps, "set_bytes": train.memory_bytes() + held.memory_bytes(),
            "memory_mb_before": base, "memory_mb_after_data": after,
            "data_anon_mb": round(after["RssAnon"] - base["RssAnon"], 1),
            "data_mapped_mb": round(after["RssFile"] - base["RssFile"], 1),
            "optimizer_steps": steps, "losses": losses, "step_s": [round(s, 3) for s in step_s],
            "peak_rss_mb": memory_mb()["VmHWM"],
        }


def run_probe(env: dict[str, str], config_path: Path, run: str, steps: int) -> tuple[dict[str, Any], float]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(Path(__file__)), "--probe", "--run", run, "--config", str(config_path),
                          "--steps", str(steps)], env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"trainer probe failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - t


def measure(n: int, faults: bool, steps: int) -> dict[str, Any]:
    run = f"scale{n}"
    with bench_stack() as stack, tempfile.TemporaryDirectory(prefix="dflash-scale-") as tmp:
        cfg = bench_config(stack, run, **SETTINGS)
        work = Path(tmp)
        config_path = work / "scale.toml"
        config_path.write_text(toml_of({**SETTINGS, "stack": {"data_dir": str(stack.root)}}))
        env = {**os.environ, **stack.env(), "DFLASH_CONFIG": str(config_path), "PYTHONPATH": str(ROOT)}
        t = time.perf_counter()
        prompts = prompts_file(work / "prompts.jsonl", n)
        prompts_file_s = time.perf_counter() - t
        run_out = asyncio.run(drive(cfg, stack, prompts, env, work / "logs", faults))
        cold_s, status = timed_status(env, run)
        warm_s, status2 = timed_status(env, run)
        api_s = asyncio.run(status_api_latency(cfg))
        dash = dashboard_latency(cfg, status["shards"])
        probe, probe_s = run_probe(env, config_path, run, steps)
    times, accepted = run_out["times"], run_out["accepted"]
    cpu = run_out["cpu_s"]
    dead = sum(status["dead_lettered"].values())
    exactly_once = {
        "accepted": accepted, "completed_unique": status["completed"], "completion_records": status["completion_records"],
        "dead_lettered": dead, "tokenized_kept": status["tokenized_samples"], "dropped": status["dropped"],
        "trainer_rows": probe["rows"], "trainer_unique_prompts": probe["unique_prompts"], "trainer_kept": probe["kept"],
        "unique_completions_equal_accepted": status["completed"] == accepted and dead == 0,
        "one_sample_per_kept_prompt": probe["rows"] == probe["unique_prompts"] == probe["kept"]
        == status["tokenized_samples"] == accepted - sum(v for k, v in status["dropped"].items() if k != "duplicate"),
        # the durable counts (a fresh process from the snapshot + tail vs the one that wrote it); rates, ETAs and
        # workers' ages move with the clock between the two calls
        "status_calls_agree": all(status[k] == status2[k] for k in DURABLE_STATUS_KEYS),
    }
    e2e = times["tokenize"]
    return {
        "prompts": n, "nats_sync": NATS_SYNC, "generators": GENERATORS, "settings": SETTINGS, "faults": run_out["kills"],
        "restarts": run_out["restarts"], "prompts_file_s": round(prompts_file_s, 2),
        "stages_s": {k: round(v, 2) for k, v in times.items()},
        "prompts_per_s": {"feed": round(n / times["feed"], 1), "generate": round(n / times["generate"], 1),
                          "end_to_end": round(n / e2e, 1)},
        "wall_us_per_prompt_end_to_end": round(1e6 * e2e / n, 1),
        "cpu_ms_per_prompt": {k: round(1e3 * v / n, 3) for k, v in sorted(cpu.items())},
        "cpu_ms_per_prompt_total": round(1e3 * sum(cpu.values()) / n, 3),
        "peak_rss_mb": {k: round(v, 1) for k, v in sorted(run_out["peak_rss_mb"].items())},
        "status": {"cold_process_s": round(cold_s, 3), "warm_process_s": round(warm_s, 3),
                   "api_first_s": round(api_s[0], 3), "api_second_s": round(api_s[1], 3), "shards": status["shards"]},
        "dashboard": dash, "trainer": {**probe, "process_s": round(probe_s, 2)},
        "exactly_once": exactly_once,
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
    }


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "status_warm_s": {"measured": r["status"]["warm_process_s"], "target": TARGETS["status_warm_s"],
                          "met": r["status"]["warm_process_s"] <= TARGETS["status_warm_s"]},
        "status_cold_s": {"measured": r["status"]["cold_process_s"], "target": TARGETS["status_cold_s"],
                          "met": r["status"]["cold_process_s"] <= TARGETS["status_cold_s"]},
        "trainer_data_anon_mb": {"measured": r["trainer"]["data_anon_mb"], "target": TARGETS["trainer_data_anon_mb"],
                                 "met": r["trainer"]["data_anon_mb"] <= TARGETS["trainer_data_anon_mb"]},
        "prompts_per_s": {"measured": r["prompts_per_s"]["end_to_end"], "target": TARGETS["prompts_per_s"],
                          "met": r["prompts_per_s"]["end_to_end"] >= TARGETS["prompts_per_s"]},
        "exactly_once": {"met": r["exactly_once"]["unique_completions_equal_accepted"]
                         and r["exactly_once"]["one_sample_per_kept_prompt"]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=3, help="real optimizer steps of a tiny drafter on the loaded data")
    ap.add_argument("--no-faults", action="store_true", help="skip the mid-run kill -9 of a generator and the tokenizer")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "scale.json",
                    help="the JSON the size is merged into")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the trainer probe's own process
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        from shared.config import load_config

        cfg = load_config(Path(args.config))
        cfg = msgspec_replace(cfg, run=args.run)
        print(json.dumps(asyncio.run(trainer_probe(cfg, args.steps))))
        return 0
    r = measure(args.prompts, not args.no_faults, args.steps)
    r["targets"] = verdict(r)
    sizes: dict[str, Any] = {}
    if args.results.exists():
        sizes = json.loads(args.results.read_text()).get("sizes", {})
    sizes[str(args.prompts)] = r
    if args.results == ROOT / "bench" / "results" / "scale.json":
        out = write_result("scale", {"note": "targets are for 914,000 prompts on 2 cores; per-prompt costs at each size",
                                     "sizes": dict(sorted(sizes.items(), key=lambda kv: int(kv[0])))})
    else:
        args.results.write_text(json.dumps({"benchmark": "scale", "sizes": sizes}, indent=2) + "\n")
        out = args.results
    rows = [("prompts", "e2e p/s", "gen p/s", "cpu ms/p", "status cold/warm s", "dash catch-up s",
             "data anon/mapped MB", "plan s", "exactly-once")]
    for size, s in sorted(sizes.items(), key=lambda kv: int(kv[0])):
        t = s["trainer"]
        rows.append((f"{int(size):,}", f"{s['prompts_per_s']['end_to_end']:.0f}", f"{s['prompts_per_s']['generate']:.0f}",
                     f"{s['cpu_ms_per_prompt_total']:.2f}",
                     f"{s['status']['cold_process_s']:.2f}/{s['status']['warm_process_s']:.2f}",
                     f"{s['dashboard']['catch_up_s']:.2f}", f"{t['data_anon_mb']:.0f}/{t['data_mapped_mb']:.0f}",
                     f"{t['plan_s']:.3f}", str(s["targets"]["exactly_once"]["met"])))
    print(table(rows))
    print(f"wrote {out}")
    return 0 if r["targets"]["exactly_once"]["met"] else 1


def msgspec_replace(cfg: Config, **kw: Any) -> Config:
    import msgspec

    return msgspec.structs.replace(cfg, **kw)


if __name__ == "__main__":
    sys.exit(main())

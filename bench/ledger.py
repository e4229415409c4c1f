"""The run ledger against the full replay it replaced: `dfpipe status` cost as a run's logs grow.

Publishes a run's shard events to a real embedded stack in steps (by default 5 × 10,000 events: 38,000
ShardWritten carrying 914,000 unique prompt ids, plus 12,000 TokenizedShard). After each step a long-lived
ledger folds the step (as `dfpipe run` and the trainer do between polls), then a warm poll is timed with no new
event and with 100 new events. At the first and last step the old full replay (every event from sequence 1,
one `get_msg` each) is timed too. At the end: the snapshot's size, encode and load time; a cold
`dfpipe status` in a fresh process (median of 3) from the snapshot (with an empty tail and a 1,000-event
tail) and once with no snapshot (a rebuild from the logs, which also writes the snapshot before it exits); the dashboard's time to its first counts and its snapshot() latency.
Targets (issue 22, on this 2-core machine): status <= 1 s warm and <= 3 s cold at 914K prompts.
Prints a table, writes bench/results/ledger.json.

    python bench/ledger.py [--steps 5] [--events-per-step 10000] [--prompts 914000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

from common import ROOT, bench_config, bench_stack, table, write_result

from shared.bus import Bus
from shared.config import Config
from shared.ledger import Ledger, RunLedger
from shared.messages import Message, ShardWritten, TokenizedShard
from shared.status import run_status
from shared.store import Store
from shared.topology import Keys, Streams, Subjects


def step_events(run: str, step: int, n_events: int, prompts_per_step: int, rng: random.Random) -> list[tuple[str, Message]]:
    """`n_events` events: 76% ShardWritten (the step's prompts, ~3% of them completed twice), 24% TokenizedShard."""
    n_shards = round(n_events * 0.76)
    first = step * prompts_per_step
    ids = [f"{i:064x}" for i in range(first, first + prompts_per_step)]
    per = -(-len(ids) // n_shards)
    out: list[tuple[str, Message]] = []
    for j in range(n_shards):
        chunk = ids[j * per:(j + 1) * per] or ids[:1]
        chunk = chunk + rng.sample(ids, 1) if rng.random() < 0.7 else chunk  # a redelivered prompt, written twice
        key = Keys.completions(run, f"gen{j % 4}", step * n_shards + j)
        out.append((Subjects.shards(run), ShardWritten(run=run, key=key, worker=f"gen{j % 4}", seq=j,
                                                       num_records=len(chunk), prompt_ids=chunk, sha256="0" * 64,
                                                       size_bytes=4096)))
        if len(out) < n_events and j < n_events - n_shards:
            out.append((Subjects.tokenized(run), TokenizedShard(
                run=run, key=Keys.tokenized(run, "fp", f"{step}-{j}"), source_key=key, fingerprint="fp",
                num_samples=len(chunk) - 1, num_tokens=2000 * len(chunk), num_supervised=1500 * len(chunk),
                sha256="1" * 64, dropped={"duplicate": 1}, supervised_histogram={"1024": len(chunk) - 1})))
    return out[:n_events]


async def timed(coro) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = await coro
    return time.perf_counter() - t0, out


async def full_replay(bus: Bus, run: str) -> int:
    """The pre-ledger status read: every ShardWritten and TokenizedShard from sequence 1 (through the one log
    reader, batched; the results before it was the only one were measured with one get_msg per event)."""
    prompts: set[str] = set()
    n = 0
    async for _, e in bus.read_log(Streams.SHARDS, Subjects.shards(run), 1, ShardWritten):
        prompts.update(e.prompt_ids)
        n += 1
    async for _ in bus.read_log(Streams.TOKENIZED, Subjects.tokenized(run), 1, TokenizedShard):
        n += 1
    return len(prompts)


# `dfpipe status` as the console script runs it, reporting its own peak RSS (VmHWM: this process image's,
# not the forking parent's, which ru_maxrss would include) on the way out
STATUS = """import re, sys
from shared.cli import main
try:
    code = main(sys.argv[1:])
finally:
    hwm = re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)
    print("vmhwm_kb", hwm, file=sys.stderr)
sys.exit(code)
"""


def cold_status(env: dict[str, str], run: str, repeat: int = 3) -> tuple[float, int, int]:
    """A fresh `dfpipe status --json` process, `repeat` times: median wall seconds, completed, peak RSS in MB."""
    walls, rss = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", STATUS, "status", "--run", run, "--json"], env=env,
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        walls.append(time.perf_counter() - t0)
        if out.returncode not in (0, 1):
            raise RuntimeError(out.stderr[-2000:])
        rss = max(rss, int(out.stderr.rsplit("vmhwm_kb", 1)[1].split()[0]) // 1024)
    return sorted(walls)[len(walls) // 2], json.loads(out.stdout)["completed"], rss


def dashboard_latency(cfg: Config, completed: int) -> dict[str, float]:
    from dashboard.listener import Listener

    t0 = time.perf_counter()
    listener = Listener(cfg, cfg.run)
    try:
        while True:
            counts = listener.snapshot().durable.get(cfg.run)
            if counts is not None and counts.completed == completed:
                break
            if time.perf_counter() - t0 > 120:
                raise RuntimeError("the dashboard never showed the run's counts")
            time.sleep(0.05)
        first = time.perf_counter() - t0
        n, t1 = 200, time.perf_counter()
        for _ in range(n):
            listener.snapshot()
        return {"dashboard_first_counts_s": round(first, 3), "dashboard_snapshot_ms": round(1000 * (time.perf_counter() - t1) / n, 3)}
    finally:
        listener.close()


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prompts_per_step = args.prompts // args.steps
    with bench_stack() as stack:
        run = "ledgerbench"
        cfg = bench_config(stack, run)
        env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root), "PYTHONPATH": str(ROOT)}
        store = Store.open(cfg)
        store.put_bytes(Keys.manifest(run), b'{"total_accepted": %d, "total_rejected": 0}' % args.prompts)
        async with await Bus.connect(cfg.bus, "bench-ledger") as bus:
            await bus.ensure_streams()
            warm = RunLedger(cfg, bus, store, use_snapshot=False)
            rows: list[dict[str, float]] = []
            events = 0
            for step in range(args.steps):
                batch = step_events(run, step, args.events_per_step, prompts_per_step, rng)
                await bus.publish_many([(s, m, None) for s, m in batch], window=4000)
                events += len(batch)
                fold_s, st = await timed(run_status(cfg, bus, store, warm))
                idle_s, _ = await timed(run_status(cfg, bus, store, warm))
                extra = step_events(run, 1000 + step, 100, 100, rng)
                await bus.publish_many([(s, m, None) for s, m in extra], window=4000)
                events += len(extra)
                tail_s, st = await timed(run_status(cfg, bus, store, warm))
                row = {"events": events, "completed": st.completed, "fold_step_s": round(fold_s, 3),
                       "warm_poll_0_new_s": round(idle_s, 4), "warm_poll_100_new_s": round(tail_s, 4)}
                if step in (0, args.steps - 1):
                    replay_s, n = await timed(full_replay(bus, run))
                    assert n == st.completed, (n, st.completed)
                    row["full_replay_s"] = round(replay_s, 2)
                rows.append(row)
                print(f"step {step + 1}/{args.steps}: {row}", flush=True)
            fold = warm.ledger
            assert fold is not None
            t0 = time.perf_counter()
            data = fold.encode()
            encode_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            store.put_bytes(Keys.ledger(run), data)
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            loaded = Ledger.decode(store.get_bytes(Keys.ledger(run)), run)
            load_s = time.perf_counter() - t0
            assert loaded.counts() == fold.counts()
            completed = fold.completed
            cold_wall, cold_completed, cold_rss = cold_status(env, run)
            tail = step_events(run, 2000, 1000, 1000, rng)
            await bus.publish_many([(s, m, None) for s, m in tail], window=4000)
            final = await run_status(cfg, bus, store, warm)
            cold_tail_wall, cold_tail_completed, _ = cold_status(env, run)
            store.delete(Keys.ledger(run))
            rebuild_wall, rebuild_completed, rebuild_rss = cold_status(env, run, repeat=1)  # it writes a snapshot
            assert cold_completed == completed and cold_tail_completed == rebuild_completed == final.completed
        dash = dashboard_latency(cfg, final.completed)
    last = rows[-1]
    result = {
        "load_average_1_5_15": [round(x, 1) for x in os.getloadavg()],  # the 2 cores are shared: a busy machine slows every figure
        "events": events + len(tail), "unique_prompts": final.completed, "shards": final.shards,
        "steps": rows,
        "snapshot": {"bytes": len(data), "prompt_hash_bytes": 8 * completed, "encode_s": round(encode_s, 3),
                     "put_s": round(put_s, 3), "get_and_decode_s": round(load_s, 3)},
        "cold_status_from_snapshot_s": round(cold_wall, 3), "cold_status_rss_mb": cold_rss,
        "cold_status_snapshot_plus_1000_tail_s": round(cold_tail_wall, 3),
        "cold_status_no_snapshot_rebuild_s": round(rebuild_wall, 3),
        "cold_status_rebuild_rss_mb": rebuild_rss,
        **dash,
        "targets": {"warm_s": 1.0, "cold_s": 3.0,
                    "warm_met": last["warm_poll_100_new_s"] <= 1.0, "cold_met": cold_tail_wall <= 3.0},
        "speedup_warm_vs_full_replay": round(last["full_replay_s"] / max(1e-6, last["warm_poll_100_new_s"]), 1),
    }
    print()
    print(table([("events", "completed", "fold step s", "warm poll (0 new) s", "warm poll (100 new) s", "full replay s")]
                + [(str(r["events"]), str(r["completed"]), str(r["fold_step_s"]), str(r["warm_poll_0_new_s"]),
                    str(r["warm_poll_100_new_s"]), str(r.get("full_replay_s", ""))) for r in rows]))
    print()
    print(table([
        ("measure", "value"),
        ("snapshot size", f"{len(data) / 1e6:.1f} MB ({8 * completed / 1e6:.1f} MB prompt hashes)"),
        ("snapshot encode / put / get+decode", f"{encode_s:.3f} / {put_s:.3f} / {load_s:.3f} s"),
        ("cold dfpipe status (snapshot, empty tail)", f"{cold_wall:.2f} s, peak RSS {cold_rss} MB"),
        ("cold dfpipe status (snapshot + 1000-event tail)", f"{cold_tail_wall:.2f} s"),
        ("cold dfpipe status (no snapshot: rebuild)", f"{rebuild_wall:.2f} s, peak RSS {rebuild_rss} MB"),
        ("dashboard: first counts / snapshot()", f"{dash['dashboard_first_counts_s']} s / {dash['dashboard_snapshot_ms']} ms"),
    ]))
    print(f"\nwrote {write_result('ledger', result)}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--events-per-step", type=int, default=10_000)
    p.add_argument("--prompts", type=int, default=914_000)
    asyncio.run(main(p.parse_args()))

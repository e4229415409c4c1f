"""JetStream publish/consume rate for PromptTask-sized messages, with and without fsync, and S3 put/get throughput.

Starts its own embedded stacks on free ports. The bus is measured under each JetStream sync setting
(`stack.nats_sync`: "always", the embedded default, fsyncs every write before its ack; "2m" is
nats-server's own default), alternated over ROUNDS rounds in one run so the ratio is taken under the
same load: pipelined publishes with acks (the feeder's path, a window of acks in flight), one awaited
publish at a time (a service's event), and consume + ack. Targets (2-core machine): >= 10,000 prompt
messages/s published with acks; S3 put of 64 MiB objects >= 50% of a local-disk copy of the same
file, measured in the same run. Prints a table, writes bench/results/bus.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus import Bus, WorkStats, consumer_for
from shared.config import BusConfig, StoreConfig
from shared.messages import ChatMessage, PromptTask
from shared.stack import EmbeddedStack, Ports, StackError
from shared.store import Store
from shared.topology import Subjects

N_MSGS = int(os.environ.get("BENCH_BUS_N", "20000"))
N_SINGLE = 500  # awaited one at a time
SYNC_MODES = ("always", "2m")
ROUNDS = 2


async def bus_rates(url: str) -> dict[str, float]:
    bus = await Bus.connect(BusConfig(url=url), "bench")
    await bus.ensure_streams()
    run = "bench" + secrets.token_hex(3)
    subject = Subjects.prompts(run)
    text = "Explain the difference between weather and climate to a ten-year-old, with two examples."
    items = [(subject, PromptTask(run=run, prompt_id=f"{i:064x}", messages=[ChatMessage(role="user", content=text)]),
              f"{run}:{i}") for i in range(N_MSGS + N_SINGLE)]
    t0 = time.perf_counter()
    acks = await bus.publish_many(items[:N_MSGS], window=4000)
    pub = N_MSGS / (time.perf_counter() - t0)
    assert sum(1 for a in acks if not a.duplicate) == N_MSGS
    t0 = time.perf_counter()
    for item in items[N_MSGS:]:
        await bus.publish(*item)
    single = N_SINGLE / (time.perf_counter() - t0)
    spec = consumer_for("generate", run, max_ack_pending=20_000)
    stop, stats = asyncio.Event(), WorkStats()

    async def handle(d):
        return None

    t0 = time.perf_counter()
    worker = asyncio.create_task(bus.work(spec, handle, run=run, stop=stop, message_type=PromptTask, stats=stats,
                                          max_inflight=1000, fetch_batch=500))
    while stats.acked < N_MSGS + N_SINGLE:
        await asyncio.sleep(0.01)
    consume = (N_MSGS + N_SINGLE) / (time.perf_counter() - t0)
    stop.set()
    await worker
    await bus.close()
    return {"publish_msgs_per_s": pub, "publish_one_at_a_time_msgs_per_s": single, "consume_msgs_per_s": consume}


def sync_rates(root: Path) -> dict[str, dict]:
    """Each sync mode's bus rates, modes alternated over ROUNDS rounds (a fresh nats-server each time)."""
    per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in SYNC_MODES}
    for r in range(ROUNDS):
        for mode in SYNC_MODES:
            stack = EmbeddedStack(root / f"bus-{mode}-{r}", Ports.free(), nats_sync=mode)
            stack.start_nats()
            try:
                stack.wait_healthy(30, s3=False)
                in_effect = stack.nats_sync_in_effect()
                if (in_effect == "always") != (mode == "always"):
                    raise StackError(f"asked nats-server for sync {mode}, it runs {in_effect}")
                per_mode[mode].append(asyncio.run(bus_rates(stack.nats_url)))
            finally:
                stack.stop()
            print(f"round {r + 1} sync {mode:6}: " + ", ".join(f"{k} {v:,.0f}" for k, v in per_mode[mode][-1].items()))
    return {mode: {"rounds": rounds, **{k: sum(x[k] for x in rounds) / len(rounds) for k in rounds[0]}}
            for mode, rounds in per_mode.items()}


def s3_rates(store: Store, tmp: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    small = os.urandom(1 << 20)
    t0 = time.perf_counter()
    for i in range(32):
        store.put_bytes(f"bench/1m/{i}", small)
    out["put_1MiB_MiB_per_s"] = 32 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(32):
        store.get_bytes(f"bench/1m/{i}")
    out["get_1MiB_MiB_per_s"] = 32 / (time.perf_counter() - t0)
    big = tmp / "big.bin"
    big.write_bytes(os.urandom(64 << 20))
    t0 = time.perf_counter()
    for _ in range(3):
        shutil.copyfile(big, tmp / "copy.bin")
        os.sync()
    out["local_copy_64MiB_MiB_per_s"] = 3 * 64 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(3):
        store.put_file(f"bench/64m/{i}", big)
    out["put_64MiB_MiB_per_s"] = 3 * 64 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(3):
        store.get_file(f"bench/64m/{i}", tmp / "back.bin")
    out["get_64MiB_MiB_per_s"] = 3 * 64 / (time.perf_counter() - t0)
    return out


def main() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench" + secrets.token_hex(4))
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", secrets.token_urlsafe(24))
    with tempfile.TemporaryDirectory() as d:
        sync = sync_rates(Path(d))
        stack = EmbeddedStack(Path(d) / "stack", Ports.free())
        stack.start()
        try:
            store = Store(StoreConfig(endpoint=stack.s3_endpoint, bucket=stack.bucket),
                          os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
            res = s3_rates(store, Path(d))
        finally:
            stack.stop()
    always, default = sync["always"], sync["2m"]
    res.update({f"{k}_sync_{mode}": sync[mode][k] for mode in SYNC_MODES for k in always if k != "rounds"})
    fsync_cost = {k: always[k] / default[k] for k in always if k != "rounds"}
    ratio = res["put_64MiB_MiB_per_s"] / res["local_copy_64MiB_MiB_per_s"]
    targets = {
        "publish_ge_10000_msgs_per_s": {"measured": always["publish_msgs_per_s"], "target": 10_000,
                                        "met": always["publish_msgs_per_s"] >= 10_000, "sync": "always",
                                        "measured_sync_2m": default["publish_msgs_per_s"],
                                        "met_sync_2m": default["publish_msgs_per_s"] >= 10_000},
        "put_64MiB_ge_half_local_copy": {"measured_ratio": ratio, "target": 0.5, "met": ratio >= 0.5},
    }
    print(f"{'measure':44} {'value':>12}")
    for k, v in res.items():
        print(f"{k:44} {v:12.1f}")
    for k, v in fsync_cost.items():
        print(f"{k + ' always/2m':44} {v:12.3f}")
    print(f"{'s3 put 64MiB / local copy':44} {ratio:12.2f}")
    for k, t in targets.items():
        print(f"{k:44} {'met' if t['met'] else 'MISSED'}")
    out = Path(__file__).parent / "results" / "bus.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"messages": N_MSGS, "one_at_a_time_messages": N_SINGLE, "rounds": ROUNDS,
                               "results": res, "sync_rounds": {m: sync[m]["rounds"] for m in SYNC_MODES},
                               "fsync_always_over_2m": fsync_cost, "targets": targets,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "machine": f"{os.cpu_count()} cores, shared with other jobs (load average "
                                          f"{os.getloadavg()[0]:.1f} at the end)"}, indent=2))


if __name__ == "__main__":
    main()

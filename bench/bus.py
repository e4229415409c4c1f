"""JetStream publish/consume rate for PromptTask-sized messages, and S3 put/get throughput.

Starts its own embedded stack on free ports. Targets (2-core machine): >= 10,000 prompt
messages/s published with acks; S3 put of 64 MiB objects >= 50% of a local-disk copy of the
same file, measured in the same run. Prints a table, writes bench/results/bus.json.
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
from shared.stack import EmbeddedStack, Ports
from shared.store import Store
from shared.topology import Subjects

N_MSGS = 50_000


async def bus_rates(url: str) -> dict[str, float]:
    bus = await Bus.connect(BusConfig(url=url), "bench")
    await bus.ensure_streams()
    run = "bench" + secrets.token_hex(3)
    subject = Subjects.prompts(run)
    text = "Explain the difference between weather and climate to a ten-year-old, with two examples."
    items = [(subject, PromptTask(run=run, prompt_id=f"{i:064x}", messages=[ChatMessage(role="user", content=text)]),
              f"{run}:{i}") for i in range(N_MSGS)]
    t0 = time.perf_counter()
    acks = await bus.publish_many(items, window=4000)
    pub = N_MSGS / (time.perf_counter() - t0)
    assert sum(1 for a in acks if not a.duplicate) == N_MSGS
    spec = consumer_for("generate", run, max_ack_pending=20_000)
    stop, stats = asyncio.Event(), WorkStats()

    async def handle(d):
        return None

    t0 = time.perf_counter()
    worker = asyncio.create_task(bus.work(spec, handle, run=run, stop=stop, message_type=PromptTask, stats=stats,
                                          max_inflight=1000, fetch_batch=500))
    while stats.acked < N_MSGS:
        await asyncio.sleep(0.01)
    consume = N_MSGS / (time.perf_counter() - t0)
    stop.set()
    await worker
    await bus.close()
    return {"publish_msgs_per_s": pub, "consume_msgs_per_s": consume, "payload_bytes": len(items[0][1].__struct_fields__)}


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
        stack = EmbeddedStack(Path(d) / "stack", Ports.free())
        stack.start()
        try:
            res = asyncio.run(bus_rates(stack.nats_url))
            store = Store(StoreConfig(endpoint=stack.s3_endpoint, bucket=stack.bucket),
                          os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
            res.update(s3_rates(store, Path(d)))
        finally:
            stack.stop()
    res.pop("payload_bytes", None)
    ratio = res["put_64MiB_MiB_per_s"] / res["local_copy_64MiB_MiB_per_s"]
    targets = {
        "publish_ge_10000_msgs_per_s": {"measured": res["publish_msgs_per_s"], "target": 10_000,
                                        "met": res["publish_msgs_per_s"] >= 10_000},
        "put_64MiB_ge_half_local_copy": {"measured_ratio": ratio, "target": 0.5, "met": ratio >= 0.5},
    }
    print(f"{'measure':32} {'value':>12}")
    for k, v in res.items():
        print(f"{k:32} {v:12.1f}")
    print(f"{'s3 put 64MiB / local copy':32} {ratio:12.2f}")
    for k, t in targets.items():
        print(f"{k:32} {'met' if t['met'] else 'MISSED'}")
    out = Path(__file__).parent / "results" / "bus.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"messages": N_MSGS, "results": res, "targets": targets,
                               "machine": f"{os.cpu_count()} cores"}, indent=2))


if __name__ == "__main__":
    main()

"""Feeder throughput and memory: 1,000,000 synthetic prompts (all four record shapes) from one JSONL file.

Runs `dfpipe feed` as a child process against an embedded stack of its own and reports
prompts/s and the child's peak RSS (from the kernel's rusage of the child). Targets: ≥ 5,000
prompts/s and peak RSS < 400 MB on these 2-core machines. Writes bench/results/feed.json.

`--compare-sync` instead feeds the same file under both JetStream fsync settings, alternated over two
rounds in one run ("always", the embedded default, and nats-server's own "2m"), and writes
bench/results/feed-sync.json: what fsync-always costs the feed. (BENCH_FEED_N sets the size.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import NATS_SYNC, ROOT, bench_stack, table, write_result

N = int(os.environ.get("BENCH_FEED_N", "1000000"))


def synthetic(path: Path, n: int) -> None:
    topics = ["rivers", "prime numbers", "bread", "volcanoes", "sorting", "jazz", "tides", "compilers"]
    with open(path, "w") as f:
        for i in range(n):
            t = topics[i % len(topics)]
            kind = i % 4
            if kind == 0:
                rec = {"messages": [{"role": "user", "content": f"Question {i}: explain {t} in two sentences."}]}
            elif kind == 1:
                rec = {"conversations": [{"from": "human", "value": f"Tell me one fact about {t} (#{i})."}]}
            elif kind == 2:
                rec = {"prompt": f"Write a haiku about {t}, variation {i}."}
            else:
                rec = {"instruction": f"Summarize what {t} are.", "input": f"Context number {i}."}
            f.write(json.dumps(rec) + "\n")


def feed_once(src: Path, nats_sync: str) -> tuple[float, float] | None:
    """(seconds, the feed's peak RSS in MB) for `dfpipe feed` of `src` into a fresh stack with this JetStream
    sync, or None if it failed."""
    with bench_stack(nats_sync=nats_sync) as stack:
        env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root)}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "feed", str(src), "--run", "benchfeed"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate()
        seconds = time.perf_counter() - t0
        # the feed is the only child that exited yet (the stack's servers are reaped when it stops)
        rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        if proc.returncode != 0:
            print(out.decode()[-3000:])
            return None
        print(out.decode().strip().splitlines()[0])
    return seconds, rss_mb


def compare_sync(src: Path) -> int:
    rounds: list[dict] = []
    for r in range(2):
        for mode in ("always", "2m"):
            fed = feed_once(src, mode)
            if fed is None:
                return 1
            seconds = fed[0]
            rounds.append({"round": r + 1, "nats_sync": mode, "seconds": round(seconds, 2),
                           "prompts_per_s": round(N / seconds, 1), "load_average_1m": round(os.getloadavg()[0], 2)})
            print(f"round {r + 1} sync {mode:6}: {N / seconds:,.0f} prompts/s")
    mean = {m: sum(x["prompts_per_s"] for x in rounds if x["nats_sync"] == m) / 2 for m in ("always", "2m")}
    rows = [("sync", "prompts/s (mean of 2 rounds)", "target", "met")] + [
        (m, f"{v:,.0f}", ">= 5,000", "yes" if v >= 5000 else "NO") for m, v in mean.items()]
    print(table(rows))
    print(f"always / 2m: {mean['always'] / mean['2m']:.2f}")
    path = write_result("feed-sync", {"prompts": N, "rounds": rounds, "mean_prompts_per_s": mean,
                                      "always_over_2m": round(mean["always"] / mean["2m"], 3),
                                      "target_prompts_per_s": 5000})
    print(f"-> {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare-sync", action="store_true", help="both JetStream fsync settings, alternated")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "prompts.jsonl"
        t0 = time.perf_counter()
        synthetic(src, N)
        print(f"wrote {N} prompts ({src.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f}s")
        if args.compare_sync:
            return compare_sync(src)
        fed = feed_once(src, NATS_SYNC)
        if fed is None:
            return 1
    seconds, rss_mb = fed
    rate = N / seconds
    rows = [("metric", "measured", "target", "met"),
            ("prompts/s (process start to exit)", f"{rate:,.0f}", ">= 5,000", "yes" if rate >= 5000 else "NO"),
            ("peak RSS MB", f"{rss_mb:.0f}", "< 400", "yes" if rss_mb < 400 else "NO")]
    print(table(rows))
    path = write_result("feed", {"prompts": N, "nats_sync": NATS_SYNC, "seconds": round(seconds, 2),
                                 "prompts_per_s": round(rate, 1),
                                 "peak_rss_mb": round(rss_mb, 1), "target_prompts_per_s": 5000,
                                 "target_peak_rss_mb": 400, "met": rate >= 5000 and rss_mb < 400})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Feeder throughput and memory: 1,000,000 synthetic prompts (all four record shapes) from one JSONL file.

Runs `dfpipe feed` as a child process against an embedded stack of its own and reports
prompts/s and the child's peak RSS (from the kernel's rusage of the child). Targets: ≥ 5,000
prompts/s and peak RSS < 400 MB on these 2-core machines. Writes bench/results/feed.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, bench_stack, table, write_result

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


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp, bench_stack() as stack:
        src = Path(tmp) / "prompts.jsonl"
        t0 = time.perf_counter()
        synthetic(src, N)
        print(f"wrote {N} prompts ({src.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f}s")
        env = {**os.environ, **stack.env(), "DFLASH_DATA_DIR": str(stack.root)}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "feed", str(src), "--run", "benchfeed"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = proc.communicate()
        seconds = time.perf_counter() - t0
        rusage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the feed is the only child that exited
        if proc.returncode != 0:
            print(out.decode()[-3000:])
            return 1
        print(out.decode().strip().splitlines()[0])
    rate = N / seconds
    rss_mb = rusage.ru_maxrss / 1024
    rows = [("metric", "measured", "target", "met"),
            ("prompts/s (process start to exit)", f"{rate:,.0f}", ">= 5,000", "yes" if rate >= 5000 else "NO"),
            ("peak RSS MB", f"{rss_mb:.0f}", "< 400", "yes" if rss_mb < 400 else "NO")]
    print(table(rows))
    path = write_result("feed", {"prompts": N, "seconds": round(seconds, 2), "prompts_per_s": round(rate, 1),
                                 "peak_rss_mb": round(rss_mb, 1), "target_prompts_per_s": 5000,
                                 "target_peak_rss_mb": 400, "met": rate >= 5000 and rss_mb < 400})
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CI-sized fleet (bench/fleet.py's path): 4 generator processes on 4 simulated engines, one engine restart,
1% 5xx, a kill -9 of a generator mid-run — every prompt completes exactly once (duplicates only on read)."""

from __future__ import annotations

import pytest

from bench.fleet import fleet


@pytest.mark.stack
async def test_fleet_ci_sized_exactly_once_through_faults(tmp_path) -> None:
    r = await fleet(240, 0.5, tmp_path, True, profile="test-batch", shard_records=16)
    print({k: r[k] for k in ("wall_s", "mean_fill_vs_peak", "fill_vs_peak", "simulated_days", "plan_days",
                             "generator_cpu_s_per_1000_completions", "generator_peak_rss_mb_per_engine", "events")})
    assert r["exactly_once"] and r["unique_completions"] == 240
    assert r["restarts"] == [1, 0, 0, 0] and any("killed -9" in e for e in r["events"])
    assert sum(f.get("error", 0) for f in r["faults"]) > 0  # the 1% 5xx happened and were retried
    assert all(t == 0 for t in r["tokens_for_nobody"])

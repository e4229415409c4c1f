"""`dfpipe calibrate` (issue 31 §4): against the batching-engine simulator (bench/engine_sim.py) the knee it reports
is within 10% of the profile's true best concurrency, `dfpipe plan` states the 914,000-prompt ETA the simulator's
arithmetic gives, and a generator starts at the measured level; on CPU with the `hf` backend; layouts compared
on the same GPUs (the launcher replaced by simulated engines, one per group: SGLang cannot run here)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from services.generator.backends.sglang import SGLangBackend
from services.generator.calibrate import (
    LayoutSpec,
    Sweep,
    compare_layouts,
    describe,
    parse_layouts,
    recommend,
    starting_config,
)
from services.pipeline.run import BUNDLED_PROMPTS
from shared.calibration import Calibration, EngineCalibration, Lengths, Level, knee_of, load_calibration
from shared.gpus import LayoutError
from shared.store import Store
from shared.topology import Keys
from tests.conftest import make_config, new_run


def _level(c: int, tps: float) -> Level:
    return Level(concurrency=c, requests=3 * c, tokens_per_s=tps, latency_mean_s=1.0, latency_p50_s=1.0,
                 latency_p90_s=1.5)


def _engine(name: str, peak: float, mean_tokens: float, requests: int = 100) -> EngineCalibration:
    lv = _level(64, peak)
    return EngineCalibration(engine=name, levels=[lv], peak_tokens_per_s=peak, best_concurrency=64, knee=64,
                             latency_s=lv, completion_tokens=Lengths(mean=mean_tokens, p10=1, p50=1, p90=1, max=1),
                             truncation_rate=0.0, requests=requests)


def test_knee_layouts_and_the_eta_arithmetic() -> None:
    levels = [_level(c, t) for c, t in [(8, 300.0), (16, 560.0), (32, 900.0), (48, 960.0), (64, 1000.0), (128, 990.0)]]
    assert knee_of(levels) == (1000.0, 64, 48)  # 960 ≥ 0.95 × 1000; 900 is not
    assert parse_layouts("tp1, tp2+mtp") == [LayoutSpec("tp1", 1, False), LayoutSpec("tp2+mtp", 2, True)]
    for bad in ("tp0", "tp2+eagle", "2", ""):
        with pytest.raises(LayoutError):
            parse_layouts(bad)
    c = Calibration(run="r", backend="sglang", max_new_tokens=4096, prompts_sampled=300,
                    engines=[_engine("a", 1000.0, 2000.0), _engine("b", 1200.0, 2000.0)])
    # prompts × mean completion tokens ÷ (tokens/s per engine × engines)
    assert c.eta_s(914_000) == pytest.approx(914_000 * 2000 / (1100.0 * 2))
    assert c.eta_s(914_000, engines=4) == pytest.approx(914_000 * 2000 / (1100.0 * 4))
    assert "914,000 prompts × 2,000 tokens" in describe(c, 914_000) and c.engine("b/").peak_tokens_per_s == 1200.0


# The stand-in engine (64 slots, a step of 50 ms + 0.25 ms per running request) with no time compression,
# so the simulator keeps real time on a busy 2-core machine, and answers long enough (~40 tokens, ~2.6 s at 64
# running) that the client's turnaround between two requests of a slot stays a small share of a request.
def _profile(name: str = "calibrate", **over: object):
    from bench.engine_sim import PROFILES

    base = dict(name=name, mean_tokens=40, sigma=0.3, max_new_tokens=100, compression=1.0)
    return dataclasses.replace(PROFILES["test-batch"], **{**base, **over})


def _true_best(p) -> tuple[int, float]:
    """The profile's best concurrency and its tokens/s (real seconds): every slot full, t2 = 0 in this profile."""
    n = p.max_running_requests
    return n, n / (p.t0_s + p.t1_s * n) * p.compression


@pytest.mark.stack
def test_calibrate_finds_the_simulated_engines_knee_and_plan_states_the_jobs_eta(stack, stack_env,
                                                                                  tmp_path: Path) -> None:
    from bench.engine_sim import EngineSim

    run = new_run()
    profile = _profile()
    best, peak = _true_best(profile)
    with EngineSim(profile) as sim:
        out = subprocess.run(
            [sys.executable, "-m", "shared.cli", "calibrate", "--run", run, "--prompts", str(BUNDLED_PROMPTS),
             "--sample", "100", "--backend", "sglang", "--engine-urls", sim.url, "--start", "16",
             "--max-concurrency", "128", "--json", str(tmp_path / "c.json")],
            env={**stack_env, "DFLASH_SAMPLING__MAX_NEW_TOKENS": "100"}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        sim_stats = sim.stats()
    cfg = make_config(stack, run, generator={"backend": "sglang", "engine_url": sim.url})
    stored = load_calibration(Store.open(cfg), run)
    assert stored is not None and stored.engines[0].engine == sim.url
    e = stored.engines[0]
    assert abs(e.knee - best) <= 0.10 * best, describe(stored)  # the knee within 10% of the true best concurrency
    assert {16, 32, 64, 128} <= {lv.concurrency for lv in e.levels}, describe(stored)  # doubled, then bisected
    assert 0 < e.peak_tokens_per_s <= peak * 1.10, (e.peak_tokens_per_s, peak)
    assert e.truncation_rate < 0.05 and e.completion_tokens.max <= 100
    assert f"knee {e.knee}" in out.stdout and Keys.calibration(run) in out.stdout
    # the planner: 914,000 prompts × the measured mean ÷ (measured tokens/s × engines), beside storage and training
    plan = subprocess.run([sys.executable, "-m", "shared.cli", "plan", "--calibration", run, "--samples", "914000"],
                          env=stack_env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    days = float(re.search(r"= ([\d.,]+) days", plan.stdout).group(1).replace(",", ""))
    assert days == pytest.approx(stored.eta_s(914_000) / 86400, abs=0.006)
    simulated_mean = sim_stats.tokens_generated / sim_stats.requests_finished
    arithmetic = 914_000 * simulated_mean / peak / 86400  # the simulator's own: its mean length at its peak rate
    assert days == pytest.approx(arithmetic, rel=0.10), (days, arithmetic, describe(stored))
    assert "offline hidden states" in plan.stdout and "1 engine(s)" in plan.stdout
    # a generator of this run, on this engine, starts at the measured level
    assert starting_config(cfg).generator.fallback_inflight == e.best_concurrency
    other = make_config(stack, run, generator={"backend": "sglang", "engine_url": "http://127.0.0.1:1"})
    assert starting_config(other).generator.fallback_inflight == other.generator.fallback_inflight  # not measured: as set


@pytest.mark.stack
def test_calibrate_on_cpu_with_the_hf_backend(stack, stack_env, tmp_path: Path) -> None:
    run = new_run()
    out = subprocess.run(
        [sys.executable, "-m", "shared.cli", "calibrate", "--run", run, "--prompts", str(BUNDLED_PROMPTS),
         "--sample", "8", "--backend", "hf", "--max-concurrency", "4"],
        env={**stack_env, "DFLASH_MODEL__DEVICE": "cpu", "DFLASH_SAMPLING__MAX_NEW_TOKENS": "8",
             "DFLASH_GENERATOR__BATCH_SIZE": "4"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    stored = load_calibration(Store.open(make_config(stack, run)), run)
    assert stored is not None and stored.backend == "hf"
    e = stored.engines[0]
    assert e.engine.startswith("hf:") and {1, 2, 4} <= {lv.concurrency for lv in e.levels}
    assert e.peak_tokens_per_s > 0 and 1 <= e.completion_tokens.max <= 8 and 0 <= e.truncation_rate <= 1
    assert e.truncation_rate > 0  # SmolLM2's answers run past 8 tokens: the cut share is reported, not hidden
    assert "truncated at max_new_tokens 8" in out.stdout


@pytest.mark.stack
def test_launch_compares_layouts_on_the_same_gpus_and_says_which_to_run(stack, stack_env) -> None:
    """tp1 ×2 on a model whose weights leave each GPU a small KV pool (the batch caps near 9) against tp2 ×1,
    whose pooled memory holds ~5x the KV and whose steps read half the weights per GPU."""
    from bench.engine_sim import EngineSim

    profiles = {1: _profile("tp1", mean_tokens=20, max_total_num_tokens=800),
                2: _profile("tp2", mean_tokens=20, max_total_num_tokens=4400, t0_s=0.03)}
    launched: list[tuple[str, str]] = []
    cfg = make_config(stack, generator={"backend": "sglang", "max_inflight": 64}, sampling={"max_new_tokens": 100})

    async def launcher(cfg, layout: LayoutSpec, group, index: int):
        sim = EngineSim(profiles[layout.tp]).start()
        launched.append((layout.name, group.visible_devices))
        gen = msgspec.structs.replace(cfg.generator, engine_url=sim.url)
        backend = SGLangBackend(msgspec.structs.replace(cfg, generator=gen), gpus=group)
        await backend.start()
        close = backend.close

        async def close_both() -> None:
            await close()
            sim.stop()

        backend.close = close_both
        return backend

    from services.generator.calibrate import sample_prompts

    prompts, _ = sample_prompts([str(BUNDLED_PROMPTS)], cfg, 60)
    results = asyncio.run(compare_layouts(cfg, "0,1", parse_layouts("tp1,tp2"), prompts,
                                          Sweep(start=16, max_concurrency=64), launcher, say=lambda _: None))
    assert launched == [("tp1", "0"), ("tp1", "1"), ("tp2", "0,1")]
    tp1, tp2 = results
    assert len(tp1.engines) == 2 and len(tp2.engines) == 1 and tp1.gpus == tp2.gpus == [0, 1]
    assert recommend(results).name == "tp2", [r.tokens_per_s for r in results]
    assert tp2.tokens_per_s > 1.3 * tp1.tokens_per_s  # (measured 1.30x with pools of 1,100 under load 20: widened)

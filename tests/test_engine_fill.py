"""The generator keeps a batching engine full by itself, against the simulator (bench/engine_sim.py).

Stack tier: a real NATS + S3, the SmolLM2 tokenizer, the simulator as a subprocess (its own GIL, as an engine).
Fill is measured in the engine's simulated time over the steady state (without the first and last 5% of the
requests) and compared with the peak the same engine gives a perfect client at its best fixed concurrency
(`model_peak`: the engine alone, no HTTP).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from bench.engine_sim import EngineSimProcess, model_peak
from services.feeder.feed import Feeder
from services.generator.engine_fill import EngineLoad, FillController, RequestTimeout, parse_prometheus
from services.generator.service import run_generator
from shared.bus import Bus
from shared.config import Config
from shared.messages import GeneratorProgress, PromptTask, ShardWritten
from shared.records import read_completions
from shared.store import Store
from shared.topology import Subjects
from tests.conftest import make_config

FLOOR = 0.85  # of the engine-alone peak (see the first test)
COMPRESSION = 0.5  # simulated s per real s: the generator shares 2 cores with everything here
GEN = {"backend": "sglang", "shard_records": 64, "shard_seconds": 2.0, "ack_wait_s": 30.0, "max_deliver": 5,
       "drain_s": 10.0, "progress_every_s": 1.0, "engine_poll_s": 0.25, "engine_ready_s": 10.0}


def prompts(tmp_path: Path, n: int, tag: str) -> Path:
    path = tmp_path / f"prompts-{tag}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Tell me about item {i} of {tag}."}) + "\n" for i in range(n)))
    return path


async def generate_all(cfg: Config, bus: Bus, store: Store, src: Path, *, midway=None, timeout_s: float = 180):
    """Feed `src`, run one generator until every prompt is in a shard; (prompt ids fed, shard records, progress)."""
    await Feeder(cfg, bus, store).feed([str(src)])
    fed = {t.prompt_id async for _, t in bus.read_log("PROMPTS", Subjects.prompts(cfg.run), 1, PromptTask)}
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
    done: set[str] = set()
    called = False
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while done != fed:
        assert loop.time() < end, f"{len(done)}/{len(fed)} completed after {timeout_s}s"
        await asyncio.sleep(0.5)
        done = {p async for p in _completed(bus, cfg.run)}
        if midway and not called and len(done) >= len(fed) // 3:
            called = True
            await asyncio.to_thread(midway)
    stop.set()
    stats = await asyncio.wait_for(worker, 60)
    events = [e async for _, e in bus.read_log("SHARDS", Subjects.shards(cfg.run), 1, ShardWritten)]
    records = [r for e in events for r in read_completions(store.get_bytes(e.key))]
    progress = [p async for _, p in bus.read_log("PROGRESS", Subjects.progress(cfg.run, "generate", "w0"), 1,
                                               GeneratorProgress)]
    return fed, records, progress, stats


async def _completed(bus: Bus, run: str):
    async for _, e in bus.read_log("SHARDS", Subjects.shards(run), 1, ShardWritten):
        for p in e.prompt_ids:
            yield p


def peak_tokens_per_s(profile: str, max_new: int, records: list | None = None, mean: float | None = None) -> float:
    """The engine alone at its best fixed concurrency, for prompts as long as the run's own."""
    from dataclasses import replace

    from bench.engine_sim import PROFILES

    p = PROFILES[profile] if mean is None else replace(PROFILES[profile], mean_tokens=mean)
    prompt_len = round(sum(r.prompt_tokens for r in records) / len(records)) if records else 60
    return max(v["tokens_per_s"] for v in model_peak(p, [16, 24, 32, 48, 64, 96, 128], max_new_tokens=max_new,
                                                     prompt_len=prompt_len).values())


async def test_generator_alone_keeps_a_kv_capped_engine_at_its_peak_as_lengths_change(stack, bus, store, tmp_path,
                                                                                    target_dir):
    """No hand-set concurrency, on a profile whose KV pool (not its 64 slots) caps the batch, short answers first
    and long ones later: the batch the pool allows shrinks; the generator keeps the engine's queue non-empty, so
    the long phase runs at the engine's peak for those lengths; exactly once; progress says how full it is."""
    with EngineSimProcess("test-kv", enable_metrics=True, compression=COMPRESSION) as sim:
        sim.set_mean_tokens(25)
        cfg = make_config(stack, generator={**GEN, "engine_url": sim.url},
                          sampling={"max_new_tokens": 160, "temperature": 0.0})
        since = {}

        def lengthen() -> None:
            since["n"] = sim.stats().requests_finished
            sim.set_mean_tokens(90)

        fed, records, progress, _ = await generate_all(cfg, bus, store, prompts(tmp_path, 200, "mid"),
                                                       midway=lengthen)
        late = sim.stats(since=since["n"] + 20)  # the long phase, once the switch has worked through
    assert sorted(r.prompt_id for r in records) == sorted(fed)  # exactly once
    peak = await asyncio.to_thread(peak_tokens_per_s, "test-kv", 160, records, 90)
    got = late.steady["tokens_per_s"]
    # The target is 0.95 (bench/engine_fill.py); here the peak is the engine alone with a perfect client and the
    # generator shares two cores with everything else CI runs, so the test holds it to FLOOR and prints the figure.
    print(f"test-kv long phase: {got:.0f} tok/s of a {peak:.0f} peak ({got / peak:.3f})")
    assert got >= FLOOR * peak, (late.steady, peak)
    assert late.requests_retracted > 0 or late.peak_running < 64  # the pool, not the slots, capped it
    last = [p for p in progress if p.engine_running is not None][-1]
    assert last.engine == sim.url and last.engine_max_running == 64 and last.concurrency >= 16
    assert late.tokens_for_nobody == 0


async def test_openai_backend_fills_from_vllm_metrics_and_from_throughput(stack, bus, store, tmp_path, target_dir):
    """vLLM's /metrics (running/waiting, no max; the slot-capped test-batch profile) and a server with none: both
    climb well past the old 16; the vLLM one to the engine's peak."""
    for flavor in ("vllm", "openai"):
        with EngineSimProcess("test-batch", flavor=flavor, enable_metrics=False, compression=COMPRESSION) as sim:
            cfg = make_config(stack, generator={**GEN, "backend": "openai", "engine_url": sim.url,
                                                "openai_endpoint": "chat"},
                              sampling={"max_new_tokens": 160, "temperature": 0.0})
            fed, records, progress, _ = await generate_all(cfg, bus, store, prompts(tmp_path, 140 if flavor == "vllm" else 100, flavor))
            engine = sim.stats()
        assert sorted(r.prompt_id for r in records) == sorted(fed)
        # vLLM's counts: straight past the old 16 (a slow start); no counts: windows of >= 5 s, a quarter more each
        # (no counts: a slow start, doubling per window of >= 5 s while tokens/s rise)
        assert max(p.concurrency for p in progress) >= (48 if flavor == "vllm" else 32), [p.concurrency for p in progress]
        peak = await asyncio.to_thread(peak_tokens_per_s, "test-batch", 160)  # chat: the simulator counts chars/4
        # vLLM: no batch limit to start from, a slow start. No metrics: throughput windows of >= 5 s, doubling
        # while tokens/s rise — on 100 prompts it gets past what a fixed 16 gives (0.32 of this peak,
        # bench/engine_fill.py) but not near 0.95 (measured 0.46): the climb takes windows a short run does not
        # have; over 800 prompts it reaches 0.96 (bench/engine_fill.py --no-metrics 800).
        floor = 0.75 if flavor == "vllm" else 0.33
        print(f"openai/{flavor}: {engine.steady['tokens_per_s']:.0f} tok/s of a {peak:.0f} peak")
        assert engine.steady["tokens_per_s"] >= floor * peak, (flavor, engine.steady, peak)


async def test_bad_engine_answers_are_named_retried_and_nothing_is_lost(stack, bus, store, tmp_path, target_dir,
                                                                      caplog):
    """Garbage /generate answers, 5xx, dropped connections, a /get_server_info without its fields and a /metrics
    that is missing: named in the log with the URL, the level falls back to the safe fixed one and climbs on
    throughput; every prompt completes exactly once."""
    extra = ["--garbage-rate", "0.05", "--error-rate", "0.05", "--drop-rate", "0.03", "--server-info", "missing"]
    with EngineSimProcess("test-batch", enable_metrics=False, extra=extra) as sim:
        cfg = make_config(stack, generator={**GEN, "engine_url": sim.url, "max_deliver": 10},
                          sampling={"max_new_tokens": 160, "temperature": 0.0})
        with caplog.at_level(logging.WARNING):
            fed, records, progress, stats = await generate_all(cfg, bus, store, prompts(tmp_path, 200, "bad"))
        injected = sim.stats().faults_injected
    assert sorted(r.prompt_id for r in records) == sorted(fed)
    assert stats.dead_lettered == 0 and stats.retried >= injected.get("garbage", 0) > 0
    text = caplog.text
    assert f"engine at {sim.url}: /get_server_info has neither" in text
    assert f"engine at {sim.url}: /metrics answered HTTP 404" in text
    assert f"engine at {sim.url}: unexpected /generate response" in text or "unexpected /generate" in text
    assert progress[0].concurrency == 16  # the safe fixed level first


async def test_an_engine_that_never_becomes_healthy_is_named(stack, tmp_path, target_dir):
    with EngineSimProcess("test-small", extra=["--never-healthy"]) as sim:
        cfg = make_config(stack, generator={**GEN, "engine_url": sim.url, "engine_ready_s": 2.0})
        with pytest.raises(Exception, match=rf"engine at {sim.url}/health_generate not ready after 2s \(HTTP 503\)"):
            await asyncio.wait_for(run_generator(cfg, "w0", stop=asyncio.Event()), 60)


async def test_requests_given_up_are_aborted_on_the_engine(stack, bus, store, tmp_path, target_dir):
    """Hung requests overrun the request timeout: the generator aborts them on the engine (none keeps decoding
    for nobody: the simulator here does not abort on disconnect), retries them, and loses nothing."""
    extra = ["--hang-rate", "0.1", "--no-abort-on-disconnect"]
    with EngineSimProcess("test-batch", enable_metrics=True, extra=extra) as sim:
        cfg = make_config(stack, generator={**GEN, "engine_url": sim.url, "request_timeout_s": 3.0},
                          sampling={"max_new_tokens": 160, "temperature": 0.0})
        fed, records, _, stats = await generate_all(cfg, bus, store, prompts(tmp_path, 100, "hang"))
        engine = sim.stats()
    assert sorted(r.prompt_id for r in records) == sorted(fed)
    assert engine.faults_injected["hang"] > 0 and stats.retried >= engine.faults_injected["hang"]
    assert engine.requests_aborted >= engine.faults_injected["hang"] or engine.tokens_for_nobody == 0


def test_controller_rules() -> None:
    """The level's rules, alone: limit + queue to start; raise while the engine's queue is short and our level
    binds; shrink by half the excess queue; never past the bound; throughput climbing holds at the best."""
    c = FillController(upper=1024, fallback=16)
    assert c.level == 16
    c.on_limit(64)
    assert c.level == 64 + 16
    c.on_load(EngineLoad(running=25, queued=56), in_flight=81)  # KV-capped: a long queue → running + want
    assert c.level == 25 + 16
    c.on_load(EngineLoad(running=40, queued=0), in_flight=c.level)  # short queue, our level binds: +1/4
    assert c.level == 41 + 11  # (the engine had queued before: past the slow start)
    small = FillController(upper=20, fallback=16)
    small.on_load(EngineLoad(running=16, queued=0), in_flight=16)  # slow start: doubles, capped by the bound
    assert small.level == 20
    fresh = FillController(upper=1024, fallback=16)
    fresh.on_load(EngineLoad(running=14, queued=0), in_flight=15)
    assert fresh.level == 32
    t = FillController(upper=1024, fallback=16)
    t.on_window(100.0)
    assert t.level == 32  # a slow start: double while tokens/s rise
    t.on_window(200.0)
    assert t.level == 64
    t.on_window(201.0)  # no gain: back to the best level, held; the slow start is over
    assert t.level == 32 and t.hold_windows == 6 and not t.slow_start
    for _ in range(6):
        t.on_window(0.0)  # held (the last one re-measures from scratch)
    t.on_window(200.0)
    assert t.level == 41  # a quarter more at a time now
    fixed = FillController(upper=8, fallback=16, fixed=True)
    fixed.on_limit(256)
    assert fixed.level == 8
    assert parse_prometheus('a{x="1"} 2\na{x="2"} 3\n# HELP a\nb 1.5\n', {"a", "b"}) == {"a": 5.0, "b": 1.5}
    rt = RequestTimeout(4096)
    assert rt.seconds == 1800.0
    for _ in range(10):
        rt.add(latency_s=20.0, tokens=1000)
    assert rt.seconds == pytest.approx(3 * 4096 * 0.02)
    for _ in range(300):  # short answers that queued say nothing of the token rate (before: 3 × 4096 × 60 s)
        rt.add(latency_s=60.0, tokens=1)
    assert rt.seconds == pytest.approx(3 * 4096 * 0.02)
    rt.add(latency_s=4000.0, tokens=100)  # a slow engine: long, but bounded
    assert rt.seconds == rt.ceiling_s == 6 * 3600.0


async def test_fill_bench_ends_when_a_prompt_is_dead_lettered(stack, target_dir):
    """bench/engine_fill.py's run waited for n completed prompts and only then stopped its generator; a prompt
    dead-lettered (acked, never in a shard) left it waiting for ever beside an idle generator, every prompt
    acked — the rtxpro6000-27b hang. Here 5xx answers with max_deliver 1 dead-letter some prompts: the run
    ends once every prompt has an outcome, stops its generator, and reports the dead letters."""
    from bench.engine_fill import one_run

    n = 40
    got = await asyncio.wait_for(one_run(stack, "deadfill", "test-batch", 4.0, n, 160, {"max_deliver": 1, "drain_s": 5.0},
                                         sim_extra=["--error-rate", "0.2"], wait_s=120), 60)
    assert got["dead_lettered"] > 0 and got["all_outcomes"] and got["returned"], got
    assert got["unique"] == got["completions"] == n - got["dead_lettered"], got

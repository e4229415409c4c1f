"""The batching-engine simulator (bench/engine_sim.py): its API shapes, its batching, its faults.

Stack tier: each test serves the simulator on a free port (a real HTTP server, real sockets).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.engine_sim import PROFILES, EngineSim, EngineSimProcess, steady_state

pytestmark = pytest.mark.stack


async def drive(url: str, concurrency: int, n: int, max_new: int = 160, prompt_len: int = 60) -> list[dict]:
    """n /generate requests, `concurrency` at a time; the answers."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        async def one(i: int) -> dict:
            async with sem:
                r = await client.post("/generate", json={"input_ids": [7 + i % 50] * prompt_len, "rid": f"p{i}",
                                                         "sampling_params": {"max_new_tokens": max_new}})
                r.raise_for_status()
                return r.json()

        return await asyncio.gather(*(one(i) for i in range(n)))


async def test_api_shapes_as_sglang_serves_them() -> None:
    with EngineSim("test-small", enable_metrics=True) as sim:
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as c:
            assert (await c.get("/health_generate")).status_code == 200
            info = (await c.get("/get_server_info")).json()
            assert info["max_running_requests"] is None  # not set at launch
            assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 16
            assert "last_gen_throughput" in info["internal_states"][0]
            out = (await c.post("/generate", json={"input_ids": [5] * 10, "rid": "a",
                                                   "sampling_params": {"max_new_tokens": 200}})).json()
            meta = out["meta_info"]
            assert meta["finish_reason"]["type"] == "stop" and out["output_ids"][-1] == 2  # the stop id kept
            assert meta["completion_tokens"] == len(out["output_ids"]) and meta["prompt_tokens"] == 10
            short = (await c.post("/generate", json={"input_ids": [5] * 10, "rid": "b",
                                                     "sampling_params": {"max_new_tokens": 3}})).json()
            assert short["meta_info"]["finish_reason"]["type"] == "length" and len(short["output_ids"]) == 3
            loads = (await c.get("/v1/loads")).json()["loads"][0]
            assert {"num_running_reqs", "num_waiting_reqs", "max_running_requests", "max_total_num_tokens",
                    "token_usage"} <= set(loads)
            metrics = (await c.get("/metrics")).text
            for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                         "sglang:token_usage"):
                assert f"\n{name}{{" in "\n" + metrics
            chat = (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 50})).json()
            assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] > 0
            bad = await c.post("/generate", json={"input_ids": []})
            assert bad.status_code == 400 and "input_ids" in bad.text
    with EngineSim("test-small") as sim:  # metrics only with --enable-metrics, as SGLang
        assert httpx.get(sim.url + "/metrics").status_code == 404
    with EngineSim("test-small", flavor="vllm") as sim:  # vLLM: /metrics always, no SGLang endpoints
        text = httpx.get(sim.url + "/metrics").text
        assert "vllm:num_requests_running" in text and "vllm:num_requests_waiting" in text
        assert httpx.get(sim.url + "/get_server_info").status_code == 404


async def test_batching_fill_follows_concurrency_and_kv_pool_caps_it() -> None:
    """A fixed 4 in flight fills a 16-slot engine to ~1/4, 16 fill it; the KV-capped profile retracts and holds
    fewer than its max_running_requests however many are sent."""
    results = {}
    for conc in (4, 16):
        with EngineSim("test-small", compression=8) as sim:
            await drive(sim.url, conc, 64, max_new=120, prompt_len=40)
            results[conc] = steady_state(sim.stats())
    assert 0.2 < results[4]["fill"] < 0.3 and results[16]["fill"] > 0.7  # the client shares this CPU (and GIL)
    assert results[16]["tokens_per_s"] > 2.5 * results[4]["tokens_per_s"]
    with EngineSim("test-kv", compression=10) as sim:
        await drive(sim.url, 64, 150)
        stats = sim.stats()
    assert stats.requests_retracted > 0 and stats.peak_running < 64 and steady_state(stats)["mean_running"] < 32


async def test_lengths_are_per_prompt_and_capped() -> None:
    with EngineSim("test-small", compression=100) as sim:
        a = await drive(sim.url, 8, 40, max_new=1000)
        b = await drive(sim.url, 8, 40, max_new=1000)
        assert [x["meta_info"]["completion_tokens"] for x in a] == [x["meta_info"]["completion_tokens"] for x in b]
        lengths = [x["meta_info"]["completion_tokens"] for x in a]
        assert 25 < sum(lengths) / len(lengths) < 60 and len(set(lengths)) > 5
        capped = await drive(sim.url, 8, 40, max_new=30)
        assert any(x["meta_info"]["finish_reason"]["type"] == "length" for x in capped)
        assert max(x["meta_info"]["completion_tokens"] for x in capped) == 30


async def test_faults_errors_drops_hangs_abort_and_restart() -> None:
    with EngineSim("test-small") as sim:
        url = sim.url
        sim.set_faults(error_rate=1.0)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/generate", json={"input_ids": [1, 2], "rid": "e"})
            assert r.status_code == 500
            sim.set_faults(error_rate=0.0, drop_rate=1.0)
            with pytest.raises(httpx.TransportError):
                await c.post("/generate", json={"input_ids": [1, 2], "rid": "d"})
            sim.set_faults(drop_rate=0.0, hang_rate=1.0)
            hung = asyncio.create_task(c.post("/generate", json={"input_ids": [1, 2], "rid": "h"}))
            await asyncio.sleep(0.5)
            assert not hung.done()
            assert (await c.post("/abort_request", json={"rid": "h"})).json()["aborted"] == 1
            assert (await hung).json()["meta_info"]["finish_reason"]["type"] == "abort"
            sim.set_faults(hang_rate=0.0, never_healthy=True)
            assert (await c.get("/health_generate")).status_code == 503
            sim.set_faults(never_healthy=False)
        # a restart loses the running requests: their connections reset; then the engine serves again
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            running = [asyncio.create_task(c.post("/generate", json={"input_ids": [3] * 5, "rid": f"r{i}",
                                                                      "sampling_params": {"max_new_tokens": 120}}))
                       for i in range(4)]
            await asyncio.sleep(0.3)
            lost = await asyncio.to_thread(sim.restart, 0.5)
            assert lost == 4
            for t in running:
                with pytest.raises(httpx.TransportError):
                    await t
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            r = await c.post("/generate", json={"input_ids": [3] * 5, "rid": "after"})
            assert r.status_code == 200
        stats = sim.stats()
        assert stats.restarts == 1 and stats.faults_injected["error"] == 1 and stats.faults_injected["hang"] == 1


async def test_a_client_that_goes_away_leaves_the_engine_decoding_unless_aborted() -> None:
    with EngineSim("test-small", faults=None) as sim:
        sim.set_faults(abort_on_disconnect=False)
        async with httpx.AsyncClient(base_url=sim.url, timeout=0.05) as c:
            with pytest.raises(httpx.TimeoutException):
                await c.post("/generate", json={"input_ids": [1] * 5, "rid": "gone",
                                                "sampling_params": {"max_new_tokens": 120}})
        time.sleep(0.5)
        assert sim.stats().tokens_for_nobody > 0


def test_subprocess_handle_serves_the_same_api() -> None:
    with EngineSimProcess("test-small", enable_metrics=True) as sim:
        asyncio.run(drive(sim.url, 8, 30, max_new=100))
        stats = sim.stats()
        assert stats.requests_finished == 30 and stats.profile == "test-small"
        assert stats.max_running_requests == PROFILES["test-small"].max_running_requests

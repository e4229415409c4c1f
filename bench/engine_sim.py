"""A batching-engine simulator: an HTTP server that behaves like one SGLang (or vLLM) engine on one GPU.

A test and bench tool, never a backend a user picks. It serves what the generator meets:

- SGLang's native API (the shapes read from SGLang 0.5.x: `python/sglang/srt/entrypoints/http_server.py`,
  the `/get_server_info` sample in `docs/basic_usage/native_api` — every launch argument at the top level,
  `max_running_requests: null` unless set, `internal_states[]` one per DP rank with
  `effective_max_running_requests_per_dp`, `last_gen_throughput`, `memory_usage.token_capacity`):
  `POST /generate` (input_ids, sampling_params, rid → text, output_ids, meta_info{finish_reason{type},
  prompt_tokens, completion_tokens}), `GET /health_generate`, `GET /get_server_info`, `GET /v1/loads`
  (0.5.21+: `{"loads": [{dp_rank, num_running_reqs, num_waiting_reqs, max_running_requests,
  max_total_num_tokens, token_usage}]}`), `GET /metrics` only with `--enable-metrics`
  (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:gen_throughput`, `sglang:token_usage`),
  `POST /abort_request` (`{"rid": ..., "abort_all": false}`; the request ends with finish_reason abort).
- The OpenAI API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) and, with `flavor="vllm"`, vLLM's
  always-on `/metrics` (`vllm:num_requests_running`, `vllm:num_requests_waiting`; vLLM exposes no
  `max_num_seqs` there) and no SGLang-only endpoints.

Continuous batching in simulated time (module `BatchEngine`): at most `max_running_requests` decode together;
a KV pool of `max_total_num_tokens` admits a request only while its prompt + generated tokens + a reserve fit,
and when decoding fills it, running requests are retracted to the queue head (the one with the fewest generated
tokens first, as SGLang's `retract_decode` does) and re-prefilled later. A decode step takes
`t0 + t1 × running + t2 × tokens held`, prefill `tp × prompt tokens`. Completion lengths are lognormal around
a mean, capped by `max_new_tokens` (→ finish_reason `length`), drawn from the prompt's ids (a retried prompt
gets the same length). The engine jumps from event to event (the next finish, a full pool, or a real-time
quantum) in closed form, and sleeps `simulated / compression` real seconds (each profile states its factor and why). Idle time counts (real idle × compression); the simulator's own lag behind real time does not.

Faults on demand: a rate of 5xx answers, of connections dropped mid-request, of hung requests (never answered
until aborted), of garbage 200s; `/get_server_info` without fields; a missing or slow `/metrics`; an engine
that never becomes healthy; `restart()` loses every running and queued request (their connections reset) and
refuses connections for a while.

Python API: `EngineSim(profile, port=0, ...)` → `.start()` (own thread and loop) / `.stop()`, `.url`,
`.stats()` (`SimStats`), `.restart()`, `.set_faults(...)`, `.set_mean_tokens(n)`; `EngineSimProcess` runs the
same as a subprocess (`python -m bench.engine_sim --profile NAME --port N`) and reads the same stats over
`GET /sim/stats`. `steady_state(stats)` gives tokens/s and mean running over the steady state (without the
first and last 5% of finished requests), in simulated time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from array import array
from bisect import bisect_left
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shared.exits import Exit

# --- profiles ---------------------------------------------------------------------------------------------------
#
# Step-time constants from memory bandwidth (a decode step reads the weights once and every running request's KV):
#   t0 = weight bytes ÷ effective bandwidth + ~2 ms fixed per-step overhead (scheduler, sampling, CUDA graph launch)
#   t2 = KV bytes per token ÷ effective bandwidth;  t1 = per-request sampling/bookkeeping (~30-50 µs)
# Effective bandwidth ≈ 60% of the datasheet figure (what dense decode kernels reach in practice).
# Sources: NVIDIA H100 SXM datasheet (80 GB HBM3, 3.35 TB/s); NVIDIA RTX PRO 6000 Blackwell datasheet (96 GB GDDR7,
# 1.792 TB/s); a 27B-class dense target with 64 layers, 8 KV heads × 128 dims (GQA) → 2·64·8·128·2 B = 262 KB of
# BF16 KV per token; Llama-3.1-8B config (32 layers, 8 KV heads × 128) → 131 KB per token. KV pool = 0.9 × memory
# (SGLang's mem_fraction_static ≈ 0.88-0.9) − weights − ~4 GB activations/graphs. Checked against the DESIGN's
# throughput references: ~2,000 tok/s for a 32B dense model on H100 at high concurrency; ~400 tok/s per RTX PRO
# 6000 measured in the real case (27B BF16, with MTP, at its concurrency). SGLang's default max_running_requests is
# derived from the pool; the profiles state the effective value (`internal_states[].effective_max_running_requests_per_dp`).


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    max_running_requests: int
    max_total_num_tokens: int  # the KV pool, in tokens
    t0_s: float  # per decode step
    t1_s: float  # per running request per step
    t2_s: float  # per token held in the KV pool per step
    prefill_s_per_token: float
    mean_tokens: float  # completion length: lognormal around this mean
    sigma: float = 0.6
    max_new_tokens: int = 4096  # used when a request does not say (SGLang's default is 128: the generator always says)
    prompt_tokens: int = 300  # OpenAI endpoints: prompt length when the text is not counted
    # simulated seconds per real second: each profile's keeps its real completion rate at peak near 40/s (2,000-token
    # answers take 1-4 real seconds), what one Python generator feeds on a shared 2-core machine; raise it on a
    # faster host (--compression) and check the generator still keeps up (fill vs peak in the same run)
    compression: float = 1.0
    admit_reserve: float = 0.25  # fraction of max_new_tokens a newly admitted request must find free in the pool


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("h100-27b-fp8", "27B dense FP8 (27 GB weights) on one H100 SXM at ~2.0 TB/s effective: t0 = 13.5+2 ms, "
            "t2 = 262 KB/2.0 TB/s; pool (72-27-4 GB)/262 KB ≈ 156K tokens", max_running_requests=128,
            max_total_num_tokens=156_000, t0_s=0.0155, t1_s=0.00004, t2_s=131e-9, prefill_s_per_token=25e-6,
            mean_tokens=2000, max_new_tokens=8192, compression=40.0),
    Profile("h100-27b-bf16", "27B dense BF16 (54 GB) on one H100: t0 = 27+2 ms; pool (72-54-4 GB)/262 KB ≈ 53K "
            "tokens: the KV pool, not max_running_requests, caps the batch", max_running_requests=128,
            max_total_num_tokens=53_000, t0_s=0.029, t1_s=0.00004, t2_s=131e-9, prefill_s_per_token=50e-6,
            mean_tokens=2000, max_new_tokens=8192, compression=100.0),
    Profile("rtxpro6000-27b", "27B dense BF16 (54 GB) on one RTX PRO 6000 Blackwell (96 GB, 1.79 TB/s; ~1.1 effective):"
            " t0 = 49+2 ms, t2 = 238 ns; pool (86-54-4 GB)/262 KB ≈ 107K tokens (KV-capped near 40 x 2.5K)",
            max_running_requests=128, max_total_num_tokens=107_000, t0_s=0.051, t1_s=0.00005, t2_s=238e-9,
            prefill_s_per_token=90e-6, mean_tokens=2000, max_new_tokens=8192, compression=100.0),
    Profile("h100-8b", "Llama-3.1-8B BF16 (16 GB) on one H100: t0 = 8+2 ms, t2 = 131 KB/2.0 TB/s = 65 ns; pool "
            "(72-16-4 GB)/131 KB ≈ 400K tokens", max_running_requests=256, max_total_num_tokens=400_000,
            t0_s=0.010, t1_s=0.00003, t2_s=65e-9, prefill_s_per_token=8e-6, mean_tokens=2000, max_new_tokens=8192,
            compression=20.0),
    # Small, fast profiles for tests (the stand-in: 50 ms + 0.25 ms per running request, 64 slots).
    Profile("test-small", "test: 16 slots, 40-token answers", max_running_requests=16, max_total_num_tokens=100_000,
            t0_s=0.050, t1_s=0.00025, t2_s=0.0, prefill_s_per_token=1e-5, mean_tokens=40, sigma=0.3,
            max_new_tokens=120, prompt_tokens=40, compression=4.0),
    Profile("test-batch", "test: the issue's stand-in, 64 slots, step 50 ms + 0.25 ms x running, ~60-token answers",
            max_running_requests=64, max_total_num_tokens=1_000_000, t0_s=0.050, t1_s=0.00025, t2_s=0.0,
            prefill_s_per_token=1e-5, mean_tokens=60, sigma=0.3, max_new_tokens=160, prompt_tokens=40,
            compression=4.0),
    Profile("test-kv", "test: 64 slots but a 3,000-token KV pool caps the batch near 25 (~120-token prompts + ~60)",
            max_running_requests=64, max_total_num_tokens=3_000, t0_s=0.050, t1_s=0.00025, t2_s=2e-6,
            prefill_s_per_token=1e-5, mean_tokens=60, sigma=0.3, max_new_tokens=160, prompt_tokens=60,
            compression=4.0),
)}


@dataclass
class Faults:
    """Faults on demand; rates are per /generate (or OpenAI) request."""

    error_rate: float = 0.0  # answered HTTP 500 at once
    drop_rate: float = 0.0  # connection closed half-way through the generation
    hang_rate: float = 0.0  # never answered (until aborted); holds no decode slot
    garbage_rate: float = 0.0  # HTTP 200 with a body that is not the API's shape
    server_info: str = "full"  # full | missing (no running-request fields) | garbage (not JSON)
    metrics_delay_s: float = 0.0  # a slow /metrics (real seconds)
    never_healthy: bool = False  # /health_generate answers 503 forever
    abort_on_disconnect: bool = True  # SGLang/vLLM abort a request whose client went away; False: it decodes on


# --- the engine -------------------------------------------------------------------------------------------------


class Req:
    __slots__ = ("aborted", "dropped", "fut", "generated", "gone", "kv", "prompt_len", "rid", "target", "truncated")

    def __init__(self, rid: str, prompt_len: int, target: int, truncated: bool, fut: asyncio.Future | None) -> None:
        self.rid, self.prompt_len, self.target, self.truncated, self.fut = rid, prompt_len, target, truncated, fut
        self.generated = 0
        self.kv = 0  # tokens this request holds in the KV pool (0 while queued)
        self.aborted = False
        self.gone = False  # its client disconnected (the engine does not know unless abort_on_disconnect)
        self.dropped = False  # a drop fault: close the connection half-way


@dataclass
class SimStats:
    profile: str
    sim_time_s: float
    tokens_generated: int
    requests_finished: int
    requests_aborted: int
    requests_retracted: int
    tokens_for_nobody: int  # tokens decoded for requests whose client had gone
    mean_running: float
    peak_running: int
    running: int
    queued: int
    max_running_requests: int
    tokens_per_s: float
    restarts: int
    faults_injected: dict[str, int] = field(default_factory=dict)
    steady: dict[str, float] = field(default_factory=dict)
    first_arrival_s: float = 0.0  # simulated time of the first request's arrival
    last_finish_s: float = 0.0  # and of the last finish: the run's span in simulated time


class BatchEngine:
    """Continuous batching in simulated time; runs as a task on the server's loop."""

    def __init__(self, profile: Profile, *, compression: float, quantum_s: float = 0.002, seed: int = 0) -> None:
        self.p = profile
        self.compression = compression
        self.quantum_s = quantum_s  # the longest real time one jump covers (arrivals wait at most this long)
        self.seed = seed
        self.mean_tokens = profile.mean_tokens
        self.queue: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.held = 0
        self.sim_t = 0.0
        self.wake = asyncio.Event()
        self.by_rid: dict[str, Req] = {}
        # stats: a log per jump (sim time at its end, tokens so far, running-time integral so far) and finish times
        self.log_t, self.log_tokens, self.log_run = array("d", [0.0]), array("d", [0.0]), array("d", [0.0])
        self.finish_t = array("d")
        self.tokens = 0
        self.run_integral = 0.0
        self.peak = 0
        self.aborted = self.retracted = self.for_nobody = self.restarts = 0
        self.gen_window: collections.deque[tuple[float, int]] = collections.deque()  # (sim t, tokens) ~ last 5 s
        self.first_arrival: float | None = None

    # requests ------------------------------------------------------------------------------------------------------

    def length_for(self, ids_key: bytes, max_new_tokens: int) -> tuple[int, bool]:
        """A completion length from the prompt (same prompt → same length): lognormal around the mean, capped."""
        h = hashlib.blake2b(ids_key + str(self.seed).encode() + str(self.mean_tokens).encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(h, "big"))
        sigma = self.p.sigma
        mu = math.log(max(1.0, self.mean_tokens)) - sigma * sigma / 2
        n = max(1, round(math.exp(rng.gauss(mu, sigma))))
        return (max_new_tokens, True) if n >= max_new_tokens else (n, False)

    def submit(self, req: Req) -> None:
        self.by_rid[req.rid] = req
        self.queue.append(req)
        self.wake.set()

    def abort(self, rid: str | None) -> int:
        """Abort the requests whose rid starts with `rid` (all: None); they answer at once with finish_reason abort."""
        # by prefix, as SGLang's scheduler matches (`req.rid.startswith(recv_req.rid)`)
        targets = [r for k, r in self.by_rid.items() if rid is None or k.startswith(rid)]
        for r in targets:
            r.aborted = True
            self._remove(r)
            self.aborted += 1
            self._settle(r)
        return len(targets)

    def lose_everything(self) -> list[Req]:
        """A restart: every running and queued request is gone (the caller resets their connections)."""
        lost = list(self.by_rid.values())
        self.queue.clear()
        self.running.clear()
        self.by_rid.clear()
        self.held = 0
        self.restarts += 1
        return lost

    def _remove(self, r: Req) -> None:
        self.by_rid.pop(r.rid, None)
        if r.kv:
            self.held -= r.kv
            r.kv = 0
            with contextlib.suppress(ValueError):
                self.running.remove(r)
        else:
            with contextlib.suppress(ValueError):
                self.queue.remove(r)

    def _settle(self, r: Req) -> None:
        if r.fut is not None and not r.fut.done():
            r.fut.set_result(r)

    # the loop ------------------------------------------------------------------------------------------------------

    def step_time(self, n: int, k: int) -> float:
        """Simulated seconds for k decode steps of n running requests, the pool growing by n tokens per step."""
        p = self.p
        return k * (p.t0_s + p.t1_s * n) + p.t2_s * (k * self.held + n * k * (k - 1) / 2)

    def _admit(self) -> int:
        """Move queued requests into the batch while slots and the pool allow; the prefill tokens it costs."""
        p, prefill = self.p, 0
        while self.queue and len(self.running) < p.max_running_requests:
            r = self.queue[0]
            need = r.prompt_len + r.generated
            reserve = min(r.target - r.generated, int(p.admit_reserve * self.p.max_new_tokens))
            # room for it, its reserve and one more step of the batch (a request just retracted does not come
            # straight back: SGLang raises its new-token estimate after a retraction for the same reason)
            if self.running and self.held + need + reserve + len(self.running) + 1 > p.max_total_num_tokens:
                break
            self.queue.popleft()
            r.kv = need
            self.held += need
            prefill += need
            self.running.append(r)
        return prefill

    def _retract(self) -> None:
        """The pool is full: put back the running request with the fewest generated tokens (SGLang retract_decode)."""
        r = min(self.running, key=lambda x: (x.generated, -x.prompt_len))
        self.running.remove(r)
        self.held -= r.kv
        r.kv = 0
        self.queue.appendleft(r)
        self.retracted += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        anchor_real, anchor_sim = loop.time(), self.sim_t
        while True:
            if not self.running and not self.queue:
                self.wake.clear()
                idle_from = loop.time()
                await self.wake.wait()
                self.sim_t += (loop.time() - idle_from) * self.compression  # idle time counts
                if self.first_arrival is None:
                    self.first_arrival = self.sim_t
                self._log()
                anchor_real, anchor_sim = loop.time(), self.sim_t
            prefill = self._admit()
            n = len(self.running)
            if n == 0:  # max_running_requests 0: nothing can ever run
                r = self.queue.popleft()
                r.aborted = True
                self.by_rid.pop(r.rid, None)
                self._settle(r)
                continue
            room = self.p.max_total_num_tokens - self.held
            if room < n and n > 1:
                self._retract()
                continue
            k = min(r.target - r.generated for r in self.running)
            if room >= n:
                k = min(k, room // n)
            per_step = self.p.t0_s + self.p.t1_s * n + self.p.t2_s * self.held
            k = max(1, min(k, int(self.quantum_s * self.compression / max(per_step, 1e-9))))
            dt = prefill * self.p.prefill_s_per_token + self.step_time(n, k)
            self.sim_t += dt
            self.held += n * k
            self.tokens += n * k
            self.run_integral += n * dt
            self.peak = max(self.peak, n)
            self.gen_window.append((self.sim_t, n * k))
            while self.gen_window and self.sim_t - self.gen_window[0][0] > 5.0:
                self.gen_window.popleft()
            done = []
            for r in self.running:
                r.generated += k
                r.kv += k
                if r.gone:
                    self.for_nobody += k
                if r.generated >= r.target:
                    done.append(r)
            for r in done:
                self._remove(r)
                self.finish_t.append(self.sim_t)
                self._settle(r)
            self._log()
            # real time follows simulated time; lag (this process being slow) is dropped, not counted
            target = anchor_real + (self.sim_t - anchor_sim) / self.compression
            now = loop.time()
            if target > now:
                await asyncio.sleep(target - now)
            else:
                if now - target > 0.05:
                    anchor_real, anchor_sim = now, self.sim_t
                await asyncio.sleep(0)

    def _log(self) -> None:
        if self.sim_t - self.log_t[-1] < 1e-4 and len(self.log_t) > 1:  # merge tiny jumps: the log stays small
            self.log_t[-1], self.log_tokens[-1], self.log_run[-1] = self.sim_t, self.tokens, self.run_integral
            return
        self.log_t.append(self.sim_t)
        self.log_tokens.append(self.tokens)
        self.log_run.append(self.run_integral)

    # stats ---------------------------------------------------------------------------------------------------------

    def tokens_per_s_now(self) -> float:
        """Generation throughput over the last ~5 simulated seconds (what sglang:gen_throughput reports)."""
        if len(self.gen_window) < 2:
            return 0.0
        span = self.gen_window[-1][0] - self.gen_window[0][0]
        return sum(t for _, t in list(self.gen_window)[1:]) / span if span > 0 else 0.0

    def _at(self, t: float) -> tuple[float, float]:
        """(tokens, running integral) at simulated time t, interpolated in the jump log."""
        i = bisect_left(self.log_t, t)
        if i <= 0:
            return self.log_tokens[0], self.log_run[0]
        if i >= len(self.log_t):
            return self.log_tokens[-1], self.log_run[-1]
        t0, t1 = self.log_t[i - 1], self.log_t[i]
        f = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return (self.log_tokens[i - 1] + f * (self.log_tokens[i] - self.log_tokens[i - 1]),
                self.log_run[i - 1] + f * (self.log_run[i] - self.log_run[i - 1]))

    def steady(self, skip: float = 0.05, since: int = 0) -> dict[str, float]:
        """Tokens/s and mean running between the finishes of the first and last `skip` of the requests finished
        (those after the `since`-th), in simulated time."""
        finishes = sorted(self.finish_t[since:])
        n = len(finishes)
        if n < 20:
            return {}
        a, b = finishes[int(n * skip)], finishes[max(int(n * skip), math.ceil(n * (1 - skip)) - 1)]
        if b <= a:
            return {}
        (tok_a, run_a), (tok_b, run_b) = self._at(a), self._at(b)
        return {"tokens_per_s": (tok_b - tok_a) / (b - a), "mean_running": (run_b - run_a) / (b - a),
                "window_s": b - a, "requests": n}

    def stats(self, faults: dict[str, int], skip: float = 0.05, since: int = 0) -> SimStats:
        return SimStats(
            profile=self.p.name, sim_time_s=self.sim_t, tokens_generated=self.tokens,
            requests_finished=len(self.finish_t), requests_aborted=self.aborted, requests_retracted=self.retracted,
            tokens_for_nobody=self.for_nobody, mean_running=self.run_integral / self.sim_t if self.sim_t else 0.0,
            peak_running=self.peak, running=len(self.running), queued=len(self.queue),
            max_running_requests=self.p.max_running_requests,
            tokens_per_s=self.tokens / self.sim_t if self.sim_t else 0.0, restarts=self.restarts,
            faults_injected=dict(faults), steady=self.steady(skip, since),
            first_arrival_s=self.first_arrival or 0.0, last_finish_s=max(self.finish_t, default=0.0),
        )


# --- HTTP -------------------------------------------------------------------------------------------------------


class BadRequest(Exception):
    pass


class SimServer:
    """A small HTTP/1.1 server (keep-alive, Content-Length bodies) over the engine: it owns its sockets, so it can
    drop a connection mid-request or refuse connections during a restart as a real engine does."""

    def __init__(self, profile: Profile, *, host: str = "127.0.0.1", port: int = 0, compression: float | None = None,
                 enable_metrics: bool = False, flavor: str = "sglang", faults: Faults | None = None, seed: int = 0,
                 max_running_requests_arg: int | None = None, ids_cap: int | None = None, eos_id: int = 2,
                 vocab: tuple[int, int] = (1000, 9000), model: str = "sim-model", dp_size: int = 1) -> None:
        self.profile = profile
        self.host, self.port = host, port
        self.compression = compression or profile.compression
        self.enable_metrics, self.flavor = enable_metrics, flavor
        self.faults = faults or Faults()
        self.seed = seed
        self.max_running_requests_arg = max_running_requests_arg
        self.ids_cap, self.eos_id, self.vocab, self.model, self.dp_size = ids_cap, eos_id, vocab, model, dp_size
        self.rng = random.Random(seed)
        self.injected: collections.Counter[str] = collections.Counter()
        self.engine: BatchEngine | None = None
        self.server: asyncio.AbstractServer | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.sock: socket.socket | None = None
        self._engine_task: asyncio.Task[None] | None = None
        self.hung: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        self.engine = BatchEngine(self.profile, compression=self.compression, seed=self.seed)
        self._engine_task = asyncio.create_task(self.engine.run())
        await self._listen()

    async def _listen(self) -> None:
        if self.sock is None:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((self.host, self.port))
            self.port = self.sock.getsockname()[1]
        else:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((self.host, self.port))
        self.server = await asyncio.start_server(self._conn, sock=self.sock, backlog=1024, limit=2**24)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for w in list(self.writers):
            w.close()
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task

    async def restart(self, down_s: float = 1.0) -> int:
        """Lose every running and queued request, reset their connections, refuse connections for `down_s`."""
        assert self.engine is not None and self.server is not None
        self.server.close()
        lost = self.engine.lose_everything()
        for f in self.hung.values():
            if not f.done():
                f.cancel()
        self.hung.clear()
        for r in lost:
            r.dropped = True
            self.engine._settle(r)
        for w in list(self.writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        await asyncio.sleep(down_s)
        await self._listen()
        return len(lost)

    # connection handling -------------------------------------------------------------------------------------------

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                try:
                    status, payload, ctype = await self._route(method, path.split("?")[0], body, reader)
                except BadRequest as e:
                    status, payload, ctype = 400, json.dumps({"error": str(e)}).encode(), "application/json"
                if status == 0:  # drop the connection
                    writer.transport.abort()
                    return
                writer.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                             % (status, ctype.encode(), len(payload)) + payload)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            self.writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _route(self, method: str, path: str, body: bytes, reader: asyncio.StreamReader) -> tuple[int, bytes, str]:
        j = "application/json"
        sglang = self.flavor == "sglang"
        if path == "/generate" and method == "POST" and sglang:
            return await self._generate(self._json(body), reader)
        if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            return await self._openai(path, self._json(body), reader)
        if path in ("/health_generate", "/health"):
            if self.faults.never_healthy:
                return 503, b"engine not ready", "text/plain"
            return 200, b"", "text/plain"
        if path == "/v1/models":
            return 200, json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode(), j
        if path == "/get_server_info" and sglang:
            return self._server_info()
        if path == "/v1/loads" and sglang:
            return 200, json.dumps(self._loads()).encode(), j
        if path == "/metrics" and (self.enable_metrics if sglang else self.flavor == "vllm"):
            if self.faults.metrics_delay_s:
                await asyncio.sleep(self.faults.metrics_delay_s)
            return 200, self._metrics().encode(), "text/plain; version=0.0.4"
        if path == "/abort_request" and method == "POST" and sglang:
            data = self._json(body)
            rid = data.get("rid")
            n = self.engine.abort(None if data.get("abort_all") else rid) if self.engine else 0
            for key in [k for k in self.hung if data.get("abort_all") or (rid and k.startswith(rid))]:
                if not self.hung[key].done():
                    self.hung[key].set_result(None)
                    n += 1
            return 200, json.dumps({"aborted": n}).encode(), j
        if path == "/sim/stats":
            since = int(self._json(body).get("since", 0)) if body else 0
            return 200, json.dumps(asdict(self.stats(since=since))).encode(), j
        if path == "/sim/restart" and method == "POST":
            down = float(self._json(body).get("down_s", 1.0))
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.restart(down)))
            return 200, b"{}", j
        if path == "/sim/faults" and method == "POST":
            self.set_faults(**self._json(body))
            return 200, json.dumps(asdict(self.faults)).encode(), j
        if path == "/sim/mean_tokens" and method == "POST":
            assert self.engine is not None
            self.engine.mean_tokens = float(self._json(body)["mean_tokens"])
            return 200, b"{}", j
        return 404, json.dumps({"detail": "Not Found"}).encode(), j

    @staticmethod
    def _json(body: bytes) -> dict[str, Any]:
        try:
            data = json.loads(body or b"{}")
        except ValueError as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise BadRequest("body is not a JSON object")
        return data

    def set_faults(self, **changes: Any) -> None:
        self.faults = replace(self.faults, **changes)

    def stats(self, since: int = 0) -> SimStats:
        assert self.engine is not None
        return self.engine.stats(dict(self.injected), since=since)

    # generation ----------------------------------------------------------------------------------------------------

    def _fault(self) -> str | None:
        f, x = self.faults, self.rng.random()
        for name, rate in (("error", f.error_rate), ("drop", f.drop_rate), ("hang", f.hang_rate),
                           ("garbage", f.garbage_rate)):
            if x < rate:
                self.injected[name] += 1
                return name
            x -= rate
        return None

    async def _run_request(self, rid: str, prompt_len: int, key: bytes, max_new: int,
                           reader: asyncio.StreamReader) -> Req | str:
        """Queue one request in the engine and wait for it: the finished Req, or a fault's name."""
        assert self.engine is not None
        fault = self._fault()
        if fault == "error":
            return "error"
        if fault == "hang":
            fut = asyncio.get_running_loop().create_future()
            self.hung[rid] = fut
            try:
                await fut
            finally:
                self.hung.pop(rid, None)
            r = Req(rid, prompt_len, 0, False, None)
            r.aborted = True
            return r
        target, truncated = self.engine.length_for(key, max_new)
        fut = asyncio.get_running_loop().create_future()
        r = Req(rid, prompt_len, target, truncated, fut)
        if fault == "drop":
            r.dropped = True
            r.target = max(1, target // 2)
        if rid in self.engine.by_rid:
            raise BadRequest(f"duplicate request id {rid!r}")
        self.engine.submit(r)
        eof = asyncio.ensure_future(reader.read(1))  # b"" when the client goes away
        try:
            await asyncio.wait([fut, eof], return_when=asyncio.FIRST_COMPLETED)
            if not fut.done():  # the client disconnected
                r.gone = True
                if self.faults.abort_on_disconnect:
                    self.engine.abort(rid)
                return "gone"
        finally:
            eof.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await eof  # the reader is free again for the connection's next request
        if r.dropped:
            if not r.aborted:
                self.injected["dropped_after_run"] += 1
            return "drop"
        if fault == "garbage":
            return "garbage"
        return r

    def _output_ids(self, r: Req) -> list[int]:
        n = r.generated if not r.aborted else min(r.generated, r.target)
        body = n - (0 if r.truncated or r.aborted else 1)
        shown = body if self.ids_cap is None else min(body, self.ids_cap)
        lo, hi = self.vocab
        rng = random.Random(r.rid.split("-")[0])
        ids = [rng.randrange(lo, hi) for _ in range(max(0, shown))]
        return ids if (r.truncated or r.aborted) else [*ids, self.eos_id]

    def _reason(self, r: Req) -> str:
        return "abort" if r.aborted else ("length" if r.truncated else "stop")

    async def _generate(self, data: dict[str, Any], reader: asyncio.StreamReader) -> tuple[int, bytes, str]:
        ids = data.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids: a non-empty list of token ids is required")
        params = data.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens") or 128)  # SGLang's own default
        rid = str(data.get("rid") or os.urandom(8).hex())
        out = await self._run_request(rid, len(ids), json.dumps(ids[:64] + ids[-64:]).encode(), max_new, reader)
        if isinstance(out, str):
            return self._fault_answer(out)
        out_ids = self._output_ids(out)
        reason = self._reason(out)
        finish: dict[str, Any] = {"type": reason}
        if reason == "length":
            finish["length"] = max_new
        elif reason == "stop":
            finish["matched"] = self.eos_id
        else:
            finish["message"] = "Abort before prefill" if out.generated == 0 else "Abort in waiting queue"
        text = " ".join(f"w{i}" for i in out_ids[:64] if i != self.eos_id)
        resp = {"text": text, "output_ids": out_ids, "meta_info": {
            "id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
            "completion_tokens": out.generated, "cached_tokens": 0}}
        return 200, json.dumps(resp).encode(), "application/json"

    async def _openai(self, path: str, data: dict[str, Any], reader: asyncio.StreamReader) -> tuple[int, bytes, str]:
        if path.endswith("chat/completions"):
            msgs = data.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("messages: a non-empty list is required")
            text = json.dumps(msgs)
        else:
            text = data.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("prompt: a string is required")
        prompt_len = max(1, len(text) // 4)
        max_new = int(data.get("max_tokens") or data.get("max_completion_tokens") or self.profile.max_new_tokens)
        rid = "cmpl-" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest() + "-" + os.urandom(4).hex()
        out = await self._run_request(rid, prompt_len, text.encode(), max_new, reader)
        if isinstance(out, str):
            return self._fault_answer(out)
        words = " ".join(f"w{i}" for i in self._output_ids(out)[:64] if i != self.eos_id)
        reason = self._reason(out)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
        if path.endswith("chat/completions"):
            choice["message"] = {"role": "assistant", "content": words}
            obj = "chat.completion"
        else:
            choice["text"] = words
            obj = "text_completion"
        resp = {"id": rid, "object": obj, "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": out.generated,
                          "total_tokens": prompt_len + out.generated}}
        return 200, json.dumps(resp).encode(), "application/json"

    def _fault_answer(self, what: str) -> tuple[int, bytes, str]:
        if what == "error":
            return 500, b'{"error": "simulated engine fault"}', "application/json"
        if what == "garbage":
            return 200, b'{"unexpected": "shape", "meta": []}', "application/json"
        return 0, b"", ""  # drop / gone / lost in a restart: close the connection

    # introspection -------------------------------------------------------------------------------------------------

    def _server_info(self) -> tuple[int, bytes, str]:
        assert self.engine is not None
        if self.faults.server_info == "garbage":
            return 200, b"<html>not json</html>", "text/html"
        p, e = self.profile, self.engine
        info: dict[str, Any] = {
            "model_path": self.model, "tokenizer_path": self.model, "host": self.host, "port": self.port,
            "tp_size": 1, "dp_size": self.dp_size, "mem_fraction_static": 0.88, "max_running_requests":
            self.max_running_requests_arg, "max_total_tokens": None, "chunked_prefill_size": 8192,
            "schedule_policy": "fcfs", "enable_metrics": self.enable_metrics, "context_length": None,
            "version": "0.5.21",
        }
        if self.faults.server_info == "missing":
            info.pop("max_running_requests")
            info["internal_states"] = [{}]
        else:
            info["internal_states"] = [{
                "last_gen_throughput": e.tokens_per_s_now(),
                "memory_usage": {"weight": 27.0, "kvcache": 40.0, "token_capacity": p.max_total_num_tokens,
                                 "graph": 0.5},
                "effective_max_running_requests_per_dp": p.max_running_requests,
            } for _ in range(self.dp_size)]
        return 200, json.dumps(info).encode(), "application/json"

    def _loads(self) -> dict[str, Any]:
        assert self.engine is not None
        p, e = self.profile, self.engine
        return {"version": "0.5.21", "timestamp": time.time(), "loads": [{
            "dp_rank": 0, "num_running_reqs": len(e.running), "num_waiting_reqs": len(e.queue),
            "num_total_reqs": len(e.running) + len(e.queue), "max_running_requests": p.max_running_requests,
            "max_total_num_tokens": p.max_total_num_tokens, "num_used_tokens": e.held,
            "token_usage": round(e.held / p.max_total_num_tokens, 4)}]}

    def _metrics(self) -> str:
        assert self.engine is not None
        e, p = self.engine, self.profile
        label = f'{{model_name="{self.model}"}}'
        if self.flavor == "vllm":
            rows = [("vllm:num_requests_running", len(e.running)), ("vllm:num_requests_waiting", len(e.queue)),
                    ("vllm:kv_cache_usage_perc", e.held / p.max_total_num_tokens),
                    ("vllm:generation_tokens_total", e.tokens)]
        else:
            rows = [("sglang:num_running_reqs", len(e.running)), ("sglang:num_queue_reqs", len(e.queue)),
                    ("sglang:gen_throughput", e.tokens_per_s_now()),
                    ("sglang:token_usage", e.held / p.max_total_num_tokens),
                    ("sglang:num_used_tokens", e.held), ("sglang:generation_tokens_total", e.tokens)]
        out = []
        for name, value in rows:
            kind = "counter" if name.endswith("_total") else "gauge"
            out += [f"# HELP {name} {name}", f"# TYPE {name} {kind}", f"{name}{label} {float(value)}"]
        return "\n".join(out) + "\n"


# --- in-process and subprocess handles ---------------------------------------------------------------------------


def profile_named(profile: Profile | str) -> Profile:
    if isinstance(profile, Profile):
        return profile
    if profile not in PROFILES:
        raise ValueError(f"unknown simulator profile {profile!r}; known: {', '.join(PROFILES)}")
    return PROFILES[profile]


class EngineSim:
    """One simulated engine on its own thread and event loop, in this process."""

    def __init__(self, profile: Profile | str, **kwargs: Any) -> None:
        self.server = SimServer(profile_named(profile), **kwargs)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    def start(self) -> EngineSim:
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()

        def main() -> None:
            assert self.loop is not None
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, name="engine-sim", daemon=True)
        self.thread.start()
        if not ready.wait(30):
            raise RuntimeError("engine simulator did not start in 30 s")
        return self

    def _call(self, coro: Any, timeout: float = 60.0) -> Any:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop is None:
            return
        self._call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.thread is not None:
            self.thread.join(10)
        self.loop = None

    def __enter__(self) -> EngineSim:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    async def _stats(self, since: int) -> SimStats:
        return self.server.stats(since)

    def stats(self, since: int = 0) -> SimStats:
        return self._call(self._stats(since))

    def restart(self, down_s: float = 1.0) -> int:
        return self._call(self.server.restart(down_s))

    async def _apply(self, fn: Any) -> Any:
        return fn()

    def set_faults(self, **changes: Any) -> None:
        self._call(self._apply(lambda: self.server.set_faults(**changes)))

    def set_mean_tokens(self, mean: float) -> None:
        def change() -> None:
            assert self.server.engine is not None
            self.server.engine.mean_tokens = mean

        self._call(self._apply(change))


class EngineSimProcess:
    """The same simulator as a subprocess (`python -m bench.engine_sim`): its own interpreter and GIL, as a real
    engine would be. Stats, faults and restarts go over its /sim/* endpoints."""

    def __init__(self, profile: str, *, port: int = 0, compression: float | None = None, enable_metrics: bool = True,
                 flavor: str = "sglang", seed: int = 0, ids_cap: int | None = None, extra: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.cmd = [sys.executable, "-m", "bench.engine_sim", "--profile", profile, "--port", str(self.port),
                    "--flavor", flavor, "--seed", str(seed)]
        if compression:
            self.cmd += ["--compression", str(compression)]
        if enable_metrics:
            self.cmd.append("--enable-metrics")
        if ids_cap is not None:
            self.cmd += ["--ids-cap", str(ids_cap)]
        self.cmd += extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> EngineSimProcess:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(self.cmd, cwd=root, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                self._get("/v1/models")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine simulator exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            time.sleep(0.1)
        raise RuntimeError(f"engine simulator not answering on {self.url} after {timeout_s:.0f}s")

    def _get(self, path: str, body: dict[str, Any] | None = None) -> Any:
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"{}")

    def stats(self, since: int = 0) -> SimStats:
        return SimStats(**self._get("/sim/stats", {"since": since}))

    def restart(self, down_s: float = 1.0) -> None:
        self._get("/sim/restart", {"down_s": down_s})

    def set_faults(self, **changes: Any) -> None:
        self._get("/sim/faults", changes)

    def set_mean_tokens(self, mean: float) -> None:
        self._get("/sim/mean_tokens", {"mean_tokens": mean})

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> EngineSimProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_peak(profile: Profile | str, concurrencies: list[int], *, requests: int = 400, prompt_len: int = 60,
               max_new_tokens: int | None = None, seed: int = 0) -> dict[int, dict[str, float]]:
    """The engine alone (no HTTP, no client, as fast as this CPU runs it): steady-state tokens/s and mean running
    at each fixed concurrency — what a perfect client would get. Deterministic for a seed."""
    with contextlib.suppress(RuntimeError):  # called from a running loop: compute on a thread of its own
        asyncio.get_running_loop()
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(model_peak, profile, concurrencies, requests=requests, prompt_len=prompt_len,
                               max_new_tokens=max_new_tokens, seed=seed).result()
    p = profile_named(profile)
    max_new = max_new_tokens or p.max_new_tokens

    async def one_level(conc: int) -> dict[str, float]:
        engine = BatchEngine(p, compression=1e9, seed=seed)
        task = asyncio.create_task(engine.run())
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(conc)

        async def one(i: int) -> None:
            async with sem:
                fut = loop.create_future()
                target, truncated = engine.length_for(f"p{i}".encode(), max_new)
                engine.submit(Req(f"r{i}", prompt_len, target, truncated, fut))
                await fut

        await asyncio.gather(*(one(i) for i in range(requests)))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return engine.steady()

    return {c: asyncio.run(one_level(c)) for c in concurrencies}


def steady_state(stats: SimStats, profile: Profile | str | None = None) -> dict[str, float]:
    """The stats' steady-state window with its fill (mean running ÷ max_running_requests)."""
    s = dict(stats.steady)
    if s:
        s["fill"] = s["mean_running"] / stats.max_running_requests
    return s


# --- command line -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="test-batch", help=f"one of: {', '.join(PROFILES)}")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--compression", type=float, default=None, help="simulated seconds per real second")
    ap.add_argument("--enable-metrics", action="store_true", help="serve /metrics (SGLang's flag)")
    ap.add_argument("--flavor", choices=["sglang", "vllm", "openai"], default="sglang",
                    help="vllm: /metrics always, no SGLang endpoints; openai: OpenAI endpoints only, no /metrics")
    ap.add_argument("--max-running-requests", type=int, default=None,
                    help="as if launched with it: /get_server_info shows it (the profile's limit applies either way)")
    ap.add_argument("--ids-cap", type=int, default=None, help="return at most this many output ids per answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--error-rate", type=float, default=0.0)
    ap.add_argument("--drop-rate", type=float, default=0.0)
    ap.add_argument("--hang-rate", type=float, default=0.0)
    ap.add_argument("--garbage-rate", type=float, default=0.0)
    ap.add_argument("--server-info", choices=["full", "missing", "garbage"], default="full")
    ap.add_argument("--metrics-delay-s", type=float, default=0.0)
    ap.add_argument("--never-healthy", action="store_true")
    ap.add_argument("--no-abort-on-disconnect", action="store_true")
    args = ap.parse_args(argv)
    profile = profile_named(args.profile)
    if args.max_running_requests:
        profile = replace(profile, max_running_requests=args.max_running_requests)
    faults = Faults(error_rate=args.error_rate, drop_rate=args.drop_rate, hang_rate=args.hang_rate,
                    garbage_rate=args.garbage_rate, server_info=args.server_info, metrics_delay_s=args.metrics_delay_s,
                    never_healthy=args.never_healthy, abort_on_disconnect=not args.no_abort_on_disconnect)
    server = SimServer(profile, host=args.host, port=args.port, compression=args.compression,
                       enable_metrics=args.enable_metrics, flavor=args.flavor, faults=faults, seed=args.seed,
                       max_running_requests_arg=args.max_running_requests, ids_cap=args.ids_cap)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await server.start()
        print(f"engine simulator {profile.name} on http://{args.host}:{server.port} "
              f"(compression {server.compression:g}x)", flush=True)
        await stop.wait()
        await server.stop()

    asyncio.run(serve())
    return Exit.OK


if __name__ == "__main__":
    raise SystemExit(main())

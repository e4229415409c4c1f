"""The generator: PromptTasks from the shared durable consumer → engine → shards in S3 → ack.

Concurrency: `level` requests are in the engine at once, a level the generator finds itself so the
engine's batch stays full (engine_fill.py: from the engine's batch limit and running/queued counts, polled
every `engine_poll_s`, or from measured throughput; `max_inflight` only bounds it). Finished completions
wait in the shard buffer for their shard to be written, holding their unacked message (heartbeats every
ack_wait/3 keep it, so nothing is redelivered while it is generated or buffered), so the worker loop
fetches up to `level + shard_records` messages — it follows the level. The consumer's own cap on unacked
messages is shared by every worker of the run, so it is off unless `generator.max_ack_pending` sets one
(then the level stays below it less a shard). A request given up on (the request timeout, a drain's
cancel) is aborted on the engine by the backend.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from shared.bus import Bus, ConsumerSpec, Delivery, WorkStats, consumer_for
from shared.config import Config, fingerprint
from shared.failures import Poison, Retry
from shared.gpus import GpuGroup
from shared.ledger import RunLedger
from shared.messages import GeneratorProgress, PromptTask
from shared.records import CompletionRecord
from shared.service import Consumer, Context, Progress, Service, serve
from shared.store import Store
from shared.topology import Streams, Subjects

from .backends import Backend, EngineError, GenRequest, PromptRefused, make_backend
from .engine_fill import EngineLoad, FillController, RequestTimeout, ThroughputWindow, auto_upper
from .shards import ShardWriter

log = logging.getLogger("dflash.generator")


class Rates:
    """Tokens/s over a sliding window of recent samples."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.samples.append((time.monotonic(), prompt_tokens, completion_tokens))

    def per_s(self, started: float) -> tuple[float, float, float]:
        """(prompt tokens/s, completion tokens/s, completions/s) over the window."""
        now = time.monotonic()
        while self.samples and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        span = max(1.0, min(self.window_s, now - started))
        return (sum(s[1] for s in self.samples) / span, sum(s[2] for s in self.samples) / span,
                len(self.samples) / span)


def level_bound(cfg: Config) -> int:
    """The most requests one generator may keep in flight: max_inflight when set, else auto_upper."""
    g = cfg.generator
    return g.max_inflight if g.max_inflight > 0 else auto_upper(g.max_ack_pending, g.shard_records)


def prompt_consumer(cfg: Config) -> tuple[ConsumerSpec, int]:
    """The run's shared consumer of PromptTasks, and the most of its messages one worker holds at once."""
    g = cfg.generator
    bound = level_bound(cfg)
    per_worker = bound + 2 * g.shard_records  # one shard filling while the last is written
    if g.max_ack_pending > 0:
        per_worker = max(bound, min(g.max_ack_pending, per_worker))
    spec = consumer_for("generate", cfg.run, ack_wait_s=g.ack_wait_s, max_ack_pending=g.max_ack_pending or -1,
                        max_deliver=g.max_deliver)
    return spec, per_worker


def fill_controller(cfg: Config, backend: Backend) -> FillController:
    """Adaptive for an engine server (it reports its load or answers faster when fuller); fixed for the
    in-process backends, whose batching is their own (hf: batch_size)."""
    g = cfg.generator
    adaptive = g.adaptive and hasattr(backend, "engine_load")
    if not adaptive:
        return FillController(upper=g.max_inflight or g.fallback_inflight, fallback=g.fallback_inflight, fixed=True)
    return FillController(upper=level_bound(cfg), fallback=g.fallback_inflight)


class EngineGate:
    """At most `limit()` requests in the engine; the limit may move while requests wait."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.active = 0
        self.changed = asyncio.Condition()

    async def __aenter__(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.active < self.limit())
            self.active += 1

    async def __aexit__(self, *_: object) -> None:
        async with self.changed:
            self.active -= 1
            self.changed.notify_all()

    async def poke(self) -> None:
        """The limit changed: let waiters look again."""
        async with self.changed:
            self.changed.notify_all()


class Generator:
    def __init__(self, cfg: Config, worker: str, backend: Backend, bus: Bus, store: Store) -> None:
        self.cfg, self.worker, self.backend, self.bus, self.store = cfg, worker, backend, bus, store
        self.run = cfg.run
        g = cfg.generator
        self.spec, self.slots = prompt_consumer(cfg)
        self.shards = ShardWriter(bus, store, self.run, worker, max_records=min(g.shard_records, self.slots),
                                  max_age_s=g.shard_seconds, idle_for=self.engine_idle_for,
                                  idle_s=min(g.shard_idle_s, g.shard_seconds))
        self.fill = fill_controller(cfg, backend)
        self.engine_slots = EngineGate(lambda: self.fill.level)
        self.load = EngineLoad()
        self.window = ThroughputWindow()
        self.timeout = RequestTimeout(cfg.sampling.max_new_tokens)
        self.engine_url = getattr(backend, "url", "")
        if hasattr(backend, "rid_prefix"):
            backend.rid_prefix = f"{worker}/"
        self._poller: asyncio.Task[None] | None = None
        self.awaiting_shard = 0  # completions waiting for their shard to be written (their messages unacked)
        self.sampling_fp = fingerprint(cfg.sampling)
        self.stats = WorkStats()
        self.rates = Rates()
        self.started = time.monotonic()
        self.in_engine = 0
        self.engine_free_since = time.monotonic()  # when in_engine last dropped to 0
        self.completions = self.prompt_tokens = self.completion_tokens = self.engine_errors = 0
        self.finish_reasons: collections.Counter[str] = collections.Counter()
        self.accept_lengths: collections.deque[float] = collections.deque(maxlen=256)
        self.state = "running"
        self.progress_subject = Subjects.progress(self.run, "generate", worker)
        self._flusher: asyncio.Task[None] | None = None

    def engine_idle_for(self) -> float | None:
        """Seconds the engine has had no request; None while it has one."""
        return None if self.in_engine else time.monotonic() - self.engine_free_since

    def progress(self) -> GeneratorProgress:
        p_rate, c_rate, n_rate = self.rates.per_s(self.started)
        accept = sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None
        return GeneratorProgress(
            run=self.run, worker=self.worker, completions=self.completions, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, prompt_tokens_per_s=round(p_rate, 2),
            completion_tokens_per_s=round(c_rate, 2), completions_per_s=round(n_rate, 3), in_flight=self.in_engine + self.shards.buffered,
            errors=self.engine_errors + self.shards.write_errors, shards=self.shards.shards_written,
            finish_reasons=dict(self.finish_reasons), spec_accept_length=accept, state=self.state,
            engine=self.engine_url, engine_running=self.load.running, engine_queued=self.load.queued,
            engine_max_running=self.fill.max_running, engine_tokens_per_s=self.load.tokens_per_s,
            concurrency=self.fill.level,
        )

    def request_timeout_s(self) -> float:
        return self.cfg.generator.request_timeout_s or self.timeout.seconds

    async def poll_engine(self) -> None:
        """Every engine_poll_s: the engine's load → the level (or, with no load reported, throughput windows)."""
        backend: Any = self.backend
        with contextlib.suppress(Exception):
            if (limit := await backend.engine_limit()) is not None:
                self.fill.on_limit(limit)
                log.info("engine at %s: batch limit %d; starting at %d in flight", self.engine_url, limit,
                         self.fill.level)
        while True:
            await asyncio.sleep(self.cfg.generator.engine_poll_s)
            try:
                load = await backend.engine_load()
            except Exception as e:  # a backend bug must not stop generation: the level stays where it is
                log.warning("engine at %s: reading its load failed: %s: %s", self.engine_url, type(e).__name__, e)
                load = None
            before = self.fill.level
            if load is not None:
                self.load = load
                self.fill.on_load(load, self.engine_slots.active)
            elif (rate := self.window.close()) is not None:
                self.fill.on_window(rate)
            if self.fill.level != before:
                log.debug("level %d -> %d (%s)", before, self.fill.level, self.fill.mode)
                await self.engine_slots.poke()

    async def handle(self, d: Delivery) -> None:
        task: PromptTask = d.data
        if task.run != self.run:
            raise Poison(f"task for run {task.run!r} on run {self.run!r}'s subject")
        req = GenRequest(prompt_id=task.prompt_id, messages=task.messages, attempt=d.num_delivered)
        async with self.engine_slots:
            self.in_engine += 1
            t0 = time.monotonic()
            try:
                result = await asyncio.wait_for(self.backend.generate(req), self.request_timeout_s())
            except PromptRefused as e:
                raise Poison(str(e)) from None
            except (EngineError, TimeoutError) as e:
                self.engine_errors += 1
                raise Retry(str(e) or "engine request timed out") from None
            except Exception:
                self.engine_errors += 1
                raise
            finally:
                self.in_engine -= 1
                if self.in_engine == 0:
                    self.engine_free_since = time.monotonic()
        latency = time.monotonic() - t0
        self.window.add(result.completion_tokens, latency)
        self.timeout.add(latency, result.completion_tokens)
        record = CompletionRecord(
            run=self.run, prompt_id=task.prompt_id, messages=task.messages, completion=result.text,
            reasoning=result.reasoning, output_ids=result.output_ids, prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens, finish_reason=result.finish_reason,
            model=self.backend.model, engine=self.backend.engine, sampling_fingerprint=self.sampling_fp,
            worker=self.worker, attempt=d.num_delivered, generation=task.generation, latency_s=round(latency, 4),
            ts=time.time(),
        )
        self.completions += 1
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += result.completion_tokens
        self.rates.add(result.prompt_tokens, result.completion_tokens)
        self.finish_reasons[result.finish_reason] += 1
        if result.spec_accept_length is not None:
            self.accept_lengths.append(result.spec_accept_length)
        self.awaiting_shard += 1
        try:
            await self.shards.add(record)
        finally:
            self.awaiting_shard -= 1

    async def resume_counters(self, subject: str) -> None:
        """A restarted worker goes on counting where its earlier processes stopped, so totals summed
        over workers (dashboard, status, plan) never drop at a restart. Completions, completion
        tokens and shards come from the run's ledger (its S3 snapshot plus the shard events since:
        exact, and a restart costs the tail, not the run); prompt tokens, errors and finish reasons
        from this worker's last progress event (what it had published before it died)."""
        ledger = RunLedger(self.cfg, self.bus, self.store)
        mine = (await ledger.refresh()).workers.get(self.worker)
        await ledger.flush()
        if mine is not None:
            self.completions += mine.records
            self.completion_tokens += mine.completion_tokens
            self.shards.shards_written += mine.shards
        for _, last in await self.bus.latest_per_subject(Streams.PROGRESS, subject):
            if isinstance(last, GeneratorProgress):
                self.prompt_tokens += last.prompt_tokens
                self.engine_errors += last.errors
                self.finish_reasons.update(last.finish_reasons)

    # --- what the skeleton runs (shared/service.py) ----------------------------------------------

    async def start(self, stop: asyncio.Event) -> None:
        """After the engine: the shard writer, counters resumed from this worker's history, the drain's flusher."""
        await self.shards.start()
        await self.resume_counters(self.progress_subject)
        self._flusher = asyncio.create_task(self._flush_when_stopping(stop))
        if not self.fill.fixed:
            self._poller = asyncio.create_task(self.poll_engine())

    def consumer(self) -> Consumer:
        g = self.cfg.generator
        # messages held = those for the engine (the level) + those whose completion waits for its shard's
        # write (one shard filling, one being written): a shard write must not starve the engine
        return Consumer(self.spec, self.run, self.handle, PromptTask, grace_s=g.drain_s, stats=self.stats,
                        max_inflight=lambda: min(self.slots, self.fill.level + self.awaiting_shard))

    def published_progress(self) -> Progress:
        return Progress(self.progress_subject, self.progress, self.cfg.generator.progress_every_s)

    async def stop_and_flush(self) -> None:
        """The consumer has stopped: write what is buffered (the last progress snapshot counts it)."""
        if self._flusher is not None:
            self._flusher.cancel()
        if self._poller is not None:
            self._poller.cancel()
        self.state = "stopped"
        await self.shards.close(timeout_s=self.cfg.generator.drain_s)

    async def _flush_when_stopping(self, stop: asyncio.Event) -> None:
        """While draining, write what is buffered every second: a generation still running must not hold
        back the finished ones until the grace period cancels them (their prompts would be generated again)."""
        await stop.wait()
        self.state = "draining"
        self.shards.idle_s = 0.0
        while True:
            with contextlib.suppress(Exception):  # the writer logs; the next round tries again
                await asyncio.shield(self.shards.flush())  # cancelling the drain must not cut a write short
            await asyncio.sleep(1.0)


def generator_service(cfg: Config, worker: str, backend: Backend, *, owns_engine: bool = True) -> Service[Generator]:
    """The generator, declared: the engine starts (a stop signal cancels the model load), then the run's PromptTasks
    are consumed until SIGTERM/SIGINT; buffered completions are written; the engine closes. `owns_engine=False`:
    the caller started the engine and closes it (bench/generate.py keeps one loaded model between rounds)."""

    async def on_startup(ctx: Context) -> Generator:
        if owns_engine:
            await backend.start()
        generator = Generator(cfg, worker, backend, ctx.bus, ctx.store)
        await generator.start(ctx.stop)
        return generator

    async def on_shutdown(_: Generator | None) -> None:
        if owns_engine:
            await backend.close()

    return Service(
        name=f"generator-{worker}", on_startup=on_startup, consumer=Generator.consumer,
        progress=Generator.published_progress, on_stop=Generator.stop_and_flush, on_shutdown=on_shutdown,
        connect_deadline_s=60, stuck_report_after_s=max(45.0, cfg.generator.drain_s + 30),  # a drain is not stuck
    )


async def run_generator(cfg: Config, worker: str, *, gpus: GpuGroup | None = None,
                        stop: asyncio.Event | None = None) -> WorkStats:
    """The generator until SIGTERM/SIGINT (or `stop`); what its consumer did."""
    from .calibrate import starting_config

    cfg = await asyncio.to_thread(starting_config, cfg)  # the run's measured level, when it was calibrated
    generator = await serve(generator_service(cfg, worker, make_backend(cfg, gpus=gpus)), cfg, stop=stop)
    stats = generator.stats if generator is not None else WorkStats()
    log.info("generator %s stopped: %d acked, %d retried, %d dead-lettered, %d requeued", worker, stats.acked,
             stats.retried, stats.dead_lettered, stats.requeued_on_shutdown)
    return stats

"""The service skeleton: what a service declares, and the lifecycle every service shares.

Shaped like arq's `Worker`: a service says what it is (`Service`: its name, its startup and
shutdown hooks, its consumer and handler or its main loop, its progress snapshot) and `serve`
runs it, always in the same order, on one event loop:

  1. SIGTERM/SIGINT set `stop` (unless the caller brings its own `stop`, as tests do)
  2. open the store, connect the bus, ensure the streams
  3. `on_startup(ctx)` builds the worker (loads its model). A stop signal cancels startup at once:
     a worker told to stop while its model loads stops then, not after the load
  4. the progress loop publishes the worker's snapshot every few seconds; `catch_up(worker)` reads
     what earlier processes left (slow on a long run, so after progress starts; a stop cancels it)
  5. the consumer runs until `stop` (with `burst`: until it has nothing left), or `main` does
  6. `on_stop(worker)` drains what the worker buffers, still inside the progress loop, so the
     last snapshot counts it
  7. `on_shutdown(worker or None)` closes what startup opened, always; then the bus drains

Blocking startup work (a model load) goes through `startup_thread`, whose thread a stop can
leave behind without holding the process open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from shared.bus import Bus, ConsumerSpec, Delivery, ProgressLoop, WorkStats, install_stop_signals
from shared.config import Config
from shared.messages import Message
from shared.store import Store

log = logging.getLogger("dflash.service")

W = TypeVar("W")
T = TypeVar("T")


@dataclass
class Consumer:
    """The durable consumer a service works through; each message goes to `handle`, write-then-ack (shared/bus.py)."""

    spec: ConsumerSpec
    run: str
    handle: Callable[[Delivery], Awaitable[None]]
    message_type: Any
    max_inflight: int | Callable[[], int] = 16  # a callable: read before each fetch (a level that moves)
    grace_s: float = 30.0  # on stop, in-flight handlers get this long before they are cancelled and nak'ed
    stats: WorkStats = field(default_factory=WorkStats)


@dataclass
class Progress:
    """A service's progress snapshot and the subject it is published on."""

    subject: str
    snapshot: Callable[[], Message]
    every_s: float = 5.0


@dataclass
class Context:
    """What startup gets: the config, the open bus and store, and the stop event."""

    cfg: Config
    bus: Bus
    store: Store
    stop: asyncio.Event


@dataclass
class Service(Generic[W]):
    """A service, declared. Give a `consumer` (a handler per message) or a `main` loop, not both."""

    name: str  # the bus connection's name: in logs and in the alerts the bus raises
    on_startup: Callable[[Context], Awaitable[W]]  # builds the worker; cancelled by a stop signal
    consumer: Callable[[W], Consumer | None] | None = None  # None from it: nothing to consume (stay until stop)
    main: Callable[[W, asyncio.Event], Awaitable[Any]] | None = None  # a loop of its own, until stop
    progress: Callable[[W], Progress] | None = None
    catch_up: Callable[[W], Awaitable[None]] | None = None  # once progress is published, before the loop
    on_stop: Callable[[W], Awaitable[None]] | None = None  # after the loop, before the last progress snapshot
    on_shutdown: Callable[[W | None], Awaitable[None]] | None = None  # always; None when startup did not finish
    burst: bool = False  # stop once the consumer has nothing pending and nothing in flight
    connect_deadline_s: float | None = None  # None: wait for NATS forever (under a supervisor)
    stuck_report_after_s: float = 45.0  # a shutdown still running this long after the signal says where it waits

    def __post_init__(self) -> None:
        if self.consumer is not None and self.main is not None:
            raise ValueError(f"service {self.name!r}: declare a consumer or a main loop, not both")


class StoppedDuringStartup(Exception):
    """The stop signal came before the worker was built."""


async def serve(service: Service[W], cfg: Config, *, stop: asyncio.Event | None = None) -> W | None:
    """Run `service` through the whole lifecycle (module doc); the worker it built, None if stopped before that."""
    if stop is None:
        stop = asyncio.Event()
        install_stop_signals(stop, report_after_s=service.stuck_report_after_s)
    worker: W | None = None
    shut = False

    async def shutdown() -> None:
        nonlocal shut
        if not shut and service.on_shutdown is not None:
            shut = True
            await service.on_shutdown(worker)

    try:
        store = await until_stopped(startup_thread(Store.open, cfg), stop)
        bus = await until_stopped(Bus.connect(cfg.bus, service.name, deadline_s=service.connect_deadline_s), stop)
        async with bus:
            try:
                await until_stopped(bus.ensure_streams(), stop)
                worker = await until_stopped(service.on_startup(Context(cfg, bus, store, stop)), stop)
                await _run(service, worker, bus, stop)
            finally:  # while the bus is still open, also after a stop during startup (a trainer releases its lease)
                await shutdown()
    except StoppedDuringStartup:
        log.info("%s: stopped during startup", service.name)
    finally:
        await shutdown()  # the bus never opened
    return worker


async def _run(service: Service[W], worker: W, bus: Bus, stop: asyncio.Event) -> None:
    progress = service.progress(worker) if service.progress is not None else None
    async with contextlib.AsyncExitStack() as running:
        if progress is not None:
            await running.enter_async_context(ProgressLoop(bus, progress.subject, progress.snapshot, progress.every_s))
        if service.catch_up is not None:
            await until_stopped(service.catch_up(worker), stop)
        try:
            if service.main is not None:
                await service.main(worker, stop)
            elif service.consumer is not None and (consumer := service.consumer(worker)) is not None:
                await _consume(bus, consumer, stop, burst=service.burst)
        finally:
            if service.on_stop is not None:
                await service.on_stop(worker)


async def _consume(bus: Bus, consumer: Consumer, stop: asyncio.Event, *, burst: bool) -> None:
    watcher = asyncio.create_task(_stop_when_drained(bus, consumer, stop)) if burst else None
    try:
        await bus.work(consumer.spec, consumer.handle, run=consumer.run, stop=stop, message_type=consumer.message_type,
                       max_inflight=consumer.max_inflight, grace_s=consumer.grace_s, stats=consumer.stats)
    finally:
        if watcher is not None:
            watcher.cancel()


async def _stop_when_drained(bus: Bus, consumer: Consumer, stop: asyncio.Event, quiet_s: float = 0.6) -> None:
    """Burst mode: set `stop` once the consumer has had nothing pending and nothing in flight for `quiet_s`."""
    spec, stats = consumer.spec, consumer.stats
    quiet_since = None
    while not stop.is_set():
        await asyncio.sleep(0.3)
        try:
            info = await bus.consumer_state(spec.stream, spec.durable)
        except Exception:  # the server is away past the read deadline: look again
            continue
        if info is None:  # not created yet
            continue
        idle = info.pending == 0 and info.ack_pending == 0 and stats.in_flight == 0
        if not idle:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > quiet_s:
            stop.set()


async def until_stopped(step: Awaitable[T], stop: asyncio.Event) -> T:
    """Await one startup step, or cancel it when `stop` is set first (StoppedDuringStartup)."""
    task = asyncio.ensure_future(step)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # what it was doing no longer matters
        await task
    raise StoppedDuringStartup()


async def startup_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread. Unlike `asyncio.to_thread`, a stop that cancels the wait leaves the thread
    behind without the process waiting for it at exit (a model load cannot be interrupted; nothing it holds
    needs saving)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            done.set_result(value) if ok else done.set_exception(value)

    def target() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed to the awaiting task, which raises it
            ok, value = False, e
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=target, name=f"startup-{getattr(fn, '__name__', 'step')}", daemon=True).start()
    return await done

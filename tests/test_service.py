"""The service skeleton (shared/service.py) on the real nats-server and SeaweedFS: the lifecycle's order, burst
mode, and a stop signal during startup, with a real blocking call and with the real generator loading SmolLM2."""

from __future__ import annotations

import asyncio
import threading

import msgspec

from services.generator.backends import make_backend
from services.generator.service import generator_service
from shared.bus import consumer_for
from shared.messages import GeneratorProgress, PromptTask
from shared.service import Consumer, Context, Progress, Service, serve, startup_thread
from shared.topology import Subjects
from tests.conftest import make_config
from tests.test_bus import task


class Recorder:
    """A worker that records which hook ran when, and counts what its consumer handled."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.hooks: list[str] = ["startup"]
        self.handled: list[str] = []
        self.stats = None

    def snapshot(self) -> GeneratorProgress:
        return GeneratorProgress(run=self.ctx.cfg.run, worker="rec", completions=len(self.handled),
                                 state=self.hooks[-1])

    async def handle(self, d) -> None:
        self.handled.append(d.data.prompt_id)


async def test_the_lifecycle_runs_in_order_and_burst_stops_once_the_consumer_is_drained(cfg, bus) -> None:
    await bus.ensure_streams()
    await bus.publish_many([(Subjects.prompts(cfg.run), task(cfg.run, f"p{i}"), f"{cfg.run}:p{i}") for i in range(5)])
    subject = Subjects.progress(cfg.run, "generate", "rec")
    shut_down: list[Recorder | None] = []

    async def on_startup(ctx: Context) -> Recorder:
        return Recorder(ctx)

    async def catch_up(w: Recorder) -> None:
        w.hooks.append("catch_up")

    def consumer(w: Recorder) -> Consumer:
        w.hooks.append("consume")
        c = Consumer(consumer_for("generate", cfg.run), cfg.run, w.handle, PromptTask)
        w.stats = c.stats
        return c

    async def on_stop(w: Recorder) -> None:
        w.hooks.append("stopped")

    async def on_shutdown(w: Recorder | None) -> None:
        shut_down.append(w)

    service = Service(name="rec", on_startup=on_startup, catch_up=catch_up, consumer=consumer,
                      progress=lambda w: Progress(subject, w.snapshot, every_s=60.0), on_stop=on_stop,
                      on_shutdown=on_shutdown, burst=True)
    worker = await asyncio.wait_for(serve(service, cfg, stop=asyncio.Event()), 60)
    assert worker is not None and shut_down == [worker]
    assert worker.hooks == ["startup", "catch_up", "consume", "stopped"]
    assert sorted(worker.handled) == [f"p{i}" for i in range(5)] and worker.stats.acked == 5
    info = await bus.js.consumer_info("PROMPTS", f"generate-{cfg.run}")
    assert info.num_pending == info.num_ack_pending == 0
    # the last snapshot is published after on_stop, so it counts what the drain did
    [(_, last)] = await bus.latest_per_subject("PROGRESS", subject)
    assert (last.state, last.completions) == ("stopped", 5)


async def test_a_stop_during_startup_cancels_it_runs_the_shutdown_hook_and_leaves_the_thread(cfg, bus) -> None:
    release = threading.Event()
    shut_down: list[object] = []
    reached = asyncio.Event()

    async def on_startup(ctx: Context) -> str:
        reached.set()
        await startup_thread(release.wait)  # a load that does not return by itself
        return "built"

    async def on_shutdown(w: object) -> None:
        shut_down.append(w)

    async def main(w: str, stop: asyncio.Event) -> None:
        raise AssertionError("main must not run when startup was stopped")

    stop = asyncio.Event()
    serving = asyncio.create_task(serve(Service(name="slow", on_startup=on_startup, main=main,
                                                on_shutdown=on_shutdown), cfg, stop=stop))
    await asyncio.wait_for(reached.wait(), 60)
    stop.set()
    try:
        assert await asyncio.wait_for(serving, 30) is None
        assert shut_down == [None]
        [left] = [t for t in threading.enumerate() if t.name == "startup-wait"]
        assert left.is_alive() and left.daemon  # not waited for, and it does not hold the process at exit
    finally:
        release.set()


async def test_a_generator_stopped_while_its_model_loads_stops_without_waiting_for_the_load(stack, bus) -> None:
    """The flake in test_two_generators_split_a_run_and_survive_kill_9: SIGTERM while the model loads used to
    wait for the whole load, then for the consumer to start, before stopping."""
    cfg = make_config(stack)
    cfg = msgspec.structs.replace(cfg, generator=msgspec.structs.replace(cfg.generator, backend="hf"))
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(generator_service(cfg, "w-early", make_backend(cfg)), cfg, stop=stop))
    async with asyncio.timeout(120):
        while not (loading := [t for t in threading.enumerate() if t.name == "startup-_load"]):
            await asyncio.sleep(0.01)
    stop.set()
    try:
        assert await asyncio.wait_for(serving, 30) is None  # stopped during startup: no generator was built
        assert loading[0].is_alive()  # the load goes on in its daemon thread; nothing waited for it
        # it took no work and published nothing
        assert await bus.latest_per_subject("PROGRESS", Subjects.progress(cfg.run, "generate", "w-early")) == []
        assert "generate-" + cfg.run not in [c.name for c in await bus.js.consumers_info("PROMPTS")]
    finally:
        await asyncio.to_thread(loading[0].join, 120)

"""The bus against a real nats-server: dedupe, redelivery, nak, dead letters, replay."""

import asyncio

import pytest

from shared.bus import Bus, WorkStats, consumer_for
from shared.failures import Halt, Poison, Retry
from shared.messages import Alert, ChatMessage, PromptTask, ShardWritten
from shared.topology import Subjects


def task(run: str, pid: str) -> PromptTask:
    return PromptTask(run=run, prompt_id=pid, messages=[ChatMessage(role="user", content=f"q {pid}")])


async def test_republished_msg_id_is_a_duplicate(bus, cfg):
    subject = Subjects.prompts(cfg.run)
    first = await bus.publish(subject, task(cfg.run, "p1"), msg_id=f"{cfg.run}:p1")
    again = await bus.publish(subject, task(cfg.run, "p1"), msg_id=f"{cfg.run}:p1")
    assert not first.duplicate and again.duplicate is True and again.seq == first.seq
    acks = await bus.publish_many([(subject, task(cfg.run, f"p{i}"), f"{cfg.run}:p{i}") for i in range(1, 6)])
    assert [bool(a.duplicate) for a in acks] == [True, False, False, False, False]


async def run_worker(bus, spec, run, handle, *, until, timeout=30.0, **kw):
    stop = asyncio.Event()
    stats = WorkStats()
    worker = asyncio.create_task(bus.work(spec, handle, run=run, stop=stop, message_type=PromptTask, stats=stats, **kw))
    try:
        async with asyncio.timeout(timeout):
            while not until(stats):
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await worker
    return stats


async def test_unacked_message_is_redelivered_to_another_worker(cfg, bus):
    spec = consumer_for("generate", cfg.run, ack_wait_s=2.0)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "a"), msg_id=f"{cfg.run}:a")
    # worker 1 takes the message and dies (its connection closes) without an outcome
    dying = await Bus.connect(cfg.bus, "dying")
    await dying.ensure_consumer(spec)
    sub = await dying.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
    (msg,) = await sub.fetch(1, timeout=5)
    assert msg.metadata.num_delivered == 1
    await dying.nc.close()
    seen = []

    async def handle(d):
        seen.append((d.data.prompt_id, d.num_delivered))

    stats = await run_worker(bus, spec, cfg.run, handle, until=lambda s: s.acked == 1)
    assert seen == [("a", 2)] and stats.acked == 1


async def test_in_flight_falls_to_zero_when_the_handler_ends_not_at_the_next_fetch(cfg, bus):
    """Burst services stop once nothing is pending and `in_flight` is 0: it used to be updated only by a
    fetch that returned messages, so an idle worker reported its last message in flight for seconds."""
    spec = consumer_for("generate", cfg.run)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "one"), msg_id=f"{cfg.run}:one")
    done = asyncio.Event()

    async def handle(d):
        await asyncio.sleep(0.3)  # outlast the fetch that delivered it
        done.set()

    async def zero_soon_after_done(stats: WorkStats) -> bool:
        await done.wait()
        for _ in range(40):  # 2 s: the old code kept it for 6-11 s (until a fetch returned messages)
            if stats.in_flight == 0:
                return True
            await asyncio.sleep(0.05)
        return False

    stats = WorkStats()
    stop = asyncio.Event()
    worker = asyncio.create_task(bus.work(spec, handle, run=cfg.run, stop=stop, message_type=PromptTask, stats=stats))
    try:
        async with asyncio.timeout(10):
            while stats.in_flight == 0:  # the message is taken
                await asyncio.sleep(0.01)
            assert await zero_soon_after_done(stats), "in_flight still counts a finished handler 2 s later"
    finally:
        stop.set()
        await worker
    assert stats.acked == 1


async def test_nak_retries_then_dead_letter_then_replay_once(cfg, bus):
    spec = consumer_for("generate", cfg.run, ack_wait_s=5.0, max_deliver=3)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "bad"), msg_id=f"{cfg.run}:bad")
    attempts = []

    async def always_fails(d):
        attempts.append(d.num_delivered)
        raise Retry("engine timed out", delay_s=0.1)

    stats = await run_worker(bus, spec, cfg.run, always_fails, until=lambda s: s.dead_lettered == 1)
    assert attempts == [1, 2, 3] and stats.retried == 2
    letters = await bus.dead_letters(cfg.run)
    assert len(letters) == 1
    _, letter = letters[0]
    assert "engine timed out" in letter.error and letter.num_delivered == 3 and letter.stage == "generate"
    info = await bus.js.consumer_info("PROMPTS", spec.durable)
    assert info.num_pending == 0 and info.num_ack_pending == 0  # terminated: gone from the work queue

    assert await bus.replay_dead_letters(cfg.run) == 1
    assert await bus.replay_dead_letters(cfg.run) == 0  # idempotent: the letter is gone
    got = []

    async def ok(d):
        got.append(d.data.prompt_id)

    await run_worker(bus, spec, cfg.run, ok, until=lambda s: s.acked == 1)
    assert got == ["bad"]


async def test_poison_and_malformed_payloads_are_dead_lettered_at_once(cfg, bus):
    spec = consumer_for("generate", cfg.run)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "poison"), msg_id=f"{cfg.run}:poison")
    await bus.publish_raw(Subjects.prompts(cfg.run), b"\xc1 not msgpack")

    async def handle(d):
        raise Poison("prompt longer than the engine's context")

    stats = await run_worker(bus, spec, cfg.run, handle, until=lambda s: s.dead_lettered == 2)
    errors = sorted(letter.error for _, letter in await bus.dead_letters(cfg.run))
    assert errors[0].startswith("malformed payload: not a dflash-pipeline message")
    assert errors[1] == "poison: prompt longer than the engine's context"
    assert stats.acked == 0


async def test_message_past_max_deliver_without_outcome_is_dead_lettered(cfg, bus):
    spec = consumer_for("generate", cfg.run, ack_wait_s=1.0, max_deliver=1)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "x"), msg_id=f"{cfg.run}:x")
    dying = await Bus.connect(cfg.bus, "dying")
    await dying.ensure_consumer(spec)
    sub = await dying.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
    await sub.fetch(1, timeout=5)
    await dying.nc.close()

    async def never_called(d):
        raise AssertionError("must not run a message past max_deliver")

    await run_worker(bus, spec, cfg.run, never_called, until=lambda s: s.dead_lettered == 1)
    (_, letter), = await bus.dead_letters(cfg.run)
    assert "without an outcome" in letter.error


async def test_shard_log_replays_from_a_sequence(cfg, bus):
    subject = Subjects.shards(cfg.run)
    seqs = []
    for i in range(5):
        ack = await bus.publish(subject, ShardWritten(
            run=cfg.run, key=f"k{i}", worker="w", seq=i, num_records=1, prompt_ids=[f"p{i}"], sha256="0", size_bytes=1,
        ), msg_id=f"k{i}")
        seqs.append(ack.seq)
    got = [(seq, m.key) async for seq, m in bus.read_log("SHARDS", subject, seqs[2], ShardWritten)]
    assert got == [(seqs[i], f"k{i}") for i in (2, 3, 4)]


async def test_in_flight_work_is_requeued_on_shutdown(cfg, bus):
    spec = consumer_for("generate", cfg.run, ack_wait_s=30.0)
    await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "slow"), msg_id=f"{cfg.run}:slow")
    started = asyncio.Event()

    async def slow(d):
        started.set()
        await asyncio.sleep(60)

    stop = asyncio.Event()
    stats = WorkStats()
    worker = asyncio.create_task(bus.work(spec, slow, run=cfg.run, stop=stop, message_type=PromptTask, stats=stats, grace_s=0.2))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await worker
    assert stats.requeued_on_shutdown == 1
    got = []

    async def fast(d):
        got.append(d.num_delivered)

    await run_worker(bus, spec, cfg.run, fast, until=lambda s: s.acked == 1, timeout=10)
    assert got == [2]  # back at once (nak), not after ack_wait


@pytest.mark.parametrize("stage", ["generate", "tokenize", "train"])
def test_each_stage_has_its_own_durable(stage):
    spec = consumer_for(stage, "r1")
    assert spec.durable == f"{stage}-r1" and spec.filter_subject.startswith("dflash.r1.")


STUCK_SERVICE = """
import asyncio, logging, sys
from shared.bus import install_stop_signals

async def never_finishes_its_drain():
    await asyncio.Event().wait()

async def main():
    stop = asyncio.Event()
    install_stop_signals(stop, report_after_s=0.5)
    print("ready", flush=True)
    await stop.wait()
    await never_finishes_its_drain()

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
asyncio.run(main())
"""


@pytest.mark.stack  # runs a service in a subprocess
def test_a_stuck_shutdown_says_where_and_a_second_signal_exits() -> None:
    """A service that does not stop after SIGTERM logs the stacks it waits in; a second SIGTERM ends it.
    The report's wording is what this feature is (an operator reads it), so it is asserted."""
    import queue
    import signal
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen([sys.executable, "-c", STUCK_SERVICE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()

    def stderr_until(text: str) -> str:  # the report, whenever it comes (120 s only turns a hang into a failure)
        seen = ""
        while text not in seen:
            seen += lines.get(timeout=120)
        return seen

    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        report = stderr_until("never_finishes_its_drain")  # the waiting task's own frame
        assert proc.poll() is None  # stuck, as written
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        stderr_until("second SIGTERM: exiting without draining")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "still shutting down 0.5s after the stop signal" in report, report


async def test_a_worker_whose_bucket_is_gone_puts_its_message_back_and_halts_with_an_alert(cfg, bus):
    """S3 says the worker's bucket does not exist (deleted mid-run; refused credentials are the same case):
    no retry can help, so the message goes back untouched for a worker that can write, nothing is
    dead-lettered, the worker stops taking work with a critical Alert, and `work` raises Halt. Before,
    each message failed its deliveries one after another into the dead letters."""
    import msgspec

    from shared.store import Store

    gone = Store.open(msgspec.structs.replace(cfg, store=msgspec.structs.replace(cfg.store, bucket=f"gone-{cfg.run}")),
                      ensure_bucket=True)
    gone.client.remove_bucket(gone.bucket)
    spec = consumer_for("generate", cfg.run)
    for pid in ("a", "b"):
        await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, pid), msg_id=f"{cfg.run}:{pid}")

    async def read(d):  # as the tokenizer reads its completion shard (SeaweedFS re-creates a bucket on a PUT)
        await asyncio.to_thread(gone.get_bytes, f"completions/{d.data.prompt_id}")

    stats = WorkStats()
    with pytest.raises(Halt, match=f"bucket 'gone-{cfg.run}' does not exist"):
        await asyncio.wait_for(bus.work(spec, read, run=cfg.run, stop=asyncio.Event(), message_type=PromptTask,
                                        max_inflight=1, stats=stats), 60)
    assert stats.dead_lettered == 0 and stats.halted and await bus.dead_letters(cfg.run) == []
    alerts = [a async for _, a in bus.read_log("PROGRESS", Subjects.alert(cfg.run, "generate"), 1, Alert)]
    assert [(a.kind, a.severity) for a in alerts] == [("worker_halted", "critical")]
    assert "does not exist" in alerts[0].message

    seen = []  # a worker that can write gets both, the first on its second delivery

    async def record(d):
        seen.append((d.data.prompt_id, d.num_delivered))

    await run_worker(bus, spec, cfg.run, record, until=lambda s: s.acked == 2)
    assert sorted(seen) == [("a", 2), ("b", 1)]


async def test_a_worker_whose_consumer_was_deleted_recreates_it_and_goes_on(cfg, bus):
    """Someone deletes a stage's durable consumer under a running worker (an operator resetting a stage, a
    bench forgetting a run's training): the worker puts it back and keeps taking work. Before, every fetch
    met "no responders", a transient failure, retried forever: the worker hung and ignored SIGTERM's grace."""
    spec = consumer_for("generate", cfg.run)
    seen: list[str] = []

    async def handle(d):
        seen.append(d.data.prompt_id)

    stop = asyncio.Event()
    stats = WorkStats()
    worker = asyncio.create_task(bus.work(spec, handle, run=cfg.run, stop=stop, message_type=PromptTask, stats=stats))
    try:
        async with asyncio.timeout(60):
            await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "a"), msg_id=f"{cfg.run}:a")
            while stats.acked < 1:
                await asyncio.sleep(0.05)
            assert await bus.delete_consumer(spec.stream, spec.durable)
            await bus.publish(Subjects.prompts(cfg.run), task(cfg.run, "b"), msg_id=f"{cfg.run}:b")
            while stats.acked < 2:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
    assert seen == ["a", "b"] and stats.dead_lettered == 0
    assert await bus.consumer_state(spec.stream, spec.durable) is not None


@pytest.mark.stack  # kills and restarts its own nats-server
async def test_publish_many_through_a_server_kill_stores_each_message_once(tmp_path):
    """The feeder's bulk publish while its server is killed -9 and comes back: nats' async acks never time
    out by themselves, so an ack lost with the server used to hang the feed (or a publish refused while
    reconnecting ended it). Each item without an ack is published again with its message id: every prompt
    is stored exactly once and publish_many returns one ack per item."""
    import os
    import signal

    from shared.stack import EmbeddedStack, Ports
    from tests.conftest import make_config

    s = EmbeddedStack(tmp_path, Ports.free())
    s.start()
    try:
        cfg = make_config(s)
        n = 20_000
        async with await Bus.connect(cfg.bus, "pytest-publish-kill", deadline_s=10) as bus:
            await bus.ensure_streams()
            items = [(Subjects.prompts(cfg.run), task(cfg.run, f"p{i}"), f"{cfg.run}:p{i}") for i in range(n)]
            publishing = asyncio.create_task(bus.publish_many(items, window=500))
            await asyncio.sleep(0.3)
            assert not publishing.done(), "the publish ended before the kill: make it bigger"
            os.kill(s.pids.pop("nats"), signal.SIGKILL)
            await asyncio.sleep(1.0)
            s.start_nats()
            acks = await asyncio.wait_for(publishing, 120)
            assert len(acks) == n
            state = await bus.stream_state("PROMPTS")
            assert state is not None and state.last_seq - state.first_seq + 1 == n
    finally:
        s.stop()

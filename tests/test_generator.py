"""The generator on the real stack with the real SmolLM2 on CPU: write-then-ack, no loss, no silent duplicate."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.feeder.feed import Feeder
from services.generator.service import run_generator
from shared.bus import Bus
from shared.config import Config
from shared.exits import Exit
from shared.failures import Failure, classify
from shared.messages import ShardWritten
from shared.records import dedupe_completions, read_completions
from shared.status import format_status, run_status
from shared.store import Store
from shared.topology import Subjects
from tests.conftest import make_config

FAST = dict(generator={"max_inflight": 4, "batch_size": 4, "shard_records": 4, "shard_seconds": 2.0,
                       "ack_wait_s": 20.0, "max_deliver": 3, "drain_s": 20.0, "progress_every_s": 1.0},
            sampling={"max_new_tokens": 8, "temperature": 0.0})


def prompts_file(tmp_path: Path, n: int, tag: str = "") -> Path:
    path = tmp_path / f"prompts{tag}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say something short about the number {i}{tag}."}) + "\n"
                            for i in range(n)))
    return path


async def fed_ids(cfg: Config, bus: Bus, store: Store, src: Path) -> set[str]:
    from shared.messages import PromptTask

    await Feeder(cfg, bus, store).feed([str(src)])
    return {t.prompt_id async for _, t in bus.read_log("PROMPTS", Subjects.prompts(cfg.run), 1, PromptTask)}


async def shard_events(bus: Bus, run: str) -> list[ShardWritten]:
    return [e async for _, e in bus.read_log("SHARDS", Subjects.shards(run), 1, ShardWritten)]


async def completed_ids(bus: Bus, run: str) -> set[str]:
    return {pid for e in await shard_events(bus, run) for pid in e.prompt_ids}


async def wait_for(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await cond():
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def load_shards(store: Store, events: list[ShardWritten]):
    return [(e.key, read_completions(store.get_bytes(e.key))) for e in events]


async def test_end_to_end_in_process_then_status(stack, bus, store, tmp_path, target_dir):
    cfg = make_config(stack, **FAST)
    ids = await fed_ids(cfg, bus, store, prompts_file(tmp_path, 10))
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
    await wait_for(lambda: completed_ids_eq(bus, cfg.run, ids), 240, "all prompts completed")
    stop.set()
    stats = await asyncio.wait_for(worker, 120)
    assert stats.acked == 10 and stats.dead_lettered == 0

    events = await shard_events(bus, cfg.run)
    shards = load_shards(store, events)
    assert [e.key for e in events] == sorted(e.key for e in events)  # sequential keys, one worker
    records = [r for _, rs in shards for r in rs]
    assert {r.prompt_id for r in records} == ids and len(records) == 10
    for r in records:
        assert r.engine == "hf" and r.worker == "w0" and r.completion_tokens == len(r.output_ids) > 0
        assert r.finish_reason in ("stop", "length") and r.prompt_tokens > 10 and r.sampling_fingerprint
        assert r.messages[-1].role == "user"
    assert sum(e.num_records for e in events) == 10
    # the queue is empty: everything was acked only after its shard was written
    info = await bus.js.consumer_info("PROMPTS", f"generate-{cfg.run}")
    assert info.num_ack_pending == 0 and info.num_pending == 0

    st = await run_status(cfg, bus, store)
    assert (st.total, st.completed, st.in_flight, st.queued, st.eta_s) == (10, 10, 0, 0, 0.0)
    assert "completed   10 (100.0%)" in format_status(st)


async def completed_ids_eq(bus: Bus, run: str, ids: set[str]) -> bool:
    return await completed_ids(bus, run) == ids


async def test_the_last_shard_is_written_once_the_queue_runs_dry(stack, bus, store, tmp_path, target_dir):
    """Neither shard_records nor shard_seconds is reached: the buffer is written after shard_idle_s of
    an idle engine, not at the end of its ten minutes."""
    quiet = {**FAST, "generator": {**FAST["generator"], "shard_records": 100, "shard_seconds": 600.0,
                                   "shard_idle_s": 1.0}}
    cfg = make_config(stack, **quiet)
    ids = await fed_ids(cfg, bus, store, prompts_file(tmp_path, 6, "idle"))
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
    try:  # 240 s < shard_seconds: only the idle trigger can write the shard in time
        await wait_for(lambda: completed_ids_eq(bus, cfg.run, ids), 240, "all prompts in shards without a stop")
    finally:
        stopped_at = time.time()
        stop.set()
        await asyncio.wait_for(worker, 120)
    events = await shard_events(bus, cfg.run)
    assert {r.prompt_id for _, rs in load_shards(store, events) for r in rs} == ids
    assert events[-1].ts < stopped_at  # announced while the worker ran, not by the shutdown's flush


async def test_s3_down_keeps_shards_and_loses_nothing(stack, bus, store, tmp_path, target_dir):
    cfg = make_config(stack, **FAST)
    ids = await fed_ids(cfg, bus, store, prompts_file(tmp_path, 8, "s3"))
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
    await wait_for(lambda: _some(bus, cfg.run), 240, "a first shard")
    stack.stop_component("s3")
    try:
        await asyncio.sleep(8)  # generation goes on; shards cannot be written
        info = await bus.js.consumer_info("PROMPTS", f"generate-{cfg.run}")
        assert info.num_ack_pending > 0  # nothing acked while its shard is not in S3
    finally:
        stack.start_s3()
        stack.wait_healthy()
    await wait_for(lambda: completed_ids_eq(bus, cfg.run, ids), 240, "completion after S3 came back")
    stop.set()
    stats = await asyncio.wait_for(worker, 120)
    assert stats.dead_lettered == 0
    deduped = dedupe_completions(load_shards(store, await shard_events(bus, cfg.run)))
    assert set(deduped) == ids


async def _some(bus: Bus, run: str) -> bool:
    return bool(await shard_events(bus, run))


async def test_too_long_prompt_is_dead_lettered_with_reason_and_replays(stack, bus, store, tmp_path, target_dir):
    tight = {**FAST, "generator": {**FAST["generator"], "max_context_tokens": 60}}
    cfg = make_config(stack, **tight)
    src = tmp_path / "mixed.jsonl"
    src.write_text(json.dumps({"prompt": "Hi!"}) + "\n" + json.dumps({"prompt": "long " * 80}) + "\n")
    ids = await fed_ids(cfg, bus, store, src)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
    await wait_for(lambda: _letters(bus, cfg.run, 1), 240, "a dead letter")
    stop.set()
    await asyncio.wait_for(worker, 120)
    [(_, letter)] = await bus.dead_letters(cfg.run, "generate")
    assert "exceeds the context limit of 60" in letter.error
    assert len(await completed_ids(bus, cfg.run)) == 1

    # the operator fixes the limit and replays the dead letters: the prompt completes, once
    from services.generator.cli import register  # noqa: F401  (the CLI path is exercised below)

    roomy = make_config(stack, run=cfg.run, **FAST)
    assert await bus.replay_dead_letters(roomy.run, "generate") == 1
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(roomy, "w0", stop=stop))
    await wait_for(lambda: completed_ids_eq(bus, cfg.run, ids), 240, "the replayed prompt")
    stop.set()
    await asyncio.wait_for(worker, 120)
    assert await bus.dead_letters(cfg.run, "generate") == []


async def _letters(bus: Bus, run: str, n: int) -> bool:
    return len(await bus.dead_letters(run, "generate")) >= n


def _spawn(stack_env: dict, run: str, worker: str, log: Path) -> subprocess.Popen:
    env = {**stack_env, "DFLASH_GENERATOR__MAX_INFLIGHT": "4", "DFLASH_GENERATOR__BATCH_SIZE": "4",
           "DFLASH_GENERATOR__SHARD_RECORDS": "4", "DFLASH_GENERATOR__SHARD_SECONDS": "2",
           "DFLASH_GENERATOR__ACK_WAIT_S": "6", "DFLASH_SAMPLING__MAX_NEW_TOKENS": "12",
           "DFLASH_SAMPLING__TEMPERATURE": "0", "DFLASH_GENERATOR__PROGRESS_EVERY_S": "1"}
    return subprocess.Popen([sys.executable, "-m", "shared.cli", "generate", "--run", run, "--worker", worker],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
async def test_two_generators_split_a_run_and_survive_kill_9(stack, stack_env, bus, store, tmp_path, target_dir):
    cfg = make_config(stack, **FAST)
    ids = await fed_ids(cfg, bus, store, prompts_file(tmp_path, 32, "kill"))
    logs = {w: tmp_path / f"{w}.log" for w in ("a", "b")}
    procs = {w: _spawn(stack_env, cfg.run, w, logs[w]) for w in ("a", "b")}
    try:
        await wait_for(lambda: _worker_has_shard(bus, cfg.run, "a"), 240, "worker a's first shard")
        procs["a"].send_signal(signal.SIGKILL)  # mid-run: its unacked prompts must come back
        procs["a"].wait(10)
        procs["a"] = _spawn(stack_env, cfg.run, "a", logs["a"])
        await wait_for(lambda: completed_ids_eq(bus, cfg.run, ids), 300, "every fed prompt completed")
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for w, p in procs.items():
            assert p.wait(60) == 0, logs[w].read_text()[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    events = await shard_events(bus, cfg.run)
    assert {e.worker for e in events} == {"a", "b"}  # both took part
    shards = load_shards(store, events)
    assert set(dedupe_completions(shards)) == ids  # nothing lost; duplicates (if any) collapse by the rule
    keys = [e.key for e in events]
    assert len(keys) == len(set(keys))  # no shard announced twice
    info = await bus.js.consumer_info("PROMPTS", f"generate-{cfg.run}")
    assert info.num_ack_pending == 0 and info.num_pending == 0
    # progress counters go on across the restart: summed over workers they cover every shard written
    latest = {p.worker: p for _, p in await bus.latest_per_subject("PROGRESS", f"dflash.{cfg.run}.generate.progress.*")}
    assert sum(p.shards for p in latest.values()) == len(keys)
    assert sum(p.completions for p in latest.values()) >= sum(len(r) for _, r in shards)


async def _worker_has_shard(bus: Bus, run: str, worker: str) -> bool:
    return any(e.worker == worker for e in await shard_events(bus, run))


async def test_a_conversation_the_template_refuses_is_dead_lettered_at_once(stack, bus, store, tmp_path, target_dir):
    """A target template that raises on a conversation (here: two user turns in a row, refused the way
    Llama-2/Mistral templates refuse them) makes that prompt a dead letter on its first delivery, with the
    template's message; it is not retried, and the other prompts of its batch complete."""
    from tests.test_tokenizer_render import ALTERNATING

    guarded = tmp_path / "guarded-target"
    guarded.mkdir()
    for f in target_dir.iterdir():
        (guarded / f.name).symlink_to(f)
    (guarded / "chat_template.jinja").unlink()
    (guarded / "chat_template.jinja").write_text(ALTERNATING + (target_dir / "chat_template.jinja").read_text())
    cfg = make_config(stack, model={"target": str(guarded)}, **FAST)
    src = tmp_path / "mixed.jsonl"
    src.write_text(
        json.dumps({"prompt": "Say hi."}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Say hi."}]})
        + "\n" + json.dumps({"prompt": "Say bye."}) + "\n")
    await fed_ids(cfg, bus, store, src)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
    await wait_for(lambda: _letters(bus, cfg.run, 1), 240, "a dead letter")
    await wait_for(lambda: _completed_n(bus, cfg.run, 2), 240, "the two other prompts")
    stop.set()
    await asyncio.wait_for(worker, 120)
    [(_, letter)] = await bus.dead_letters(cfg.run, "generate")
    assert "chat template refused" in letter.error and "roles must alternate" in letter.error
    assert letter.num_delivered == 1


async def _completed_n(bus: Bus, run: str, n: int) -> bool:
    return len(await completed_ids(bus, run)) >= n


async def test_a_completion_that_cannot_be_stored_fails_alone_and_the_shard_is_written(stack, bus, store):
    """Arrow refuses text with a lone surrogate (an engine's JSON can carry one). That record's add() raises
    Poison (its prompt becomes a dead letter with the reason); the others of the shard are written and
    announced. Before, the whole shard's waiters hung (their prompts unacked, kept alive by heartbeats)."""
    from services.generator.shards import ShardWriter
    from shared.failures import Poison
    from shared.messages import ChatMessage
    from shared.records import CompletionRecord

    cfg = make_config(stack)
    writer = ShardWriter(bus, store, cfg.run, "w0", max_records=3, max_age_s=60.0)
    await writer.start()

    def record(pid: str, text: str) -> CompletionRecord:
        return CompletionRecord(run=cfg.run, prompt_id=pid, messages=[ChatMessage(role="user", content=pid)],
                                completion=text)

    try:
        results = await asyncio.wait_for(asyncio.gather(
            writer.add(record("a", "fine")), writer.add(record("bad", "broken \ud800 text")),
            writer.add(record("c", "also fine")), return_exceptions=True), 30)
    finally:
        await writer.close(timeout_s=10)
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], Poison) and "cannot be stored" in str(results[1]), results
    (event,) = await shard_events(bus, cfg.run)
    assert event.prompt_ids == ["a", "c"]
    assert [r.prompt_id for r in read_completions(store.get_bytes(event.key))] == ["a", "c"]


async def test_close_gives_up_on_a_shard_it_cannot_write_after_its_timeout(stack, bus, store):
    """S3 down at shutdown: close() stops retrying after its timeout instead of hanging the process (the
    records' prompts were nak'ed when their handlers were cancelled, so they come back)."""
    from services.generator.shards import ShardWriter
    from shared.messages import ChatMessage
    from shared.records import CompletionRecord

    cfg = make_config(stack)
    writer = ShardWriter(bus, store, cfg.run, "w1", max_records=100, max_age_s=60.0)
    await writer.start()
    pending = asyncio.create_task(writer.add(CompletionRecord(
        run=cfg.run, prompt_id="p", messages=[ChatMessage(role="user", content="q")], completion="a")))
    await asyncio.sleep(0.1)
    stack.stop_component("s3")
    try:
        flush = asyncio.create_task(writer.flush())  # takes the record, then retries while S3 is down
        await asyncio.sleep(1.0)
        assert not flush.done() and not pending.done()
        pending.cancel()  # what the bus does to a handler at the end of the grace period
        # close() returns while the write still fails: it gave up (60 s only turns a hang into a failure)
        await asyncio.wait_for(writer.close(timeout_s=2.0), timeout=60)
        assert not flush.done() and writer.shards_written == 0
        flush.cancel()
        await asyncio.gather(flush, pending, return_exceptions=True)
    finally:
        stack.start_s3()
        stack.wait_healthy()
    assert await shard_events(bus, cfg.run) == []  # nothing was announced that is not in S3


async def test_credentials_s3_refuses_fail_the_shards_records_instead_of_retrying_for_ever(stack, bus, store):
    """Credentials revoked mid-run: no retry can help. The shard's add()s fail with the error (their handlers
    put the prompts back and stop the worker, see test_bus), nothing is announced; before, the writer
    retried for ever with the prompts held."""
    from services.generator.shards import ShardWriter
    from shared.messages import ChatMessage
    from shared.records import CompletionRecord
    from shared.store import StoreAuthError

    cfg = make_config(stack)
    writer = ShardWriter(bus, store, cfg.run, "w2", max_records=2, max_age_s=60.0)
    await writer.start()
    writer.store = Store(cfg.store, "revoked-key", "revoked-secret")  # what S3 now says to this worker's keys
    try:
        results = await asyncio.wait_for(asyncio.gather(*(writer.add(CompletionRecord(
            run=cfg.run, prompt_id=p, messages=[ChatMessage(role="user", content=p)], completion="a")) for p in "ab"),
            return_exceptions=True), 30)
    finally:
        await writer.close(timeout_s=5)
    assert all(isinstance(r, StoreAuthError) and classify(r) is Failure.FATAL for r in results), results
    assert "check AWS_ACCESS_KEY_ID" in str(results[0])
    assert await shard_events(bus, cfg.run) == [] and writer.shards_written == 0


async def test_every_worker_of_a_run_can_hold_a_full_shard_of_prompts_at_once(stack, bus):
    """The consumer's cap on unacked messages is shared by all workers of the run. At its old default
    (256) two workers at the default shard size (256 records, 16 in the engine) could not both hold a
    shard's worth, so neither filled a shard. Two worker loops on the generator's own consumer settings,
    each holding every message it gets until both hold their full share."""
    from services.generator.service import prompt_consumer
    from shared.bus import WorkStats
    from shared.messages import ChatMessage, PromptTask

    cfg = make_config(stack, generator={"max_inflight": 16})  # a bound set by hand; one shard filling, one written
    spec, per_worker = prompt_consumer(cfg)
    assert per_worker == cfg.generator.max_inflight + 2 * cfg.generator.shard_records == 528
    n = 2 * per_worker
    await bus.publish_many([(Subjects.prompts(cfg.run), PromptTask(
        run=cfg.run, prompt_id=f"p{i}", messages=[ChatMessage(role="user", content=f"q{i}")]), f"{cfg.run}:p{i}")
        for i in range(n)])
    held: dict[str, int] = {"w0": 0, "w1": 0}
    all_held, stop = asyncio.Event(), asyncio.Event()

    def holder(worker: str):
        async def handle(d) -> None:  # a completion waiting in the shard buffer: unacked until the shard is written
            held[worker] += 1
            if sum(held.values()) == n:
                all_held.set()
            await all_held.wait()
        return handle

    workers = [asyncio.create_task(bus.work(spec, holder(w), run=cfg.run, stop=stop, message_type=PromptTask,
                                            max_inflight=per_worker, stats=WorkStats())) for w in held]
    try:
        await asyncio.wait_for(all_held.wait(), 60)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert held == {"w0": per_worker, "w1": per_worker}
    info = await bus.js.consumer_info(spec.stream, spec.durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_lost_or_altered_shard_is_generated_again_from_the_runs_own_sources(stack, stack_env, bus, store, tmp_path):
    """A completions shard lost after its prompts were acked (its object deleted, or truncated: the tokenizer
    dead-letters it) used to be unrecoverable: `replay generate --shard` needed the shard's own records. Its
    ShardWritten event's prompt ids are found again in the run's sources (the manifest's), queued as a new
    generation, regenerated, and every reader then has each prompt once; a second replay queues nothing."""
    from tests.test_boundaries import cli

    cfg = make_config(stack, generator={"backend": "synthetic", "shard_records": 4, "shard_seconds": 2.0,
                                        "max_inflight": 4, "progress_every_s": 1.0})
    ids = await fed_ids(cfg, bus, store, prompts_file(tmp_path, 12, "lost"))

    async def generate_until(done) -> None:
        stop = asyncio.Event()
        worker = asyncio.create_task(run_generator(cfg, "w0", stop=stop))
        try:
            await wait_for(done, 120, "the generation")
        finally:
            stop.set()
            await asyncio.wait_for(worker, 60)

    await generate_until(lambda: completed_ids_eq(bus, cfg.run, ids))
    events = await shard_events(bus, cfg.run)
    deleted, altered = events[0], events[1]
    store.delete(deleted.key)
    store.put_bytes(altered.key, store.get_bytes(altered.key)[:-64])
    for ev, why in ((deleted, "no object"), (altered, "sha256 differs")):
        r = cli(stack_env, "replay", "generate", "--run", cfg.run, "--shard", ev.key)
        assert r.returncode == 0, r.stdout + r.stderr
        assert why in r.stdout and "found again in" in r.stdout and str(tmp_path / "promptslost.jsonl") in r.stdout
        assert f"re-published {ev.num_records} prompt(s) of {ev.key} as generation 1 (0 already queued)" in r.stdout
    again = cli(stack_env, "replay", "generate", "--run", cfg.run, "--shard", deleted.key)
    assert f"re-published 0 prompt(s) of {deleted.key} as generation 1 ({deleted.num_records} already" in again.stdout
    stranger = cli(stack_env, "replay", "generate", "--run", cfg.run, "--shard", f"runs/{cfg.run}/completions/x/9.parquet")
    assert stranger.returncode == Exit.USAGE and "announced no completions shard" in stranger.stderr

    async def regenerated() -> bool:
        return len(await shard_events(bus, cfg.run)) > len(events) and \
            sum(e.num_records for e in (await shard_events(bus, cfg.run))[len(events):]) == 8

    await generate_until(regenerated)
    readable = [e for e in await shard_events(bus, cfg.run) if e.key not in (deleted.key, altered.key)]
    best = dedupe_completions(load_shards(store, readable))
    assert set(best) == ids
    lost_ids = set(deleted.prompt_ids) | set(altered.prompt_ids)
    assert {pid for pid, r in best.items() if r.generation == 1} == lost_ids

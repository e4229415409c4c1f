"""Readers of run state: the bus's read methods answer "not there" with None, the one log reader moves past a
message it cannot decode (and reads across batches), a one-shot command on an unreachable stack exits
UNREACHABLE in one line within its stated bound, and `dfpipe run` says how long the stack has not answered.
Failovers themselves are in tests/test_cluster.py and tests/chaos/test_chaos_cluster.py (a real cluster)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from services.pipeline.run import Unreachable
from shared.exits import Exit
from shared.failures import GaveUp
from shared.ledger import RunLedger
from shared.messages import ShardWritten
from shared.stack import free_port
from shared.topology import Subjects


def shard(run: str, i: int) -> ShardWritten:
    return ShardWritten(run=run, key=f"k{i}", worker="w", seq=i, num_records=1, prompt_ids=[f"p{i}"], sha256="0",
                        size_bytes=1)


async def test_missing_streams_consumers_and_messages_are_answers_not_errors(cfg, bus):
    assert await bus.stream_state("NO_SUCH_STREAM") is None
    assert await bus.consumer_state("PROMPTS", f"generate-{cfg.run}") is None  # no generator started yet
    assert await bus.consumer_states("NO_SUCH_STREAM") == []
    assert await bus.last_msg("SHARDS", Subjects.shards(cfg.run)) is None
    assert await bus.last_seq("NO_SUCH_STREAM") == 0
    state = await bus.stream_state("SHARDS")
    assert state is not None and state.created and state.last_seq >= state.first_seq - 1


async def test_the_log_reader_moves_past_an_undecodable_message_and_reads_across_batches(cfg, bus, store):
    subject = Subjects.shards(cfg.run)
    await bus.publish(subject, shard(cfg.run, 0))
    await bus.publish_raw(subject, b"\x00 not a message")
    for i in range(1, 6):
        await bus.publish(subject, shard(cfg.run, i))
    got = [m.key async for _, m in bus.read_log("SHARDS", subject, 1, ShardWritten, batch=2)]
    assert got == [f"k{i}" for i in range(6)]
    ledger = RunLedger(cfg, bus, store, use_snapshot=False)
    fold = await ledger.refresh()
    assert fold.completed == 6
    assert fold.cursor["SHARDS"] == (await bus.stream_state("SHARDS")).last_seq  # the bad one is not read again
    assert (await ledger.refresh()).completed == 6 and ledger.folded == 6


@pytest.mark.stack  # a subprocess
def test_status_on_an_unreachable_stack_exits_unreachable_in_one_line(stack_env):
    env = {**stack_env, "DFLASH_NATS_URL": f"nats://127.0.0.1:{free_port()}"}  # nothing listens there
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "shared.cli", "status", "--run", "anyrun"], env=env,
                         capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert out.returncode == Exit.UNREACHABLE, out.stderr
    assert "Traceback" not in out.stderr
    said = [line for line in out.stderr.splitlines() if line.startswith("dfpipe status:")]
    assert len(said) == 1 and "stack unreachable" in said[0] and "unreachable for 10s" in said[0], out.stderr
    assert took < 60, took  # the connection's bound (10 s) plus a Python start


def test_dfpipe_run_says_how_long_the_stack_has_not_answered(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    lines: list[str] = []
    unreachable = Unreachable(every_s=10.0)
    error = GaveUp("stream info SHARDS", 4, 30.0, TimeoutError("nats: timeout"))
    for t in (100.0, 104.0, 111.0, 125.0):
        now[0] = t
        unreachable.failed(error, lines.append)
    now[0] = 130.0
    unreachable.answered(lines.append)
    unreachable.answered(lines.append)  # only once
    assert len(lines) == 4, lines  # at most one line every 10 s while it lasts, one when it is back
    assert "stack unreachable for 0s" in lines[0] and "stack unreachable for 11s" in lines[1]
    assert "stack unreachable for 25s" in lines[2] and "services kept running" in lines[2]
    assert "reachable again after 30s" in lines[3]

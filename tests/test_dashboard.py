"""Dashboard logic on the real test stack: AppTest runs the page script against real events on NATS."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import state as sv
from dashboard.cli import is_local
from shared.bus import Bus, consumer_for
from shared.config import ViewConfig
from shared.ledger import Ledger, StageCounts
from shared.messages import (
    GeneratorProgress,
    PromptTask,
    ShardWritten,
    TokenizedShard,
    TokenizerProgress,
    decode,
    encode,
)
from shared.stack import EmbeddedStack, Ports, free_port
from shared.topology import Subjects
from shared.view import LedgerFacts, empty_facts
from tests.conftest import new_run
from tests.dashboard_events import SHARD_QUALITY, SILENT_WORKER, initial_events, publish, shard_events

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboard" / "app.py"


@pytest.fixture(autouse=True, scope="module")
def release_listeners() -> Iterator[None]:
    """The page's cached Listener threads stop with this module (as a server's would on release), not poll a
    stack that is gone until the process exits."""
    yield
    import streamlit as st

    st.cache_resource.clear()


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def wait_page(at: AppTest, ok: Callable[[AppTest], bool], timeout_s: float = 25.0) -> AppTest:
    """Re-run the page until `ok` (the listener folds events in the background), or fail showing the page."""
    deadline = time.monotonic() + timeout_s
    while True:
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        if ok(at):
            return at
        if time.monotonic() > deadline:
            raise AssertionError(f"page never got there: errors={texts(at.error)} info={texts(at.info)} "
                                 f"metrics={metrics(at)}")
        time.sleep(0.5)


async def dead_letter_one(bus: Bus, run: str) -> None:
    """A real dead letter: a malformed prompt through the real worker loop."""
    await bus.publish_raw(Subjects.prompts(run), b"\x93not a prompt")
    stop = asyncio.Event()

    async def handle(_d) -> None:
        raise AssertionError("a malformed payload must not reach the handler")

    task = asyncio.create_task(bus.work(consumer_for("generate", run), handle, run=run, stop=stop,
                                        message_type=PromptTask))
    for _ in range(100):
        if await bus.dead_letters(run):
            break
        await asyncio.sleep(0.1)
    stop.set()
    await task


# --- pure view model -------------------------------------------------------------------------------


def facts(log: Ledger | None) -> LedgerFacts:
    """A ledger's facts as the listener takes them (no manifest, dead letters or queue in these tests)."""
    if log is None:
        return empty_facts()
    c = log.counts()
    return LedgerFacts(counts=c, stages=StageCounts(False, 0, c.completed, 0, 0, 0, c.shards, c.tokenized_shards, 0),
                       manifest_accepted=None, manifest_rejected=0, dead_lettered={}, alerts=tuple(log.latest_alerts()))


def test_fold_real_events_into_view_model():
    now = time.time()
    events, ev = initial_events("r1", now)
    runs: dict[str, sv.RunState] = {}
    log = Ledger("r1")
    for _, msg in events:
        msg = decode(encode(msg))  # as they arrive on the wire
        log.add(msg) if isinstance(msg, ShardWritten | TokenizedShard) else sv.apply(runs, msg)
    rs, window = runs["r1"], ViewConfig()
    # From the shard events: unique prompts in S3 (the 5 written twice count once), shards tokenized.
    view = sv.run_view(rs, facts(log), now, window)
    totals = {t.stage: t for t in view.stages}
    assert (totals["feed"].done, totals["feed"].total) == (100, 100)
    assert (totals["generate"].done, totals["generate"].total) == (ev.generated, 100) == (58, 100)
    assert (totals["tokenize"].done, totals["tokenize"].total) == (ev.tokenized_shards, ev.shards) == (2, 3)
    assert (totals["train"].done, totals["train"].total) == (ev.step, ev.total_steps)
    # Over the window ending now: 30 prompts at now-100 (no point before it), 58 at now-10.
    assert totals["generate"].rate_per_s == pytest.approx((58 - 30) / 100, rel=0.01)
    assert totals["generate"].eta_s == pytest.approx((100 - 58) / ((58 - 30) / 100), rel=0.01)
    assert totals["tokenize"].rate_per_s == pytest.approx(1 / 90, rel=0.01)  # 1 at now-90, 2 at now-40
    # one shard left at that rate is 90 s, but tokenization cannot end before generation does
    assert totals["tokenize"].eta_s == pytest.approx(totals["generate"].eta_s)
    assert (totals["train"].rate_per_s, totals["train"].eta_s) == (0.5, 160.0)  # the trainer's own
    # Without shard events (none written yet): the workers' own counters and rates (gpu1 is silent: not counted).
    totals = {t.stage: t for t in sv.run_view(rs, None, now, window).stages}
    assert (totals["generate"].done, totals["generate"].total) == (ev.counted, 100)
    assert totals["generate"].rate_per_s == 0.35
    assert totals["generate"].eta_s == pytest.approx((100 - 65) / 0.35, rel=0.01)
    assert view.silent == [f"generate/{SILENT_WORKER}"]
    assert [w.state for w in view.workers if w.stage == "generate"] == ["running", "silent"]
    engine = view.engines[0]
    assert (engine.engine, engine.running, engine.queued, engine.fill, engine.concurrency) == (
        "http://gpu0:30000", 24, 3, 24 / 32, 27)
    assert view.training is not None and (view.training.step, view.training.loss) == (20, 4.25)
    reasons, truncated = sv.finish_reasons(rs)
    assert reasons == {"stop": 61, "length": 4} and truncated == pytest.approx(100 * 4 / 65)
    q = sv.quality_view(rs)  # no shard events: the tokenizer's counters
    assert q.histogram == [(0, 6), (64, 20), (256, 24)] and q.dropped == {"truncated": 4, "too_few_supervised": 2}
    assert q.gate_tripped and q.gate_alerts[0].examples and q.drift == 3
    q = sv.quality_view(rs, log.counts())  # the latest tokenized shard of each completion shard
    assert {k: getattr(q, k) for k in SHARD_QUALITY} == SHARD_QUALITY
    assert list(q.dropped) == ["below_min_supervised", "template_error", "duplicate"]  # most first
    assert q.gate_tripped and q.gate_alerts[0].examples
    assert sv.checkpoint_rows(rs)[0]["S3 key"] == ev.checkpoint_key
    assert sv.eval_rows(rs)[0]["τ"] == 2.1
    assert sv.elapsed_s(rs, now) == pytest.approx(900, abs=1)
    # The trainer's first report ('waiting for data': loss 0, τ 0) is no point of the loss and τ charts.
    assert [p["step"] for p in sv.trainer_series(rs)] == [10, 20]


def test_redeliveries_and_restarts_do_not_move_the_stage_counts():
    """Worker counters count a prompt twice when it was completed by a worker that died before writing
    its shard and then by another; the tokenizer's counters start at zero when it restarts. The
    shard events do neither."""
    run, now = "r2", time.time()
    runs: dict[str, sv.RunState] = {}
    log = Ledger("r")
    for _, msg in shard_events(run, now)[:2]:  # shards w0/0 (30 prompts) and w0/1 (20), then w0/0 tokenized
        log.add(msg)
    log.add(shard_events(run, now)[4][1])
    sv.apply(runs, GeneratorProgress(run=run, worker="w0", completions=60, shards=2, ts=now - 20))  # 10 unwritten
    sv.apply(runs, GeneratorProgress(run=run, worker="w1", completions=10, shards=0, ts=now - 5))  # ... done again
    sv.apply(runs, TokenizerProgress(run=run, worker="tok", shards=1, samples_in=30, ts=now - 30))
    sv.apply(runs, TokenizerProgress(run=run, worker="tok", shards=0, samples_in=0, ts=now - 5))  # restarted
    counted = {t.stage: t.done for t in sv.run_view(runs[run], None, now, ViewConfig()).stages}
    assert (counted["generate"], counted["tokenize"]) == (70, 0)  # what the counters alone show
    exact = {t.stage: t.done for t in sv.run_view(runs[run], facts(log), now, ViewConfig()).stages}
    assert (exact["generate"], exact["tokenize"]) == (50, 1)
    assert sv.quality_view(runs[run]).samples_in == 0  # the restarted tokenizer's counters
    q = sv.quality_view(runs[run], log.counts())
    assert (q.samples_in, q.samples_kept, q.dropped) == (30, 25, {"below_min_supervised": 5})
    # The same tokenized shard announced again from S3, by a tokenizer that wrote it before events carried
    # the numbers: nothing changes.
    first = shard_events(run, now)[4][1]
    log.add(msgspec.structs.replace(first, dropped={}, supervised_histogram={}, retokenization_drift=0, ts=now))
    assert sv.quality_view(runs[run], log.counts()) == q
    # A run tokenized before the events carried a histogram: the tokenizer's counters give it.
    old_log = Ledger("r")
    old_log.add(msgspec.structs.replace(first, supervised_histogram={}))
    sv.apply(runs, TokenizerProgress(run=run, worker="tok", shards=1, supervised_histogram={"64": 25}, ts=now - 1))
    assert sv.quality_view(runs[run], old_log.counts()).histogram == [(64, 25)]
    assert sv.quality_view(runs[run], log.counts()).histogram == sorted(
        (int(b), n) for b, n in first.supervised_histogram.items())  # the events', when they have one


def test_history_stays_bounded_and_keeps_the_latest():
    runs: dict[str, sv.RunState] = {}
    t0 = 1_000_000.0
    for i in range(sv.HISTORY_POINTS * 3):
        sv.apply(runs, GeneratorProgress(run="r", worker="w", completions=i, ts=t0 + i))
    ws = runs["r"].workers[("generate", "w")]
    assert len(ws.history) <= sv.HISTORY_POINTS
    assert ws.latest.completions == sv.HISTORY_POINTS * 3 - 1 and ws.history[-1].completions == ws.latest.completions
    assert ws.history[0].completions == 0  # thinning keeps the start of the run


# --- the page --------------------------------------------------------------------------------------


async def test_page_shows_counts_gate_silent_worker_and_dead_letters(stack, page_env, bus):
    run = new_run()
    events, ev = initial_events(run)
    await publish(bus, events)
    await dead_letter_one(bus, run)

    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params["run"] = run
    at = await asyncio.to_thread(wait_page, at, lambda a: metrics(a).get("generated") == f"{ev.generated} / 100"
                                 and any("dead letters" in t for t in texts(a.error)))
    m = metrics(at)
    assert m["fed"] == "100 / 100"
    assert m["tokenized shards"] == f"{ev.tokenized_shards} / {ev.shards}"
    assert m["trained (steps)"] == f"{ev.step} / {ev.total_steps}"
    assert m["samples in"] == f"{SHARD_QUALITY['samples_in']}" and m["samples kept"] == f"{ev.kept}"
    assert m["retokenization drift"] == f"{SHARD_QUALITY['drift']}"
    dropped = next(d.value for d in at.dataframe if "dropped" in d.value.columns)
    assert dict(zip(dropped["reason"], dropped["dropped"], strict=True)) == SHARD_QUALITY["dropped"]
    assert m["step"] == "20" and m["estimated τ"] == "1.90"
    assert (m["steps/s"], m["training ETA"]) == ("0.50", "2m 40s")
    assert m["truncated (finish_reason=length)"] == f"{100 * 4 / 65:.1f}%"
    errors = texts(at.error)
    assert any(e.startswith("Quality gate tripped: 38% of the last 50") for e in errors), errors
    assert any("OK.<|im_end|>" in c.value for c in at.code)
    assert any("Silent workers" in e and f"generate/{SILENT_WORKER}" in e for e in errors), errors
    assert "1 dead letters" in errors
    generators = at.dataframe[0].value
    assert list(generators["worker"]) == ["gpu0", SILENT_WORKER]
    assert list(generators["health"]) == ["ok", "SILENT"]
    tables = [d.value for d in at.dataframe]
    letters = next(t for t in tables if "reason" in t.columns and "deliveries" in t.columns)
    assert letters["reason"].iloc[0].startswith("malformed payload")
    assert any(ev.checkpoint_key in t.get("S3 key", []).tolist() for t in tables if "S3 key" in t.columns)
    assert m["NATS"] == "reachable"
    await asyncio.to_thread(wait_page, at, lambda a: metrics(a)["S3"] == "reachable")

    # Replay: a button, then a confirmation; it uses Bus.replay_dead_letters (the `dfpipe replay` path).
    at.button(key="replay").click()
    await asyncio.to_thread(at.run)
    assert any("back on their subjects" in w for w in texts(at.warning))
    assert await bus.dead_letters(run), "nothing is replayed before the confirmation"
    at.button(key="replay_confirm").click()
    await asyncio.to_thread(at.run)
    assert "Replayed 1 dead letters." in texts(at.success)
    assert await bus.dead_letters(run) == []
    raw = await bus.js.get_last_msg("PROMPTS", Subjects.prompts(run))
    assert raw.data == b"\x93not a prompt"  # back on its subject, byte for byte


async def test_page_follows_live_events(stack, page_env, bus):
    run = new_run()
    await bus.publish(Subjects.progress(run, "generate", "gpu0"),
                      GeneratorProgress(run=run, worker="gpu0", completions=3))
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params["run"] = run
    await asyncio.to_thread(wait_page, at, lambda a: metrics(a).get("generated") == "3")
    await bus.publish(Subjects.progress(run, "generate", "gpu0"),
                      GeneratorProgress(run=run, worker="gpu0", completions=11))
    await asyncio.to_thread(wait_page, at, lambda a: metrics(a).get("generated") == "11")


def test_nats_down_gives_a_clear_message_then_recovers(tmp_path, monkeypatch, stack):
    """A page pointed at a closed port says so (no traceback); when NATS comes up there, it recovers."""
    ports = Ports.free()
    monkeypatch.setenv("DFLASH_NATS_URL", f"nats://127.0.0.1:{ports.nats}")
    monkeypatch.setenv("DFLASH_S3_ENDPOINT", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("DFLASH_S3_BUCKET", "dflash")
    at = AppTest.from_file(str(APP), default_timeout=30)
    wait_page(at, lambda a: any("NATS is unreachable" in e for e in texts(a.error)))
    assert any("S3 is unreachable" in w for w in texts(at.warning))
    assert metrics(at)["NATS"] == "unreachable"

    late = EmbeddedStack(tmp_path / "late", ports)
    late.start_nats()
    try:
        late.wait_healthy(30, s3=False)
        wait_page(at, lambda a: not any("NATS" in e for e in texts(a.error))
                  and any("No run yet" in i for i in texts(a.info)))
        assert metrics(at)["NATS"] == "reachable"
    finally:
        late.stop_component("nats")


# --- the command -----------------------------------------------------------------------------------


def test_cli_refuses_a_non_local_bind_without_a_password(stack_env):
    env = {k: v for k, v in stack_env.items() if k != "DFLASH_DASHBOARD_PASSWORD"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "shared.cli", "dashboard", "--host", "0.0.0.0", "--port", "1"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "refusing to bind 0.0.0.0" in proc.stderr and "DFLASH_DASHBOARD_PASSWORD" in proc.stderr
    assert is_local("127.0.0.1") and is_local("::1") and is_local("localhost") and not is_local("0.0.0.0")


def test_password_is_asked_when_set(stack, page_env, monkeypatch):
    monkeypatch.setenv("DFLASH_DASHBOARD_PASSWORD", "s3cret-pw")
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    assert not at.metric and at.text_input[0].label == "Dashboard password"
    at.text_input[0].input("wrong").run()
    assert "Wrong password." in texts(at.error) and not at.metric
    at.text_input[0].input("s3cret-pw").run()
    assert not at.exception and at.metric  # the page itself

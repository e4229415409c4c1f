"""One view of a run: `dfpipe status` (text and --json), `dfpipe run`'s display and the dashboard show the same
numbers for one event sequence (real NATS and S3, the message types services publish); the window's rates,
the trainer's pace and the moved config key on their own."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import state as sv
from services.pipeline.run import Display, stage_lines
from services.trainer.pace import Pace
from shared.config import ConfigError, ViewConfig, load_config
from shared.exits import Exit
from shared.ledger import Ledger, RunLedger
from shared.messages import (
    Alert,
    FeederProgress,
    GeneratorProgress,
    Message,
    ShardWritten,
    TokenizedShard,
    TokenizerProgress,
    TrainerProgress,
)
from shared.status import format_status, run_overview, run_status
from shared.topology import Subjects
from shared.view import SCHEMA, RunView, duration, window_rates
from tests.test_dashboard import wait_page

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
WINDOW = ViewConfig().rate_window_s  # the default window: the page reads the environment's config, as a user's would


# --- the window, the pace, the key -------------------------------------------------------------------


def test_rates_are_over_the_window_ending_now() -> None:
    now = 10_000.0
    points = [(now - 1000, 30, 3000), (now - 60, 50, 5000), (now - 30, 58, 5800)]
    # the value at the window's start is the last point before it: 28 prompts in 300 s
    assert window_rates(points, now, 300) == pytest.approx((28 / 300, 2800 / 300))
    # no point before the window: from the first point in it, to now
    assert window_rates(points[1:], now, 300) == pytest.approx((8 / 60, 800 / 60))
    assert window_rates(points, now + 400, 300) == (0.0, 0.0)  # nothing for a whole window: stalled
    assert window_rates(points[:1], now, 300) is None  # one point says nothing


def test_the_trainers_pace_over_the_window_its_eta_and_its_log_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    pace = Pace(ViewConfig(rate_window_s=10.0, log_every_s=30.0), clock=lambda: clock[0])
    assert pace.observe(1, 100) == (0.0, None)  # a first step has no rate yet
    for step in range(2, 41):  # a step every 2 s, then every 0.5 s: the window sees the new pace only
        clock[0] += 2.0 if step <= 10 else 0.5
        rate, eta = pace.observe(step, 100)
    assert rate == pytest.approx(2.0, rel=0.06) and eta == pytest.approx(60 / rate)
    clock[0] += 0.5
    assert pace.observe(41, 100, budget_left_s=12.0)[1] == 12.0  # a time budget that ends first
    p = TrainerProgress(run="r", worker="trainer", step=21, total_steps=100, epoch=1, loss=3.25, estimated_tau=1.62,
                        steps_per_s=2.0, eta_s=39.5)
    with caplog.at_level(logging.INFO, logger="dflash.trainer"):
        assert pace.maybe_log(p)  # 34 s since the pace began
        assert not pace.maybe_log(p)  # not again within log_every_s
    assert caplog.messages == ["step 21 of 100 (epoch 1): loss 3.2500, estimated τ 1.62, 2.00 steps/s, ETA 39s"]


def test_the_old_dashboard_silence_key_names_its_new_place(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text("[dashboard]\nport = 8502\nsilent_after_s = 30\n")
    with pytest.raises(ConfigError, match=r"line 3: config key 'dashboard.silent_after_s' is now 'view.silent_after_s'"):
        load_config(old, env={})
    new = tmp_path / "new.toml"
    new.write_text("[view]\nsilent_after_s = 30\nrate_window_s = 120\n")
    assert (load_config(new, env={}).view.silent_after_s, load_config(new, env={}).view.rate_window_s) == (30, 120)


def test_the_ledger_snapshot_keeps_the_rate_points_and_token_totals() -> None:
    log = Ledger("r")
    for _, e in events("r", 10_000.0):
        if isinstance(e, ShardWritten | TokenizedShard):
            log.add(e)
    again = Ledger.decode(log.encode(), "r")
    assert again.counts() == log.counts() and again.completion_tokens == log.completion_tokens == 6300
    assert log.counts().completed_points[-1] == (10_000.0 - 30, 58, 6300)


# --- one event sequence, three views ----------------------------------------------------------------


def events(run: str, now: float) -> list[tuple[str, Message]]:
    """A run mid-way: every in-window point is recent and the one before the window is far back, so the rates
    and ETAs stay the same for the four minutes the views take to be read (a constant over the window)."""

    def written(key: str, first: int, n: int, ts: float) -> ShardWritten:
        return ShardWritten(run=run, key=f"runs/{run}/completions/{key}.parquet", worker=key.split("/")[0], seq=0,
                            num_records=n, prompt_ids=[f"p{i}" for i in range(first, first + n)], sha256="0" * 64,
                            size_bytes=1000, completion_tokens=100 * n, ts=ts)

    def tokenized(source: ShardWritten, samples: int, ts: float) -> TokenizedShard:
        return TokenizedShard(run=run, key=source.key.replace("completions", "tokenized/fp"), source_key=source.key,
                              fingerprint="fp", num_samples=samples, num_tokens=100, num_supervised=50, sha256="0" * 64,
                              dropped={"below_min_supervised": source.num_records - samples}, ts=ts)

    a, b, c = written("gpu0/0", 0, 30, now - 1000), written("gpu0/1", 30, 20, now - 60), written("gpu1/0", 45, 13, now - 30)
    return [
        (Subjects.progress(run, "feed", "feeder"),
         FeederProgress(run=run, worker="feeder", read=100, accepted=100, published=100, done=True, ts=now - 1100)),
        (Subjects.progress(run, "generate", "gpu0"),
         GeneratorProgress(run=run, worker="gpu0", completions=50, completion_tokens_per_s=210.0,
                           completions_per_s=0.3, in_flight=8, shards=2, engine="http://gpu0:30000", engine_running=24,
                           engine_queued=3, engine_max_running=32, engine_tokens_per_s=1800.0, concurrency=27,
                           ts=now - 2)),
        (Subjects.progress(run, "generate", "gpu1"),  # went quiet 15 minutes ago
         GeneratorProgress(run=run, worker="gpu1", completions=13, completion_tokens_per_s=150.0, shards=1,
                           engine="http://gpu1:30000", engine_running=8, engine_max_running=32, ts=now - 900)),
        (Subjects.progress(run, "tokenize", "tok0"),
         TokenizerProgress(run=run, worker="tok0", fingerprint="fp", shards=2, samples_in=50, samples_kept=40,
                           ts=now - 5)),
        (Subjects.progress(run, "train", "trainer"),
         TrainerProgress(run=run, worker="trainer", state="waiting for data", ts=now - 120)),
        (Subjects.progress(run, "train", "trainer"),
         TrainerProgress(run=run, worker="trainer", step=20, total_steps=100, epoch=0, loss=4.25, estimated_tau=1.9,
                         tokens_per_s=950.0, samples_seen=30, steps_per_s=0.5, eta_s=160.0, ts=now - 3)),
        (Subjects.alert(run, "generate"),
         Alert(run=run, stage="generate", kind="slow_engine", severity="warning", worker="gpu0",
               message="engine http://gpu0:30000 answers slowly", ts=now - 20)),
        (Subjects.shards(run), a), (Subjects.shards(run), b), (Subjects.shards(run), c),
        (Subjects.tokenized(run), tokenized(a, 25, now - 990)), (Subjects.tokenized(run), tokenized(b, 18, now - 50)),
    ]


# What every view must show for those events (unique prompts 58 of 100: 28 in the window of 300 s).
GEN_RATE, TOKENS_RATE = 28 / WINDOW, (20 + 13) * 100 / WINDOW  # 33 records in the window, 5 of them again
GEN_ETA = (100 - 58) / GEN_RATE
TOK_RATE = 1 / WINDOW  # one shard tokenized in the window; one left, but not before generation ends
TRAIN_ETA = 160.0


def numbers(v: RunView) -> dict[str, Any]:
    """Every number a view shows, with rates to 1e-9 and ETAs to the millisecond (two reads differ in `now`)."""
    return {
        "counts": (v.total, v.completed, v.shards, v.tokenized_shards, v.tokenized_samples, v.failed, v.trainer_step),
        "stages": [(s.stage, s.done, s.total, round(s.rate_per_s, 9), None if s.eta_s is None else round(s.eta_s, 3))
                   for s in v.stages],
        "generation": (round(v.completions_per_s, 9), round(v.completion_tokens_per_s, 6)),
        "training": msgspec.to_builtins(v.training),
        "silent": v.silent,
        "engines": msgspec.to_builtins(v.engines),
        "alerts": [(a.stage, a.kind, a.message) for a in v.alerts],
        "workers": [(w.stage, w.worker, w.state, w.done) for w in v.workers],
    }


@pytest.fixture(autouse=True, scope="module")
def release_listeners() -> Iterator[None]:
    yield
    import streamlit as st

    st.cache_resource.clear()


async def test_status_the_run_display_and_the_dashboard_show_one_set_of_numbers(
        stack, stack_env, page_env, cfg, bus, store, capsys) -> None:
    run = cfg.run
    for subject, msg in events(run, time.time()):
        await bus.publish(subject, msg)

    # dfpipe status, in process (the view itself) and as the command prints it (--json, text)
    v = await run_status(cfg, bus, store)
    expected = numbers(v)
    gen, tok, train = v.stage("generate"), v.stage("tokenize"), v.stage("train")
    assert (gen.done, gen.total, tok.done, tok.total, train.done, train.total) == (58, 100, 2, 3, 20, 100)
    assert gen.rate_per_s == pytest.approx(GEN_RATE) and gen.eta_s == pytest.approx(GEN_ETA)
    assert v.completion_tokens_per_s == pytest.approx(TOKENS_RATE)
    assert tok.rate_per_s == pytest.approx(TOK_RATE) and tok.eta_s == pytest.approx(GEN_ETA)
    assert (train.rate_per_s, train.eta_s) == (0.5, TRAIN_ETA)
    assert v.silent == ["generate/gpu1"] and [e.engine for e in v.engines] == ["http://gpu0:30000"]
    assert v.engines[0].fill == 24 / 32
    env = {**stack_env, "DFLASH_RUN": run}
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "shared.cli", "status", "--run", run, "--json"],
                                  env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == Exit.OK, out.stderr  # a warning is no critical alert
    shown = msgspec.json.decode(out.stdout, type=RunView)
    assert shown.schema == SCHEMA and numbers(shown) == expected
    text = format_status(v)
    for line in (f"  ETA         {duration(GEN_ETA)}", "0.09 prompts/s (last 300s)",
                 f"2/3 shards, 0.2 shards/min, ETA {duration(GEN_ETA)}",
                 f"  trainer     step 20 of 100, loss 4.250, τ≈1.90, 0.50 steps/s, ETA {duration(TRAIN_ETA)}",
                 "  SILENT      generate/gpu1", "http://gpu0:30000: running 24/32 (fill 75%), queued 3, 1800 tok/s",
                 "ALERT [warning] generate/slow_engine"):
        assert line in text, text

    # dfpipe run's display: its own ledger and read, the same numbers, and the line it prints off a terminal
    overview = await run_overview(cfg, bus, store, RunLedger(cfg, bus, store))
    assert numbers(overview.view) == expected
    lines = {line.name: line for line in stage_lines(overview.view, overview.stages)}
    assert [(n, line.done, line.total) for n, line in lines.items()] == [
        ("fed", 100, 100), ("generated", 58, 100), ("tokenized", 2, 3), ("trained", 20, 100)]
    assert f"ETA {duration(GEN_ETA)}" in lines["generated"].note and "5.6 prompts/min" in lines["generated"].note
    assert lines["tokenized"].note == f"43 samples, 0.2 shards/min, ETA {duration(GEN_ETA)}"
    assert lines["trained"].note == f"step 20 of 100, loss 4.250, τ≈1.90, 0.50 steps/s, ETA {duration(TRAIN_ETA)}"
    capsys.readouterr()
    with Display(cfg, enabled=False) as display:
        display.update(overview, {"tokenizer": "running"})
    printed = capsys.readouterr().out
    assert "generated 58/100" in printed and lines["trained"].note in printed, printed

    # the dashboard: its listener's ledger and the workers' latest events, rendered by the page
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.query_params["run"] = run
    at = await asyncio.to_thread(wait_page, at, lambda a: {m.label: m.value for m in a.metric}.get(
        "tokenized shards") == "2 / 3" and any("slow_engine" in w.value for w in a.warning), 30.0)
    m = {x.label: x.value for x in at.metric}
    assert (m["fed"], m["generated"], m["tokenized shards"], m["trained (steps)"]) == (
        "100 / 100", "58 / 100", "2 / 3", "20 / 100")
    assert (m["generation ETA"], m["completions/s"]) == (sv.fmt_duration(GEN_ETA), f"{GEN_RATE:.2f}")
    assert (m["step"], m["loss"], m["estimated τ"], m["steps/s"], m["training ETA"]) == (
        "20", "4.2500", "1.90", "0.50", sv.fmt_duration(TRAIN_ETA))
    bars = [p.text for p in at.get("progress")]
    assert bars[1] == f"58.0% · 5.6 prompts/min · ETA {sv.fmt_duration(GEN_ETA)}", bars
    assert bars[2] == f"66.7% · 0.2 shards/min · ETA {sv.fmt_duration(GEN_ETA)}", bars
    assert bars[3] == f"20.0% · 0.50 steps/s · ETA {sv.fmt_duration(TRAIN_ETA)}", bars
    errors = [e.value for e in at.error]
    assert any(e.startswith("Silent workers") and "generate/gpu1 (" in e for e in errors), errors
    assert not any("gpu0" in e for e in errors if e.startswith("Silent")), errors
    engines = next(d.value for d in at.dataframe if "fill" in d.value.columns)
    assert (list(engines["engine"]), list(engines["fill"]), list(engines["queued"])) == (
        ["http://gpu0:30000"], ["75%"], [3])
    generators = next(d.value for d in at.dataframe if "completion tok/s" in d.value.columns)
    assert list(generators["health"]) == ["ok", "SILENT"]

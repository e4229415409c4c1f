"""A real browser on the real page: `dfpipe dashboard` (a Streamlit server) against the live test stack,
loaded by Debian's chromium headless through Python Playwright, while the test publishes a small run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.messages import GeneratorProgress, Message, ShardWritten
from shared.stack import free_port
from shared.topology import Subjects
from tests.conftest import make_config, new_run
from tests.dashboard_events import SILENT_WORKER, initial_events, publish

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

playwright_sync = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Debian's chromium (apt-get install chromium)")


def publish_now(stack, events: list[tuple[str, Message]]) -> None:
    async def go() -> None:
        async with await Bus.connect(make_config(stack).bus, "pytest-browser", deadline_s=10) as bus:
            await bus.ensure_streams()
            await publish(bus, events)

    # Its own thread: sync Playwright runs an event loop in this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, go()).result(timeout=30)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"dfpipe dashboard exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200 and r.read().strip() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"dashboard not healthy after {timeout_s}s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def dashboard(stack_env, tmp_path) -> Iterator[tuple[str, str]]:
    """The real `dfpipe dashboard --run R` on a free port; yields (url, run)."""
    run, port = new_run(), free_port()
    env = {k: v for k, v in stack_env.items() if k != "DFLASH_DASHBOARD_PASSWORD"}
    env["PYTHONPATH"] = str(ROOT)
    log = tmp_path / "dashboard.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "dashboard", "--run", run, "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url, run
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


METRICS_JS = """els => els.map(e => [
  e.querySelector('[data-testid="stMetricLabel"]').innerText.trim(),
  e.querySelector('[data-testid="stMetricValue"]').innerText.trim()])"""


def page_metrics(page) -> dict[str, str]:
    return dict(page.eval_on_selector_all('[data-testid="stMetric"]', METRICS_JS))


def wait_metric(page, label: str, value: str, timeout_s: float = 30.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        shown = page_metrics(page)
        if shown.get(label) == value:
            return shown
        if time.monotonic() > deadline:
            raise AssertionError(f"{label!r} never showed {value!r}; page shows {shown}")
        page.wait_for_timeout(300)


def test_browser_shows_the_published_run_live(stack, dashboard, tmp_path):
    url, run = dashboard
    events, ev = initial_events(run)
    publish_now(stack, events)

    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="domcontentloaded")
            page.get_by_role("heading", name="Run overview").wait_for(timeout=60_000)
            shown = wait_metric(page, "generated", f"{ev.generated} / {ev.prompts}")
            assert shown["fed"] == f"{ev.prompts} / {ev.prompts}"
            assert shown["tokenized shards"] == f"{ev.tokenized_shards} / {ev.shards}"
            assert shown["trained (steps)"] == f"{ev.step} / {ev.total_steps}"

            # Live: gpu0 writes a shard of 15 new prompts; the open page follows without a reload.
            publish_now(stack, [(Subjects.progress(run, "generate", "gpu0"),
                                 GeneratorProgress(run=run, worker="gpu0", completions=55, completion_tokens=11000,
                                                   completion_tokens_per_s=210.0, prompt_tokens_per_s=105.0,
                                                   in_flight=8, shards=3, finish_reasons={"stop": 50, "length": 5})),
                                (Subjects.shards(run),
                                 ShardWritten(run=run, key=f"runs/{run}/completions/gpu0/00000003.parquet",
                                              worker="gpu0", seq=3, num_records=15,
                                              prompt_ids=[f"new{i}" for i in range(15)], sha256="0" * 64,
                                              size_bytes=1000))])
            wait_metric(page, "generated", f"{ev.generated + 15} / {ev.prompts}")

            body = page.inner_text("body")
            assert "Quality gate tripped: 38% of the last 50 samples" in body
            assert f"generate/{SILENT_WORKER}" in body and "Silent workers" in body
            assert "Traceback" not in body
            page.get_by_text(ev.checkpoint_key).first.wait_for(state="attached", timeout=10_000)  # grid cell
            # Streamlit scrolls inside its own container: a tall viewport shows the whole page.
            page.set_viewport_size({"width": 1400, "height": 3300})
            page.wait_for_timeout(2000)  # let the charts draw
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 20_000
    out = ROOT / "tests" / "output"
    out.mkdir(exist_ok=True)
    shutil.copy(shot, out / "dashboard.png")


def test_browser_follows_a_real_run(stack, stack_env, dashboard, tmp_path):
    """The page open while `dfpipe run` really feeds, generates (SmolLM2 on CPU) and tokenizes; at the
    end its counts equal the run's own numbers read from the bus and S3."""
    from shared.messages import TokenizedShard
    from shared.status import run_status
    from shared.store import Store
    from tests.test_run import TINY

    url, run = dashboard
    bundled = ROOT / "services/pipeline/data/prompts.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(bundled.read_text().splitlines()[100:110]) + "\n")
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "--config", str(config), "run", "--prompts", str(prompts),
             "--run", run, "--no-train", "--no-dashboard", "--plain"],
            env={**stack_env, "DFLASH_MODEL__DEVICE": "cpu"}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        with playwright_sync.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url, wait_until="domcontentloaded")  # opened before the run has published anything
                page.get_by_role("heading", name="Run overview").wait_for(timeout=60_000)
                assert proc.wait(600) == 0, log.read_text()[-3000:]

                async def truth() -> tuple[int, int, int, int]:
                    cfg = make_config(stack, run)
                    async with await Bus.connect(cfg.bus, "pytest-truth", deadline_s=10) as bus:
                        st = await run_status(cfg, bus, Store.open(cfg))
                        tokenized = len({e.source_key async for _, e in
                                         bus.read_log("TOKENIZED", Subjects.tokenized(run), 1, TokenizedShard)})
                    return st.total, st.completed, st.shards, tokenized

                with ThreadPoolExecutor(1) as pool:
                    total, completed, shards, tokenized = pool.submit(asyncio.run, truth()).result(timeout=30)
                assert total == 10 and completed == 10 and tokenized == shards > 0
                shown = wait_metric(page, "generated", f"{completed} / {total}", timeout_s=60)
                assert shown["fed"] == f"{total} / {total}"
                shown = wait_metric(page, "tokenized shards", f"{tokenized} / {shards}", timeout_s=60)
                body = page.inner_text("body")
                assert "Traceback" not in body and "gen0" in body
                page.set_viewport_size({"width": 1400, "height": 3300})
                page.wait_for_timeout(1500)
                page.screenshot(path=str(tmp_path / "real-run.png"), full_page=True)
            finally:
                browser.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = ROOT / "tests" / "output"
    out.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "real-run.png", out / "dashboard-real-run.png")

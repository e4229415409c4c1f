"""Durable writes: the embedded stack and compose run nats-server with JetStream fsync before every ack
(`stack.nats_sync = "always"`), and another interval is what the server reports when asked for one.

What these check is the setting the running server reports (its /varz), not a power cut: a kill -9 keeps
the page cache, so only pulling the power (not possible here) tells the two settings apart. The cost of
the setting is measured by bench/bus.py (fsync always vs nats-server's 2-minute default, same run)."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import yaml

from shared.config import ConfigError, load_config
from shared.stack import EmbeddedStack, Ports, find_binary, free_port

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "docker" / "nats" / "dflash.conf"


def test_nats_sync_defaults_to_always_and_refuses_what_nats_server_would_misread() -> None:
    assert load_config(env={}).stack.nats_sync == "always"
    assert load_config(env={"DFLASH_STACK__NATS_SYNC": "2m"}).stack.nats_sync == "2m"
    for bad in ("sometimes", "2 min", "-1s"):
        with pytest.raises(ConfigError, match=r"stack\.nats_sync"):
            load_config(env={"DFLASH_STACK__NATS_SYNC": bad})


def test_compose_runs_nats_from_its_config_file_with_fsync_always_by_default() -> None:
    nats = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["nats"]
    assert nats["command"][:2] == ["-c", "/etc/nats/dflash.conf"]
    assert "./docker/nats/dflash.conf:/etc/nats/dflash.conf:ro" in nats["volumes"]
    assert nats["environment"]["DFLASH_NATS_SYNC"] == "${DFLASH_NATS_SYNC:-always}"
    assert "sync_interval: $DFLASH_NATS_SYNC" in CONF.read_text() and "store_dir: /data" in CONF.read_text()


def _varz_sync(monitor_port: int, deadline_s: float = 20) -> tuple[bool, float]:
    """(sync_always, sync_interval in seconds) as the server reports them."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/varz", timeout=2) as r:
                config = msgspec.json.decode(r.read())["jetstream"]["config"]
            return bool(config.get("sync_always")), config["sync_interval"] / 1e9
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_the_embedded_stack_fsyncs_always(stack) -> None:
    assert stack.nats_sync == "always" and stack.nats_sync_in_effect() == "always"
    assert _varz_sync(stack.ports.nats_monitor)[0] is True


@pytest.mark.stack
@pytest.mark.parametrize(("asked", "expected"), [("2m", (False, 120.0)), ("500ms", (False, 0.5))])
def test_an_interval_is_the_interval_nats_server_runs(tmp_path, asked, expected) -> None:
    """"2m" written unquoted into a nats-server config is 2,000,000 seconds: the stack quotes it."""
    s = EmbeddedStack(tmp_path, Ports.free(), nats_sync=asked)
    s.start_nats()
    try:
        s.wait_healthy(30, s3=False)
        assert _varz_sync(s.ports.nats_monitor) == expected
    finally:
        s.stop()


@pytest.mark.stack
@pytest.mark.parametrize(("value", "expected"), [("always", (True, 120.0)), ("120s", (False, 120.0))])
def test_the_compose_config_file_runs_on_the_real_nats_server(tmp_path, value, expected) -> None:
    """docker/nats/dflash.conf with the compose service's own flags, on the nats-server the image carries."""
    conf = tmp_path / "dflash.conf"
    conf.write_text(CONF.read_text().replace("store_dir: /data", f"store_dir: {tmp_path / 'data'}"))
    port, monitor = free_port(), free_port()
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen([find_binary("nats-server"), "-c", str(conf), "-js", "-m", str(monitor), "-a",
                                 "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "DFLASH_NATS_SYNC": value})
    try:
        assert _varz_sync(monitor) == expected, (tmp_path / "nats.log").read_text()
    finally:
        proc.terminate()
        proc.wait(10)

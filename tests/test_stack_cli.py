"""`dfpipe stack up | status | down` as a user runs it: real processes, data kept across restarts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import StoreConfig
from shared.stack import EmbeddedStack, Ports, _pid_alive
from shared.store import Store

pytestmark = pytest.mark.stack  # each test starts stacks through the CLI


def dfpipe(args, env):
    return subprocess.run([sys.executable, "-m", "shared.cli", *args], env=env, capture_output=True, text=True, timeout=120)


def test_up_status_down_up_keeps_data(tmp_path):
    p = Ports.free()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "AWS_"))}
    env.update(DFLASH_DATA_DIR=str(tmp_path), DFLASH_STACK__NATS_PORT=str(p.nats),
               DFLASH_STACK__NATS_MONITOR_PORT=str(p.nats_monitor), DFLASH_STACK__S3_PORT=str(p.s3),
               DFLASH_STACK__WEED_PORT_BASE=str(p.weed_base))
    try:
        up = dfpipe(["stack", "up"], env)
        assert up.returncode == 0, up.stderr
        assert f"127.0.0.1:{p.nats}" in up.stdout and f"127.0.0.1:{p.s3}" in up.stdout
        creds = tmp_path / "credentials"
        assert oct(creds.stat().st_mode & 0o777) == "0o600"
        st = dfpipe(["stack", "status"], env)
        assert st.returncode == 0 and st.stdout.count("healthy") == 2, st.stdout
        stack = EmbeddedStack.load(tmp_path)
        pids = dict(stack.pids)
        key, secret = (line.split("=", 1)[1] for line in creds.read_text().split())
        Store(StoreConfig(endpoint=stack.s3_endpoint, bucket="dflash"), key, secret).put_bytes("kept", b"day one")

        down = dfpipe(["stack", "down"], env)
        assert down.returncode == 0
        assert not any(_pid_alive(pid, name) for name, pid in (("nats-server", pids["nats"]), ("weed", pids["s3"])))
        assert dfpipe(["stack", "status"], env).returncode == 1

        assert dfpipe(["stack", "up"], env).returncode == 0
        stack = EmbeddedStack.load(tmp_path)
        assert Store(StoreConfig(endpoint=stack.s3_endpoint, bucket="dflash"), key, secret).get_bytes("kept") == b"day one"
    finally:
        dfpipe(["stack", "down"], env)


def test_external_stack_starts_nothing(tmp_path):
    env = {**os.environ, "DFLASH_NATS_URL": "nats://10.0.0.1:4222", "DFLASH_DATA_DIR": str(tmp_path)}
    out = dfpipe(["stack", "up"], env)
    assert out.returncode == 0 and "nothing to start" in out.stdout
    assert not Path(tmp_path, "stack.json").exists()


def test_wrong_config_key_fails_at_start(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[stack]\nnats_prot = 1\n")
    out = dfpipe(["--config", str(bad), "stack", "status"], {**os.environ, "DFLASH_DATA_DIR": str(tmp_path)})
    assert out.returncode == 2 and "unknown config key 'stack.nats_prot'" in out.stderr

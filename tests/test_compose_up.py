"""`docker compose --profile cpu up` for real: the whole pipeline in containers, checked through `dfpipe status`.

Images come from tests/compose_images.sh (no registry needed). The run is tiny (40 of the bundled prompts,
16 new tokens, 4 training steps of a 1-layer drafter). After it finishes the stack goes `down` (volumes kept)
and `up` again, and nothing may be produced twice. Everything the test made is removed at the end.
Skipped where no dockerd answers or the tools are missing (.ci/run installs and starts them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.config import load_config
from shared.stack import free_port
from shared.store import Store

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 40
RUN = "composetest"
TIMEOUT_S = 1800


def _docker_answers() -> bool:
    if not (shutil.which("docker") and shutil.which("docker-compose") and shutil.which("debootstrap")):
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


# Opt-in (DFPIPE_COMPOSE_TEST=1): this run has not yet passed end to end on the 2-core CI machine, where vfs
# storage copies the 2.6 GB services image into every container; until it has, it stays out of .ci/run.
OPTED_IN = os.environ.get("DFPIPE_COMPOSE_TEST") == "1"
pytestmark = [pytest.mark.stack, pytest.mark.compose, pytest.mark.slow,
              pytest.mark.skipif(not OPTED_IN, reason="opt-in: set DFPIPE_COMPOSE_TEST=1 (and start dockerd)"),
              pytest.mark.skipif(OPTED_IN and not _docker_answers(), reason="no dockerd, docker-compose or debootstrap here")]


def _log(msg: str) -> None:
    print(f"[compose {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ComposeProject:
    def __init__(self, env_file: Path, name: str) -> None:
        self.base = ["docker-compose", "--env-file", str(env_file), "-p", name, "-f", str(ROOT / "compose.yaml"),
                     "--profile", "cpu"]

    def __call__(self, *args: str, check: bool = True) -> str:
        r = subprocess.run([*self.base, *args], capture_output=True, text=True, cwd=ROOT)
        if check and r.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: {r.stderr[-3000:]}")
        return r.stdout

    def states(self) -> dict[str, dict]:
        out = self("ps", "-a", "--format", "json")
        rows = [json.loads(line) for line in out.splitlines() if line.strip()] if not out.startswith("[") else json.loads(out)
        return {r["Service"]: r for r in rows}

    def wait_done(self, service: str, timeout_s: float) -> dict[str, dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.states()
            s = st.get(service)
            if s and s["State"] == "exited":
                return st
            time.sleep(10)
        _log(self("logs", "--tail", "30", check=False)[-6000:])
        raise AssertionError(f"{service} did not finish within {timeout_s:.0f}s")


def _status(env: dict[str, str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "shared.cli", "status", "--run", RUN, "--json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _s3_keys(env: dict[str, str]) -> list[str]:
    cfg = load_config(None, env)
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update({k: env[k] for k in old})
    try:
        store = Store.open(cfg, ensure_bucket=False)
        return sorted(store.list(f"runs/{RUN}/"))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_compose_cpu_profile_runs_the_pipeline_and_resumes_without_redoing(tmp_path: Path):
    t0 = time.monotonic()
    build = subprocess.run(["bash", str(ROOT / "tests" / "compose_images.sh")], capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable}, cwd=ROOT, timeout=2400)
    assert build.returncode == 0, build.stderr[-3000:]
    images = (ROOT / ".compose-build" / "images.env").read_text()
    _log(f"images ready in {time.monotonic() - t0:.0f}s:\n{images}")

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    bundled = (ROOT / "services/pipeline/data/prompts.jsonl").read_text().splitlines()
    (prompts / "small.jsonl").write_text("\n".join(bundled[:PROMPTS]) + "\n")
    (prompts / "run.toml").write_text(
        "[sampling]\nmax_new_tokens = 16\n[generator]\nshard_seconds = 5.0\n"
        "[trainer]\nmax_steps = 4\ncheckpoint_every = 2\neval_prompts = 2\neval_max_new_tokens = 16\n"
        "anchors_per_sequence = 16\n")
    os.chmod(prompts, 0o755)
    ports = {"DFLASH_NATS_PORT": free_port(), "DFLASH_S3_PORT": free_port(), "DFLASH_DASHBOARD_PORT": free_port()}
    secrets = {"AWS_ACCESS_KEY_ID": "compose" + os.urandom(4).hex(), "AWS_SECRET_ACCESS_KEY": os.urandom(18).hex(),
               "DFLASH_DASHBOARD_PASSWORD": os.urandom(8).hex()}
    env_file = tmp_path / "compose.env"
    env_file.write_text(images + "".join(f"{k}={v}\n" for k, v in {
        **ports, **secrets, "DFLASH_PROMPTS_DIR": prompts, "DFLASH_PROMPTS": "/prompts/small.jsonl",
        "DFLASH_CONFIG": "/prompts/run.toml", "DFLASH_MAX_NEW_TOKENS": 16, "DFLASH_RUN": RUN}.items()))
    env_file.chmod(0o600)
    client_env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
                  "DFLASH_NATS_URL": f"nats://127.0.0.1:{ports['DFLASH_NATS_PORT']}",
                  "DFLASH_S3_ENDPOINT": f"127.0.0.1:{ports['DFLASH_S3_PORT']}", "DFLASH_S3_BUCKET": "dflash",
                  "AWS_ACCESS_KEY_ID": secrets["AWS_ACCESS_KEY_ID"],
                  "AWS_SECRET_ACCESS_KEY": secrets["AWS_SECRET_ACCESS_KEY"]}
    compose = ComposeProject(env_file, f"dfpipe-test-{os.getpid()}")
    try:
        t1 = time.monotonic()
        compose("up", "-d")
        states = compose.wait_done("eval-cpu", TIMEOUT_S)
        _log(f"first run finished in {time.monotonic() - t1:.0f}s")
        for name, s in sorted(states.items()):
            _log(f"  {name:14} {s['State']:8} {s.get('Health', '') or ''} {s.get('Status', '')}")
        for name in ("nats", "seaweedfs", "dashboard"):
            assert states[name].get("Health") == "healthy", (name, states[name])
        for name in ("feeder", "trainer-cpu", "eval-cpu"):
            assert states[name]["State"] == "exited" and states[name]["ExitCode"] == 0, (name, states[name])

        first = _status(client_env)
        keys = _s3_keys(client_env)
        checkpoints = sorted({k.split("/")[3] for k in keys if "/checkpoints/" in k})
        _log(f"status: fed {first['total']} completed {first['completed']} shards {first['shards']} "
             f"samples {first['tokenized_samples']} trainer step {first['trainer_step']} "
             f"checkpoints {checkpoints} eval report {f'runs/{RUN}/eval/report.json' in keys}")
        assert first["total"] == PROMPTS and first["completed"] == PROMPTS
        assert first["tokenized_samples"] > 0 and first["trainer_step"] and first["trainer_step"] > 0
        assert checkpoints and f"runs/{RUN}/eval/report.json" in keys

        compose("down")  # containers and network; the volumes stay
        compose("up", "-d")
        compose.wait_done("eval-cpu", TIMEOUT_S)
        second = _status(client_env)
        keys_after = _s3_keys(client_env)
        redone = sorted(set(keys_after) - set(keys))
        _log(f"after down/up: completed {second['completed']} records {second['completion_records']} "
             f"shards {second['shards']} tokenized shards {second['tokenized_shards']} step {second['trainer_step']}; "
             f"new S3 objects {redone}")
        for field in ("total", "completed", "completion_records", "shards", "tokenized_shards",
                      "tokenized_samples", "trainer_step"):
            assert second[field] == first[field], (field, first[field], second[field])
        assert not [k for k in redone if "/completions/" in k or "/tokenized/" in k or "/checkpoints/" in k]
        _log(f"compose test wall time {time.monotonic() - t0:.0f}s")
    finally:
        compose("down", "-v", "--remove-orphans", check=False)

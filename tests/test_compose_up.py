"""`docker compose --profile cpu up` for real: the whole pipeline in containers, checked through `dfpipe status`.

Images come from tests/compose_images.sh (no registry needed). The run is tiny (40 of the bundled prompts,
32 new tokens, 4 training steps of a 1-layer drafter). After it finishes the stack goes `down` (volumes kept)
and `up` again, and nothing may be produced twice. Everything the test made is removed at the end.
Runs wherever a dockerd answers (DOCKER_HOST; .ci/run installs and starts one); skipped, saying what is
missing, where none does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.config import load_config
from shared.stack import free_port
from shared.store import Store
from shared.topology import Keys

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 40
NEW_TOKENS = 32
RUN = "composetest"
TIMEOUT_S = 900  # per run (measured here: 73-222 s, by the load of the shared 2 cores); the image build has its own 2400 s


def _missing() -> str:
    """Why the compose run cannot happen here ("" when it can)."""
    tools = [t for t in ("docker", "docker-compose", "debootstrap") if not shutil.which(t)]
    if tools:
        return f"not installed: {', '.join(tools)} (.ci/run installs them)"
    try:
        answers = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        answers = False
    if not answers:
        return f"no dockerd answers at {os.environ.get('DOCKER_HOST', 'the default socket')} (.ci/run starts one)"
    return ""


MISSING = _missing()
pytestmark = [pytest.mark.compose, pytest.mark.slow, pytest.mark.stack, pytest.mark.skipif(bool(MISSING), reason=MISSING)]


def _log(msg: str) -> None:
    print(f"[compose {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class ComposeProject:
    def __init__(self, env_file: Path, name: str) -> None:
        self.base = ["docker-compose", "--env-file", str(env_file), "-p", name, "-f", str(ROOT / "compose.yaml"),
                     "--profile", "cpu"]
        # The shell's values would win over the env file's: none of the project's variables come from it.
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("DFLASH_", "AWS_")) and k not in ("NATS_IMAGE", "SEAWEEDFS_IMAGE")}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, cwd=ROOT, env=self.env)

    def __call__(self, *args: str, check: bool = True) -> str:
        r = self.run(*args)
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
            time.sleep(5)
        _log(self("logs", "--tail", "30", check=False)[-6000:])
        raise AssertionError(f"{service} did not finish within {timeout_s:.0f}s")


def _status(env: dict[str, str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "shared.cli", "status", "--run", RUN, "--json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@contextlib.contextmanager
def _store(env: dict[str, str]) -> Iterator[Store]:
    """The compose stack's bucket, opened with its credentials (Store.open reads them from os.environ)."""
    cfg = load_config(None, env)
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update({k: env[k] for k in old})
    try:
        yield Store.open(cfg, ensure_bucket=False)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _s3_objects(env: dict[str, str]) -> dict[str, tuple[str, object]]:
    """The run's objects, each with (etag, last-modified): a rewrite of the same key changes the second."""
    with _store(env) as store:
        return {o.object_name: (o.etag, o.last_modified)
                for o in store.client.list_objects(store.bucket, prefix=f"runs/{RUN}/", recursive=True)}


def _eval_report(env: dict[str, str]) -> dict:
    with _store(env) as store:
        return json.loads(store.get_bytes(Keys.eval_report(RUN)))


@pytest.mark.timeout(2400 + 2 * TIMEOUT_S + 300)  # over the 600 s default: a cold build, then two runs
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
        # 32 new tokens cut most answers, so truncated samples are kept (the default drops them, and then
        # nothing is left to train on); a 1-layer drafter with 8-token blocks, so 8 supervised tokens suffice.
        f"[sampling]\nmax_new_tokens = {NEW_TOKENS}\n[generator]\nshard_seconds = 5.0\n"
        "[tokenizer]\ntruncated_policy = \"keep\"\nmin_supervised_tokens = 8\n"
        "[trainer]\nnum_layers = 1\nblock_size = 8\nmax_steps = 4\ncheckpoint_every = 2\neval_prompts = 2\n"
        "eval_max_new_tokens = 16\nanchors_per_sequence = 16\n")
    os.chmod(prompts, 0o755)
    ports = {"DFLASH_NATS_PORT": free_port(), "DFLASH_S3_PORT": free_port(), "DFLASH_DASHBOARD_PORT": free_port()}
    secrets = {"AWS_ACCESS_KEY_ID": "compose" + os.urandom(4).hex(), "AWS_SECRET_ACCESS_KEY": os.urandom(18).hex(),
               "DFLASH_DASHBOARD_PASSWORD": os.urandom(8).hex()}
    env_file = tmp_path / "compose.env"
    env_file.write_text(images + "".join(f"{k}={v}\n" for k, v in {
        **ports, **secrets, "DFLASH_PROMPTS_DIR": prompts, "DFLASH_PROMPTS": "/prompts/small.jsonl",
        "DFLASH_CONFIG": "/prompts/run.toml", "DFLASH_MAX_NEW_TOKENS": NEW_TOKENS, "DFLASH_RUN": RUN}.items()))
    env_file.chmod(0o600)
    client_env = {**{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
                  "DFLASH_NATS_URL": f"nats://127.0.0.1:{ports['DFLASH_NATS_PORT']}",
                  "DFLASH_S3_ENDPOINT": f"127.0.0.1:{ports['DFLASH_S3_PORT']}", "DFLASH_S3_BUCKET": "dflash",
                  "AWS_ACCESS_KEY_ID": secrets["AWS_ACCESS_KEY_ID"],
                  "AWS_SECRET_ACCESS_KEY": secrets["AWS_SECRET_ACCESS_KEY"]}
    project = f"dfpipe-test-{os.getpid()}"
    compose = ComposeProject(env_file, project)
    try:
        # The dashboard's password rule: compose refuses to start without one and names it, and the dashboard
        # itself refuses to bind 0.0.0.0 (as it does in its container) with an empty one.
        no_password = tmp_path / "no-password.env"
        no_password.write_text("".join(line + "\n" for line in env_file.read_text().splitlines()
                                       if not line.startswith("DFLASH_DASHBOARD_PASSWORD=")))
        refused = ComposeProject(no_password, project).run("config", "--quiet")
        assert refused.returncode != 0 and "DFLASH_DASHBOARD_PASSWORD" in refused.stderr, refused.stderr
        empty = compose.run("run", "--rm", "--no-deps", "-e", "DFLASH_DASHBOARD_PASSWORD=", "dashboard")
        assert empty.returncode == 2 and "DFLASH_DASHBOARD_PASSWORD" in empty.stderr, (empty.returncode, empty.stderr)
        _log(f"dashboard password rule: compose refuses without it, the dashboard exits {empty.returncode} "
             "with an empty one")

        t1 = time.monotonic()
        compose("up", "-d")
        states = compose.wait_done("eval-cpu", TIMEOUT_S)
        _log(f"first run finished in {time.monotonic() - t1:.0f}s")
        for name, s in sorted(states.items()):
            _log(f"  {name:14} {s['State']:8} {s.get('Health', '') or ''} {s.get('Status', '')}")
        for name in ("nats", "seaweedfs", "dashboard"):
            assert states[name].get("Health") == "healthy", (name, states[name])
        for name in ("feeder", "trainer-cpu", "eval-cpu"):
            assert states[name]["State"] == "exited" and states[name]["ExitCode"] == 0, \
                (name, states[name], compose("logs", "--tail", "40", name, check=False)[-4000:])

        first = _status(client_env)
        objects = _s3_objects(client_env)
        checkpoints = sorted({k.split("/")[3] for k in objects if "/checkpoints/" in k})
        report = _eval_report(client_env) if Keys.eval_report(RUN) in objects else {}
        _log(f"status: fed {first['total']} completed {first['completed']} shards {first['shards']} "
             f"samples {first['tokenized_samples']} trainer step {first['trainer_step']} checkpoints {checkpoints}; "
             f"eval report: { {k: v for k, v in report.items() if isinstance(v, int | float | str)} }")
        assert first["total"] == PROMPTS and first["completed"] == PROMPTS
        assert first["tokenized_samples"] > 0 and first["trainer_step"] and first["trainer_step"] > 0
        assert checkpoints and report

        compose("down")  # containers and network; the volumes stay
        compose("up", "-d")
        compose.wait_done("eval-cpu", TIMEOUT_S)
        second = _status(client_env)
        after = _s3_objects(client_env)
        produced = ("/completions/", "/tokenized/", "/checkpoints/", "/eval/")
        rewritten = sorted(k for k, v in after.items() if any(p in k for p in produced) and objects.get(k) != v)
        _log(f"after down/up: completed {second['completed']} records {second['completion_records']} "
             f"shards {second['shards']} tokenized shards {second['tokenized_shards']} step {second['trainer_step']}; "
             f"S3 objects under completions/, tokenized/, checkpoints/, eval/ new or rewritten: {rewritten}")
        for field in ("total", "completed", "completion_records", "shards", "tokenized_shards",
                      "tokenized_samples", "trainer_step"):
            assert second[field] == first[field], (field, first[field], second[field])
        assert not rewritten
        _log(f"compose test wall time {time.monotonic() - t0:.0f}s")
    finally:
        compose("down", "-v", "--remove-orphans", check=False)

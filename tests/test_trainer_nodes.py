"""The trainer across machines: two torchrun launchers on localhost (`--nnodes 2`, c10d rendezvous, gloo), each
a "node" of one rank with its own local data cache, as two machines would run it.

One two-node run checks both: the steps before the kill are two nodes' uninterrupted steps, and they equal one
process's with the same global batch; then a rank's process is killed (SIGKILL, after the first checkpoint),
torchrun (`--max-restarts 1`) restarts both ranks, and they resume exactly from that checkpoint: every step
after it, the redone ones included, equals the single process's too. Not a hang: the surviving rank's collective fails on the
closed connection and its launcher restarts it in the next rendezvous round."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shared.stack import free_port
from shared.store import Store
from tests.conftest import make_config, new_run
from tests.test_trainer import (
    _env,
    _latest_step,
    _spawn,
    progress_history,
    publish_tokenized,
    trainer_progress,
)

# fp32 (bf16 rounding would turn the all-reduce's summation order into loss differences that say nothing
# about data parallelism); scheduled by epochs, so both schedules count every rank's micro-batches; a
# checkpoint every 3 steps, so a kill after the first leaves steps to redo
STEPS = {"max_steps": 0, "epochs": 1, "checkpoint_every": 3, "token_budget": 120, "autocast": "off"}
TIMEOUT_S = 600
# torch's opt-out of sharing the rendezvous TCP store with the workers. Shared (its default), the store outlives
# a restart: the restarted ranks' gloo handshake read the previous round's addresses (a dead rank's port) and
# failed, and torchrun gave up ("Connection refused ... connectFullMesh failed", torch 2.13, measured here).
# Not shared, rank 0 hosts a fresh store at a fresh port every round.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def two_nodes(env: dict, run: str, tmp_path: Path, name: str, *, max_restarts: int = 0) -> list[subprocess.Popen]:
    """Two launchers of one rank each meeting at a c10d rendezvous on 127.0.0.1; node 0 hosts its store."""
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = []
    for node in (0, 1):
        node_env = {**env, "DFLASH_RUN": run, "DFLASH_TRAINER__DATA_CACHE_DIR": str(tmp_path / f"{name}-cache{node}"),
                    **RESTARTABLE}
        log = open(tmp_path / f"{name}-node{node}.log", "ab")  # noqa: SIM115 - the launcher writes it until it exits
        launchers.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run,
             "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", str(max_restarts),
             "--monitor-interval", "0.5", "-m", "shared.cli", "train"],
            env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    return launchers


def wait_all(launchers: list[subprocess.Popen], tmp_path: Path, name: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for node, p in enumerate(launchers):
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, (node, (tmp_path / f"{name}-node{node}.log").read_text()[-4000:])
    finally:
        for p in launchers:  # a failed assertion or a timeout leaves nothing running
            if p.poll() is None:
                p.kill()
                p.wait()


def worker_of(launcher: subprocess.Popen) -> psutil.Process:
    """The launcher's trainer process (its rank), not the launcher."""
    for child in psutil.Process(launcher.pid).children(recursive=True):
        if "shared.cli" in child.cmdline():
            return child
    raise AssertionError("the launcher has no trainer process")


@pytest.mark.stack
def test_two_nodes_match_one_process_and_a_killed_rank_resumes_exactly(stack, stack_env, tmp_path: Path) -> None:
    run_one, run_kill = new_run(), new_run()
    for run in (run_one, run_kill):
        publish_tokenized(stack, run)
    one = _spawn(_env(stack_env, grad_accum=2, **STEPS), run_one, tmp_path / "one.log", "train")
    assert one.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "one.log").read_text()[-3000:]
    h1 = progress_history(stack, run_one)
    assert sorted(h1) == list(range(1, len(h1) + 1)) and len(h1) >= 6

    # two nodes, 2 ranks x 1 micro-batch = one process's 2; kill -9 the second node's rank once the first
    # checkpoint is in S3; torchrun restarts both ranks
    env = _env(stack_env, grad_accum=1, **STEPS)
    store = Store.open(make_config(stack, run_kill))
    launchers = two_nodes(env, run_kill, tmp_path, "kill", max_restarts=1)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while _latest_step(store, run_kill) < STEPS["checkpoint_every"]:
            assert all(p.poll() is None for p in launchers), (tmp_path / "kill-node0.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        victim = worker_of(launchers[1])
        victim.send_signal(signal.SIGKILL)
        killed_at, checkpoint = time.time(), _latest_step(store, run_kill)
    except BaseException:
        for p in launchers:
            p.kill()
            p.wait()
        raise
    wait_all(launchers, tmp_path, "kill")
    assert checkpoint < len(h1), "the run ended before the kill: nothing was resumed"
    after = [p for p in trainer_progress(stack, run_kill) if p.ts > killed_at]
    assert after[0].state == "resumed" and after[0].step == checkpoint, after[0]
    assert next(p.step for p in after if p.state == "running") == checkpoint + 1
    assert after[-1].state == "done" and {p.resumes for p in after} == {1}
    h2 = progress_history(stack, run_kill)
    assert sorted(h2) == sorted(h1)
    for step in h1:  # before the kill: two nodes step for step; after it: an exact resume, redone steps included
        assert h2[step].total_steps == h1[step].total_steps, step
        assert h2[step].loss == pytest.approx(h1[step].loss, rel=1e-4), step
        assert h2[step].samples_seen == h1[step].samples_seen, step
    launcher_log = (tmp_path / "kill-node1.log").read_text()
    assert "failed (exitcode: -9)" in launcher_log, launcher_log[-3000:]  # torchrun saw the kill and restarted

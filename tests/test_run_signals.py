"""Stopping `dfpipe run` stops everything it started, and the same command resumes with nothing redone; two
trainers never train one run at once (the run's lease).

Real parts: a real `dfpipe run` on the test stack (synthetic generator, the real target, a one-layer drafter), real
signals, process groups and ports checked with psutil, S3 objects compared by etag and last-modified.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from shared.bus import Bus, Lease, LeaseHeld
from shared.exits import Exit
from shared.messages import TrainerProgress
from shared.stack import free_port, port_free
from shared.status import run_status
from shared.store import Store
from shared.topology import ANY, Keys, Subjects, lease_key
from tests.conftest import make_config, new_run

# Slow enough synthetic generation (40 prompts at 1/s) to be stopped in the middle, a training long enough to be
# stopped three times: every piece the smallest that still runs each phase for real.
SMALL = """
[sampling]
max_new_tokens = 16
temperature = 0.0
[generator]
backend = "synthetic"
synthetic_min_tokens = 12
synthetic_max_tokens = 24
synthetic_rate = {rate}
shard_records = 4
shard_seconds = 1
drain_s = 2
[tokenizer]
truncated_policy = "keep"
min_supervised_tokens = 4
[trainer]
num_layers = 1
block_size = 4
anchors_per_sequence = 8
max_steps = 16
checkpoint_every = 1000
token_budget = 160
max_length = 96
holdout_mod = 8
eval_prompts = 2
eval_max_new_tokens = 8
lease_ttl_s = 3
[dashboard]
port = {port}
"""

# objects written once and never again; the pointers (latest.json, the ledger's snapshot, manifest and rejects
# of a re-fed source, the eval report) are rewritten by design
WRITE_ONCE = ("completions/", "tokenized/", "checkpoints/step-")


def _objects(store: Store, run: str) -> dict[str, tuple[str, object]]:
    prefix = Keys.run(run)
    out = {}
    for obj in store.client.list_objects(store.bucket, prefix, recursive=True):
        rel = obj.object_name[len(prefix):]
        if rel.startswith(WRITE_ONCE):
            out[obj.object_name] = (obj.etag, obj.last_modified)
    return out


def _shards(store: Store, run: str) -> int:
    """Completion shards written so far (a cheap look at generation's progress)."""
    return sum(1 for _ in store.list(Keys.completions_prefix(run)))


def _completed(cfg, store: Store) -> int:
    """Prompts completed, as the run's ledger says."""
    async def read() -> int:
        async with await Bus.connect(cfg.bus, "pytest-signals", deadline_s=10) as bus:
            return (await run_status(cfg, bus, store)).completed
    return asyncio.run(read())


def _trainer_step(cfg, run: str, running: bool = True) -> int:
    """The step of the trainer's latest progress event (`running`: only while it trains; else 0)."""
    async def read() -> int:
        async with await Bus.connect(cfg.bus, "pytest-signals", deadline_s=10) as bus:
            await bus.ensure_streams()  # the run may not have made them yet
            latest = await bus.latest_per_subject("PROGRESS", Subjects.progress(run, "train", ANY), timeout_s=0.5)
        return max([p.step for _, p in latest if isinstance(p, TrainerProgress)
                    and (p.state == "running" or not running)] or [0])
    return asyncio.run(read())


def _start(stack_env: dict, run: str, prompts: Path, config: Path, dashboard: bool) -> subprocess.Popen:
    argv = [sys.executable, "-m", "shared.cli", "--config", str(config), "run", "--prompts", str(prompts),
            "--run", run, "--plain"] + ([] if dashboard else ["--no-dashboard"])
    return subprocess.Popen(argv, env={**stack_env, "DFLASH_MODEL__DEVICE": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_when(proc: subprocess.Popen, ready, signals: list[signal.Signals], what: str,
               timeout_s: float = 240) -> tuple[int, str, list[psutil.Process], set[int]]:
    """Send `signals` (0.3 s apart) once `ready()` holds; (exit code, output, every process the run had started,
    their process groups)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"dfpipe run ended before {what}:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"never reached {what}"
        time.sleep(1)
    started = _descendants(proc)
    assert started, "dfpipe run had no service running"
    groups = set()
    for p in started:
        with contextlib.suppress(psutil.NoSuchProcess):
            groups.add(os.getpgid(p.pid))
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.3)
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out, started, groups - {os.getpgid(0)}


def _assert_nothing_left(started: list[psutil.Process], groups: set[int], ports: list[int], out: str) -> None:
    deadline = time.monotonic() + 10  # a process killed with its group is reaped by init shortly after
    while time.monotonic() < deadline:
        left = [f"{p.pid} {' '.join(p.cmdline()[:6])}" for p in started if _alive(p)]
        groups_left = [g for g in groups if _group_exists(g)]
        if not left and not groups_left:
            break
        time.sleep(0.2)
    assert not left and not groups_left, f"left running: {left}, process groups {groups_left}\n{out[-3000:]}"
    for port in ports:
        assert port_free("127.0.0.1", port), f"port {port} still held\n{out[-3000:]}"


class _Run:
    """One run of the small config, stopped and started again by the tests; remembers every write-once object."""

    def __init__(self, stack, stack_env: dict, tmp_path: Path, rate: float) -> None:
        bundled = Path(__file__).parents[1] / "services/pipeline/data/prompts.jsonl"
        self.prompts = tmp_path / "prompts.jsonl"
        self.prompts.write_text("\n".join(bundled.read_text().splitlines()[:40]) + "\n")
        self.port = free_port()
        self.config = tmp_path / "small.toml"
        self.config.write_text(SMALL.format(port=self.port, rate=rate))
        self.stack, self.env, self.run = stack, stack_env, new_run()
        self.cfg = make_config(stack, self.run)
        self.store = Store.open(self.cfg)
        self.kept: dict[str, tuple[str, object]] = {}

    def start(self, dashboard: bool) -> subprocess.Popen:
        return _start(self.env, self.run, self.prompts, self.config, dashboard)

    def command(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "shared.cli", "--config", str(self.config), "run", "--prompts", str(self.prompts),
             "--run", self.run, "--plain", "--no-dashboard", *extra], env={**self.env, "DFLASH_MODEL__DEVICE": "cpu"},
            capture_output=True, text=True, timeout=600)

    def check_nothing_rewritten(self) -> None:
        now = _objects(self.store, self.run)
        assert {k: now.get(k) for k in self.kept} == self.kept, "an object was rewritten"
        self.kept = now


@pytest.mark.stack
def test_each_signal_mid_generation_stops_every_service_and_the_rerun_redoes_nothing(
        stack, stack_env, tmp_path: Path) -> None:
    r = _Run(stack, stack_env, tmp_path, rate=1.0)
    for n, sig in enumerate((signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):  # the first with the dashboard up
        proc = r.start(dashboard=n == 0)
        before = _shards(r.store, r.run)
        rc, out, started, groups = _stop_when(proc, lambda before=before: _shards(r.store, r.run) > before, [sig],
                                              "generation")
        assert rc == Exit.STOPPED, f"{sig.name}: exit {rc}\n{out[-3000:]}"
        assert f"run stopped by {sig.name}: every service it started has stopped" in out, out[-3000:]
        _assert_nothing_left(started, groups, [r.port] if n == 0 else [], out)
        assert _completed(r.cfg, r.store) < 40, "generation finished before the stop: nothing tested mid-generation"
        r.check_nothing_rewritten()  # the stop before this one's: none of its shards made again


@pytest.mark.stack
def test_each_signal_mid_training_stops_every_service_a_second_kills_at_once_and_the_rerun_redoes_nothing(
        stack, stack_env, tmp_path: Path) -> None:
    r = _Run(stack, stack_env, tmp_path, rate=0.0)  # the first start generates and tokenizes, then trains
    steps = 0
    for n, sigs in enumerate(([signal.SIGTERM], [signal.SIGINT], [signal.SIGHUP, signal.SIGTERM])):
        proc = r.start(dashboard=n == 0)
        before = steps
        rc, out, started, groups = _stop_when(proc, lambda before=before: _trainer_step(r.cfg, r.run) > before, sigs,
                                              "training", timeout_s=400)
        assert rc == Exit.STOPPED, f"{[s.name for s in sigs]}: exit {rc}\n{out[-3000:]}"
        if len(sigs) == 2:
            assert f"second {sigs[1].name}: every service killed" in out, out[-3000:]
        else:
            assert f"run stopped by {sigs[0].name}: every service it started has stopped" in out, out[-3000:]
            log = (stack.root / "runs" / r.run / "logs" / "trainer.log").read_text()
            assert log.count(f"lease trainer.{r.run} released") == n + 1, log[-3000:] + out[-3000:]  # not lapsed
        _assert_nothing_left(started, groups, [r.port] if n == 0 else [], out)
        steps = _trainer_step(r.cfg, r.run, running=False)
        r.check_nothing_rewritten()
    assert any("/checkpoints/step-" in k for k in r.kept), "no drained stop saved a checkpoint"
    assert steps < 16, "training finished before the stop: nothing was tested mid-training"

    done = r.command()  # the same command once more: it finishes, and every object already written is untouched
    assert done.returncode == Exit.OK, (done.stdout + done.stderr)[-4000:]
    r.check_nothing_rewritten()
    assert r.store.exists(Keys.checkpoint(r.run, 16) + "drafter/model.safetensors")
    assert f"run {r.run}: 40 of 40 prompts completed" in done.stdout, done.stdout[-3000:]


async def _acquire_when_lapsed(cfg, run: str) -> None:
    """Take the run's trainer lease as soon as it is free (then release it)."""
    async with await Bus.connect(cfg.bus, "pytest-lease", deadline_s=10) as bus:
        while True:
            try:
                lease = await Lease.acquire(bus, lease_key(run, "trainer"), 2, "pytest")
            except LeaseHeld:
                await asyncio.sleep(0.1)
                continue
            await lease.release()
            return


@pytest.mark.stack
def test_a_second_trainer_is_refused_naming_the_holder_until_the_lease_lapses(stack, stack_env, tmp_path) -> None:
    """The lease itself, without a model: a holder process takes it; a real `dfpipe train` is refused (Exit.BUSY)
    with the holder named (host, pid, since) while it lives and renews; once it is SIGKILLed the lease can be
    taken again within its TTL."""
    run = new_run()
    config = tmp_path / "lease.toml"
    config.write_text("[trainer]\nlease_ttl_s = 2\n")
    holder_code = (
        "import asyncio, sys\n"
        "from shared.bus import Bus, Lease\nfrom shared.config import load_config\nfrom shared.topology import lease_key\n"
        f"cfg = load_config({str(config)!r})\n"
        "async def main():\n"
        "    bus = await Bus.connect(cfg.bus, 'holder', deadline_s=10)\n"
        f"    await Lease.acquire(bus, lease_key({run!r}, 'trainer'), 2, 'trainer of run {run}')\n"
        "    print('held', flush=True)\n"
        "    await asyncio.sleep(600)\n"
        "asyncio.run(main())\n")
    env = {**stack_env, "DFLASH_MODEL__DEVICE": "cpu"}
    holder = subprocess.Popen([sys.executable, "-c", holder_code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(3)  # beyond the TTL: renewals keep it
        second = subprocess.run([sys.executable, "-m", "shared.cli", "--config", str(config), "train", "--run", run],
                                env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == Exit.BUSY, second.stdout + second.stderr
        assert f"pid {holder.pid}" in second.stderr and "host " in second.stderr and "since " in second.stderr, \
            second.stderr
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        killed = time.monotonic()
        asyncio.run(_acquire_when_lapsed(make_config(stack, run), run))
        assert time.monotonic() - killed < 2 + 3  # the TTL, and slack for a loaded machine
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


async def test_a_lease_renewed_too_late_is_taken_again_unless_another_process_took_it(cfg) -> None:
    """A holder whose loop was starved past the TTL (a loaded machine) keeps its lease when nobody took it in
    between, and knows it lost it (`lost`, which stops a trainer) when another process did."""
    key = lease_key(cfg.run, "trainer")
    async with await Bus.connect(cfg.bus, "pytest-a", deadline_s=10) as a, \
            await Bus.connect(cfg.bus, "pytest-b", deadline_s=10) as b:
        held = await Lease.acquire(a, key, 1, "a")
        time.sleep(2.5)  # the loop starved past the TTL: the entry lapsed
        await asyncio.sleep(1.5)  # the next renewals find it gone and take it again
        assert not held.lost.is_set()
        with pytest.raises(LeaseHeld):
            await Lease.acquire(b, key, 1, "b")
        held._task.cancel()  # stop renewing until another process has taken it
        await asyncio.sleep(2.5)
        other = await Lease.acquire(b, key, 1, "b")
        held._task = asyncio.create_task(held._renew())
        await asyncio.wait_for(held.lost.wait(), 5)
        await held.release()  # a lost lease is left to its holder
        with pytest.raises(LeaseHeld, match="held by b"):
            await Lease.acquire(a, key, 1, "a")
        await other.release()


async def test_a_trainer_stopped_while_it_loads_releases_its_lease(stack, target_dir, caplog) -> None:
    """A stop during the trainer's startup (its model load, after it took the run's lease) releases the lease while
    the bus is still open, so the next trainer starts at once. The release used to run after the service had
    closed its bus: it failed, and another trainer (on another host, or beside a live holder's pid) waited out
    the TTL (60 s here)."""
    import logging

    from services.trainer.loop import run_trainer

    cfg = make_config(stack, trainer={"lease_ttl_s": 60})
    key = lease_key(cfg.run, "trainer")
    stop = asyncio.Event()
    caplog.set_level(logging.INFO, logger="dflash")
    async with await Bus.connect(cfg.bus, "pytest-lease", deadline_s=10) as bus:
        trainer = asyncio.create_task(run_trainer(cfg, stop=stop))
        kv = await Lease._bucket(bus)
        deadline = time.monotonic() + 60
        while True:  # the lease is taken just before the model load
            with contextlib.suppress(Exception):
                if await kv.get(key):
                    break
            assert time.monotonic() < deadline and not trainer.done(), "the trainer never took its lease"
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(trainer, 60)
        assert "stopped during startup" in caplog.text, "the stop came after the startup: not the case under test"
        assert "release failed" not in caplog.text, caplog.text
        started = time.monotonic()
        again = await Lease.acquire(bus, key, 60, "pytest")  # this process is alive: only a release frees it now
        assert time.monotonic() - started < 5
        await again.release()


async def test_a_dead_holder_on_this_host_is_taken_over_one_elsewhere_waits_out_its_ttl(cfg) -> None:
    """A trainer restarted right after a kill -9 on the same host does not wait out the TTL (its holder's pid is
    gone); a holder on another host (its pid means nothing here) keeps the lease until its entry lapses."""
    import socket

    import msgspec

    from shared.bus import LeaseHolder

    key = lease_key(cfg.run, "trainer")
    gone = psutil.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that existed on this host and is gone
    async with await Bus.connect(cfg.bus, "pytest-takeover", deadline_s=10) as bus:
        kv = await Lease._bucket(bus)
        elsewhere = LeaseHolder(owner="trainer elsewhere", host="another-host", pid=gone.pid, since=time.time())
        await kv.create(key, msgspec.json.encode(elsewhere), msg_ttl=2)
        with pytest.raises(LeaseHeld, match="another-host"):
            await Lease.acquire(bus, key, 2, "pytest")
        await asyncio.sleep(3)  # lapsed
        mine = await Lease.acquire(bus, key, 2, "pytest")
        await mine.release()
        here = LeaseHolder(owner="trainer killed -9", host=socket.gethostname(), pid=gone.pid, since=time.time())
        await kv.create(key, msgspec.json.encode(here), msg_ttl=30)
        started = time.monotonic()
        taken = await Lease.acquire(bus, key, 2, "pytest")  # at once, not in 30 s
        assert time.monotonic() - started < 5 and taken.holder.pid == os.getpid()
        await taken.release()


@pytest.mark.stack  # stops and starts its own nats-server
async def test_a_lease_taken_while_the_server_restarts_waits_for_it(tmp_path) -> None:
    """A trainer starting while NATS restarts (or its cluster elects a leader) used to crash on the lease's
    first call and wait out a supervisor's backoff; the lease's calls are under the failure policy now: it
    is taken once the server is back, and a second process is refused as before."""
    from shared.stack import EmbeddedStack, Ports

    s = EmbeddedStack(tmp_path, Ports.free())
    s.start()
    try:
        cfg = make_config(s)
        async with await Bus.connect(cfg.bus, "pytest-lease-restart", deadline_s=10) as bus:
            await bus.ensure_streams()
            s.stop_component("nats")
            taking = asyncio.create_task(Lease.acquire(bus, lease_key(cfg.run, "trainer"), 5, "trainer"))
            await asyncio.sleep(2.0)
            assert not taking.done()  # waiting for the server, not failed
            s.start_nats()
            lease = await asyncio.wait_for(taking, 30)
            try:
                async with await Bus.connect(cfg.bus, "pytest-second", deadline_s=10) as other:
                    with pytest.raises(LeaseHeld, match="trainer"):
                        await Lease.acquire(other, lease_key(cfg.run, "trainer"), 5, "second")
            finally:
                await lease.release()
    finally:
        s.stop()

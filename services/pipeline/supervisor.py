"""Supervised service processes for `dfpipe run`: restart with backoff, report crash loops.

Each service runs as its own OS process (one event loop each, faults isolated). A process
that exits non-zero is restarted after an exponential backoff; `crash_limit` crashes inside
`crash_window_s` is a crash loop: the service is not restarted again and the loop is
reported (an Alert on the bus and the supervisor's own state), never hidden. A one-shot
service (the feeder) that exits 0 is done. A service that exits `Exit.BUSY` (the run's trainer lease is held
by another process) is not crashing: it is started again every `busy_retry_s` until the lease is free.

A supervisor owns what it starts: each service is the leader of its own process group, and stopping a service
ends its whole group (a dashboard's Streamlit server, a launcher's workers), so nothing it started outlives it.
`stop()` drains (SIGTERM, then SIGKILL after the grace period); `kill_all()` ends every group at once.

The restart delay is the failure policy's backoff (`shared.failures.backoff_s`), but not its retry helper:
a restart is not a call to repeat until a deadline. Its attempts are process lifetimes that count only
inside the crash window, it gives up on a crash loop rather than a deadline, a crash says nothing
classifiable (an exit code, not an exception), and a supervisor stop must end the wait at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.children import dies_with_parent
from shared.exits import Exit
from shared.failures import backoff_s

log = logging.getLogger("dflash.supervisor")


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    one_shot: bool = False  # exit 0 means done, not "restart me"
    deferred: bool = False  # not started by start(): launch(name) starts it when its phase comes
    grace_s: float | None = None  # how long a stop waits before SIGKILL (None: the supervisor's)


@dataclass
class ServiceState:
    spec: ServiceSpec
    pid: int | None = None
    starts: int = 0
    crashes: deque[float] = field(default_factory=deque)
    last_exit: int | None = None
    state: str = "pending"  # pending | starting | running | backoff | busy | done | crash_loop | stopped
    proc: asyncio.subprocess.Process | None = None
    stop_requested: bool = False  # stopped on purpose: its exit is not a crash


class Supervisor:
    def __init__(
        self,
        specs: list[ServiceSpec],
        log_dir: Path,
        *,
        crash_limit: int = 5,
        crash_window_s: float = 300.0,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        grace_s: float = 30.0,
        busy_retry_s: float = 10.0,
        on_crash_loop: Callable[[ServiceState], Awaitable[None]] | None = None,
    ) -> None:
        self.services = {s.name: ServiceState(s) for s in specs}
        self.log_dir = Path(log_dir)
        self.crash_limit = crash_limit
        self.crash_window_s = crash_window_s
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.grace_s = grace_s
        self.busy_retry_s = busy_retry_s
        self.on_crash_loop = on_crash_loop
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    async def _spawn(self, st: ServiceState) -> asyncio.subprocess.Process:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_dir / f"{st.spec.name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = await asyncio.create_subprocess_exec(
                *st.spec.argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **st.spec.env}, start_new_session=True, preexec_fn=dies_with_parent(),
            )
        finally:
            logf.close()
        st.proc, st.pid, st.state = proc, proc.pid, "running"
        st.starts += 1
        log.info("started %s (pid %d, start #%d)", st.spec.name, proc.pid, st.starts)
        return proc

    async def _watch(self, st: ServiceState) -> None:
        while not self._stopping.is_set() and not st.stop_requested:
            proc = await self._spawn(st)
            code = await proc.wait()
            st.last_exit, st.pid, st.proc = code, None, None
            if self._stopping.is_set() or st.stop_requested:
                st.state = "stopped"
                return
            if code == Exit.OK and st.spec.one_shot:
                st.state = "done"
                log.info("%s finished", st.spec.name)
                return
            if code == Exit.BUSY:  # another process holds what it needs (the run's lease): wait, not a crash
                st.state = "busy"
                log.warning("%s: another process holds the run's lease (see %s); trying again in %.0fs",
                            st.spec.name, self.log_dir / f"{st.spec.name}.log", self.busy_retry_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=self.busy_retry_s)
                continue
            now = time.monotonic()
            st.crashes.append(now)
            while st.crashes and now - st.crashes[0] > self.crash_window_s:
                st.crashes.popleft()
            if len(st.crashes) >= self.crash_limit:
                st.state = "crash_loop"
                log.error("%s is crash-looping (%d exits in %.0fs, last code %s): not restarting; see %s",
                          st.spec.name, len(st.crashes), self.crash_window_s, code,
                          self.log_dir / f"{st.spec.name}.log")
                if self.on_crash_loop is not None:
                    await self.on_crash_loop(st)
                return
            delay = backoff_s(len(st.crashes), self.backoff_base_s, self.backoff_cap_s)
            st.state = "backoff"
            log.warning("%s exited with %s; restarting in %.1fs", st.spec.name, code, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(st)) for st in self.services.values() if not st.spec.deferred]

    def launch(self, name: str) -> None:
        """Start a deferred service (once)."""
        st = self.services[name]
        if st.state == "pending" and not self._stopping.is_set():
            st.state = "starting"
            self._tasks.append(asyncio.create_task(self._watch(st)))

    def state(self) -> dict[str, str]:
        return {name: st.state for name, st in self.services.items()}

    async def stop_service(self, name: str) -> None:
        """SIGTERM one service (it drains and exits 0), SIGKILL after the grace period."""
        st = self.services[name]
        st.stop_requested = True
        proc = st.proc
        if proc is None or proc.returncode is not None:
            if st.state in ("pending", "starting", "backoff", "busy", "running"):
                st.state = "stopped"
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        grace = st.spec.grace_s or self.grace_s
        try:
            await asyncio.wait_for(proc.wait(), timeout=grace)
        except TimeoutError:
            log.warning("%s did not stop within %.0fs; killing", name, grace)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        kill_group(proc.pid)  # what it started and left behind cannot drain without it

    def kill_all(self) -> None:
        """SIGKILL every service's process group now (a second stop signal): nothing is lost, since every
        service acks its input only after its output is written; the unacked work comes back to the next run."""
        self._stopping.set()
        for st in self.services.values():
            st.stop_requested = True
            if st.proc is not None:
                kill_group(st.proc.pid)

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.gather(*(self.stop_service(n) for n in self.services))
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait(self, name: str) -> str:
        """Wait until a service is finished for good (done, crash_loop or stopped)."""
        while self.services[name].state not in ("done", "crash_loop", "stopped"):
            await asyncio.sleep(0.2)
        return self.services[name].state


def kill_group(pgid: int) -> None:
    """SIGKILL a service's process group (its leader's pid: each service starts a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)

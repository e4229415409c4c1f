import sys

import pytest

from services.pipeline.supervisor import ServiceSpec, Supervisor

pytestmark = pytest.mark.stack  # the supervisor runs real processes


async def test_crash_loop_is_reported_and_one_shot_finishes(tmp_path):
    reported = []

    async def on_loop(st):
        reported.append((st.spec.name, st.last_exit, st.starts))

    sup = Supervisor(
        [
            ServiceSpec("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"]),
            ServiceSpec("once", [sys.executable, "-c", "print('ok')"], one_shot=True),
        ],
        tmp_path, crash_limit=3, backoff_base_s=0.05, on_crash_loop=on_loop,
    )
    sup.start()
    assert await sup.wait("crasher") == "crash_loop"
    assert await sup.wait("once") == "done"
    await sup.stop()
    assert reported == [("crasher", 3, 3)]
    assert (tmp_path / "once.log").read_text().strip() == "ok"


async def test_restart_after_crash_then_clean_stop(tmp_path):
    marker = tmp_path / "first"
    script = (
        "import os, sys, time, signal\n"
        f"p = {str(marker)!r}\n"
        "if not os.path.exists(p):\n"
        "    open(p, 'w').close(); sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "print('second start', flush=True)\n"
        "time.sleep(60)\n"
    )
    sup = Supervisor([ServiceSpec("svc", [sys.executable, "-c", script])], tmp_path, backoff_base_s=0.05, grace_s=5)
    sup.start()
    import asyncio

    for _ in range(100):
        if sup.services["svc"].starts == 2 and "second start" in (tmp_path / "svc.log").read_text():
            break
        await asyncio.sleep(0.1)
    assert sup.services["svc"].starts == 2 and sup.state()["svc"] == "running"
    await sup.stop()
    assert sup.state()["svc"] == "stopped" and sup.services["svc"].last_exit == 0


async def test_stopping_a_service_ends_what_it_started_in_its_process_group(tmp_path):
    """A service that leaves a child behind (a dashboard's Streamlit server): stop ends the child too; kill_all
    ends every group at once."""
    import asyncio
    import os

    child = tmp_path / "child.pid"
    script = (  # a child that ignores SIGTERM and outlives its parent
        "import subprocess, sys, signal, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
        f"open({str(child)!r}, 'w').write(str(c.pid))\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "time.sleep(120)\n"
    )
    for how in ("stop", "kill_all"):
        child.unlink(missing_ok=True)
        sup = Supervisor([ServiceSpec("svc", [sys.executable, "-c", script])], tmp_path, grace_s=5)
        sup.start()
        for _ in range(300):
            if child.exists() and child.read_text():
                break
            await asyncio.sleep(0.1)
        pid = int(child.read_text())
        if how == "stop":
            await sup.stop()
        else:
            sup.kill_all()
            await asyncio.gather(*sup._tasks)
        for _ in range(50):  # killed; re-parented to init, which reaps it
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{how}: the service's child {pid} outlived it")


async def test_a_busy_exit_is_retried_not_counted_as_a_crash(tmp_path):
    """Exit.BUSY (the run's trainer lease is held elsewhere): started again after busy_retry_s, never a crash loop."""
    import asyncio

    from shared.exits import Exit

    count = tmp_path / "count"
    script = (
        "import os, sys\n"
        f"p = {str(count)!r}\n"
        "n = len(open(p).read()) if os.path.exists(p) else 0\n"
        "open(p, 'a').write('x')\n"
        f"sys.exit({int(Exit.BUSY)} if n < 4 else 0)\n"
    )
    sup = Supervisor([ServiceSpec("trainer", [sys.executable, "-c", script], one_shot=True)], tmp_path,
                     crash_limit=2, busy_retry_s=0.05)
    sup.start()
    assert await asyncio.wait_for(sup.wait("trainer"), 60) == "done"
    await sup.stop()
    assert sup.services["trainer"].starts == 5 and not sup.services["trainer"].crashes


async def test_what_a_killed_parent_started_stops_with_it(tmp_path):
    """`dfpipe run` (or a generator with its launched engine) killed -9 runs no cleanup: its services, each in
    a session of its own, used to live on (a trainer training for nobody, an engine holding the GPU and its
    port). Both ways children are started, the supervisor's and a plain Popen as the sglang backend
    launches its server, now get SIGTERM from the kernel when their parent dies."""
    import os
    import signal
    import subprocess
    import time

    pids = tmp_path / "pids"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    parent = (
        "import asyncio, subprocess, sys\n"
        "from pathlib import Path\n"
        "from services.pipeline.supervisor import ServiceSpec, Supervisor\n"
        "from shared.children import dies_with_parent\n"
        "async def main():\n"
        f"    sup = Supervisor([ServiceSpec('svc', {sleeper!r})], Path({str(tmp_path)!r}))\n"
        "    sup.start()\n"
        "    while sup.services['svc'].pid is None:\n"
        "        await asyncio.sleep(0.05)\n"
        f"    engine = subprocess.Popen({sleeper!r}, start_new_session=True, preexec_fn=dies_with_parent())\n"
        "    svc = sup.services['svc']\n"
        f"    Path({str(pids)!r}).write_text(f'{{svc.pid}} {{engine.pid}}')\n"
        "    await asyncio.sleep(120)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 30
        while not pids.exists() or not pids.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, "the parent did not start its children"
            time.sleep(0.1)
        children = [int(p) for p in pids.read_text().split()]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        alive = children
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in children if _alive(p)]
        assert alive == [], f"still running after their parent's kill -9: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in map(int, pids.read_text().split() if pids.exists() else []):
            if _alive(pid):  # the test failed: its orphans go
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

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

"""`dfpipe dashboard`: serve the progress page with Streamlit.

Binds 127.0.0.1 unless told otherwise; a non-local bind requires DFLASH_DASHBOARD_PASSWORD
in the environment (the page then asks for it), so the run's data is never open to a network
by accident.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from shared.exits import Exit

PASSWORD_ENV = "DFLASH_DASHBOARD_PASSWORD"
APP = Path(__file__).resolve().parent / "app.py"


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def streamlit_argv(host: str, port: int, run: str | None, config: str | None) -> list[str]:
    argv = [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
        "--global.developmentMode", "false", "--client.toolbarMode", "viewer",
        "--",
    ]
    if run:
        argv += ["--run", run]
    if config:
        argv += ["--config", config]
    return argv


def _run_note(cfg: Any) -> str:
    """One line when the run to show is not on the bus yet; the page still serves and shows it once it starts."""
    import asyncio

    from shared.bus import Bus

    async def check() -> str:
        async with await Bus.connect(cfg.bus, "dashboard-cli", deadline_s=5) as bus:
            return await bus.run_missing(cfg.run)

    try:
        missing = asyncio.run(check())
    except ConnectionError as e:
        return f"{e}; the page keeps retrying"
    return f"{missing}; the page shows it once it starts" if missing else ""


def _dashboard(args: argparse.Namespace) -> int:
    from shared.cli import load

    cfg = load(args)  # validates the config (and --run) before starting a server
    host = args.host or cfg.dashboard.host
    port = args.port or cfg.dashboard.port
    if not is_local(host) and not os.environ.get(PASSWORD_ENV):
        print(f"dfpipe dashboard: refusing to bind {host} (not loopback) without {PASSWORD_ENV} set "
              "in the environment", file=sys.stderr)
        return Exit.USAGE
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    print(f"dashboard on http://{host}:{port} (NATS {cfg.bus.url}, S3 {cfg.store.endpoint})", flush=True)
    if args.run and (note := _run_note(cfg)):
        print(f"dfpipe dashboard: {note}", flush=True)
    proc = subprocess.Popen(streamlit_argv(host, port, args.run, args.config), env=env)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # stop the server with us
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


def register(sub: Any, replay: Any) -> None:
    p = sub.add_parser("dashboard", help="serve the live progress page (Streamlit)")
    p.add_argument("--run", default=None, help="the run shown first (default: the most recently active)")
    p.add_argument("--host", default=None, help="bind address (default: dashboard.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: dashboard.port, 8501)")
    p.set_defaults(func=_dashboard)

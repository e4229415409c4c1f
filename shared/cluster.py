"""A cluster on one machine: a 3-node NATS JetStream cluster and a multi-process SeaweedFS, for the cluster
tests and `dfpipe chaos --cluster`.

The same binaries as the embedded stack (shared.stack), started as separate processes on localhost:

* NATS: three `nats-server`s (`n1`..`n3`), each with its own client, monitor and route ports and its own
  store dir, clustered over localhost routes. Streams are R3 by configuration only (`DFLASH_BUS__REPLICAS=3`);
  clients get all three URLs (`nats_url`), or one member's (`member_url`) and discover the rest.
* S3: one `weed master` (default replication 001: every object's volume has a copy on a second volume
  server), three `weed volume` servers, one `weed filer`, one `weed s3` gateway. Any one volume server may
  die without losing an object; the master, filer and gateway are single processes here (a production
  SeaweedFS runs 3 masters with raft and several filers on a shared store: docs/scale-out.md).

Faults are by process: `kill` (SIGKILL), `freeze`/`thaw` (SIGSTOP/SIGCONT), `restart`. The leaders come from
the servers' monitoring endpoint (`/jsz`), so a test kills the node that leads what it means to hit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from shared.stack import StackError, _pid_alive, _reap, ensure_credentials, find_binary, free_port

NATS_NODES = ("n1", "n2", "n3")
VOLUMES = ("v1", "v2", "v3")
REPLICATION = "001"  # one extra copy on another volume server of the same rack: one server may die


@dataclass
class NatsNode:
    name: str
    client: int
    monitor: int
    route: int


@dataclass
class Proc:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    frozen: bool = False


class ClusterStack:
    """3 NATS nodes and a SeaweedFS of 6 processes under `root`; the attributes tests read from an
    EmbeddedStack (`root`, `nats_url`, `s3_endpoint`, `bucket`, `env()`, `start()`, `stop()`) mean the same."""

    def __init__(self, root: Path, host: str = "127.0.0.1", bucket: str = "dflash") -> None:
        self.root = Path(root).resolve()  # the processes run in it: their paths must not be relative to it
        self.host = host
        self.bucket = bucket
        self.nats_bin = find_binary("nats-server")
        self.weed_bin = find_binary("weed")
        self.nodes = {n: NatsNode(n, free_port(host), free_port(host), free_port(host)) for n in NATS_NODES}
        self.ports = {k: free_port(host) for k in ("master", "master_grpc", "filer", "filer_grpc", "s3", "s3_grpc",
                                                   *(f"{v}{s}" for v in VOLUMES for s in ("", "_grpc")))}
        self.procs: dict[str, Proc] = {}
        self._plan()

    # --- addresses ------------------------------------------------------------------------------

    @property
    def nats_url(self) -> str:
        return ",".join(self.member_url(n) for n in NATS_NODES)

    def member_url(self, node: str) -> str:
        return f"nats://{self.host}:{self.nodes[node].client}"

    @property
    def s3_endpoint(self) -> str:
        return f"{self.host}:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """What a service process needs: all three NATS members, the gateway, R3 streams."""
        key, secret = ensure_credentials(self.root)
        return {"DFLASH_NATS_URL": self.nats_url, "DFLASH_S3_ENDPOINT": self.s3_endpoint, "DFLASH_S3_BUCKET": self.bucket,
                "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "DFLASH_BUS__REPLICAS": "3"}

    # --- the processes --------------------------------------------------------------------------

    def _plan(self) -> None:
        h = self.host
        for node in self.nodes.values():
            conf = self.root / "nats" / f"{node.name}.conf"
            routes = ", ".join(f'"nats://{h}:{o.route}"' for o in self.nodes.values() if o is not node)
            store = self.root / "nats" / node.name
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text(
                f'server_name: "{node.name}"\nlisten: "{h}:{node.client}"\nhttp: "{h}:{node.monitor}"\n'
                f'jetstream {{ store_dir: "{store}" }}\n'
                f'cluster {{ name: "dflash", listen: "{h}:{node.route}", routes: [{routes}] }}\n')
            self.procs[node.name] = Proc([self.nats_bin, "-c", str(conf)])
        p = self.ports
        master = f"{h}:{p['master']}.{p['master_grpc']}"
        self.procs["master"] = Proc([self.weed_bin, "master", f"-ip={h}", f"-ip.bind={h}", f"-port={p['master']}",
                                     f"-port.grpc={p['master_grpc']}", f"-mdir={self._dir('master')}",
                                     f"-defaultReplication={REPLICATION}", "-volumeSizeLimitMB=64", "-telemetry=false"])
        for v in VOLUMES:
            self.procs[v] = Proc([self.weed_bin, "volume", f"-ip={h}", f"-ip.bind={h}", f"-port={p[v]}",
                                  f"-port.grpc={p[v + '_grpc']}", f"-dir={self._dir(v)}", f"-mserver={master}",
                                  "-max=30", "-minFreeSpace=1", "-preStopSeconds=0"])
        self.procs["filer"] = Proc([self.weed_bin, "filer", f"-ip={h}", f"-ip.bind={h}", f"-port={p['filer']}",
                                    f"-port.grpc={p['filer_grpc']}", f"-master={master}",
                                    f"-defaultReplicaPlacement={REPLICATION}", f"-defaultStoreDir={self._dir('filer')}"])
        key, secret = ensure_credentials(self.root)
        self.procs["s3"] = Proc([self.weed_bin, "s3", f"-ip.bind={h}", f"-port={p['s3']}", f"-port.grpc={p['s3_grpc']}",
                                 f"-filer={h}:{p['filer']}.{p['filer_grpc']}", "-port.iceberg=0", "-port.lance=0"],
                                {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret})

    def _dir(self, name: str) -> Path:
        d = self.root / "s3" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _binary(self, name: str) -> str:
        return self.procs[name].argv[0]

    def spawn(self, name: str) -> int:
        proc = self.procs[name]
        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            p = subprocess.Popen(proc.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **proc.env}, start_new_session=True, cwd=self.root)
        proc.pid, proc.frozen = p.pid, False
        return p.pid

    def alive(self, name: str) -> bool:
        pid = self.procs[name].pid
        return pid is not None and _pid_alive(pid, self._binary(name))

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """SIGKILL (or `sig`) one process of ours; it stays down until `restart`."""
        proc = self.procs[name]
        if proc.frozen:
            self.thaw(name)
        if proc.pid is not None and _pid_alive(proc.pid, self._binary(name)):
            os.kill(proc.pid, sig)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _pid_alive(proc.pid, self._binary(name)):
                _reap(proc.pid)
                time.sleep(0.05)
            if _pid_alive(proc.pid, self._binary(name)):
                os.kill(proc.pid, signal.SIGKILL)
            _reap(proc.pid)
        proc.pid = None

    def freeze(self, name: str) -> None:
        pid = self.procs[name].pid
        assert pid is not None, f"{name} is not running"
        os.kill(pid, signal.SIGSTOP)
        self.procs[name].frozen = True

    def thaw(self, name: str) -> None:
        pid = self.procs[name].pid
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        self.procs[name].frozen = False

    def restart(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a killed process again (same ports, same data) and wait until it is healthy."""
        if not self.alive(name):
            self.spawn(name)
        self.wait_healthy(timeout_s)

    # --- health and leaders ---------------------------------------------------------------------

    def _get(self, url: str, timeout_s: float = 1.0) -> bytes | None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                return r.read() if r.status == 200 else None
        except OSError:
            return None

    def node_healthy(self, node: str) -> bool:
        return self._get(f"http://{self.host}:{self.nodes[node].monitor}/healthz?js-enabled-only=true") is not None

    def jsz(self, node: str) -> dict:
        raw = self._get(f"http://{self.host}:{self.nodes[node].monitor}/jsz?streams=true&consumers=true")
        return json.loads(raw) if raw else {}

    def meta_leader(self) -> str:
        """The JetStream meta leader's node name ("" while there is none)."""
        for node in NATS_NODES:
            up = self.alive(node) and not self.procs[node].frozen
            if up and (leader := (self.jsz(node).get("meta_cluster") or {}).get("leader", "")):
                return leader
        return ""

    def stream_leader(self, stream: str) -> str:
        """The node that leads `stream`'s raft group ("" while there is none or the stream does not exist)."""
        for node in NATS_NODES:
            if not self.alive(node) or self.procs[node].frozen:
                continue
            for account in self.jsz(node).get("account_details") or []:
                for s in account.get("stream_detail") or []:
                    if s.get("name") == stream and (leader := (s.get("cluster") or {}).get("leader")):
                        return leader
        return ""

    def nats_healthy(self) -> bool:
        return all(self.node_healthy(n) for n in NATS_NODES)

    def s3_healthy(self) -> bool:
        from shared.config import StoreConfig
        from shared.store import Store, StoreError

        key, secret = ensure_credentials(self.root)
        store = Store(StoreConfig(endpoint=self.s3_endpoint, bucket=self.bucket, retry_deadline_s=0), key, secret)
        try:
            store._call("list_buckets", store.client.list_buckets, deadline_s=0)
            return True
        except StoreError:
            return False

    def volumes_registered(self) -> int:
        """Volume servers the master knows now."""
        raw = self._get(f"http://{self.host}:{self.ports['master']}/dir/status")
        if not raw:
            return 0
        topo = json.loads(raw).get("Topology", {})
        return sum(len(rack.get("DataNodes") or []) for dc in topo.get("DataCenters") or []
                   for rack in dc.get("Racks") or [])

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.pid is not None and not self.alive(n)]
            if dead:
                tail = (self.root / "logs" / f"{dead[0]}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"{dead[0]} exited; last log lines:\n{tail}")
            running = [n for n in NATS_NODES if self.procs[n].pid is not None]
            volumes = sum(self.procs[v].pid is not None for v in VOLUMES)
            if (all(self.node_healthy(n) for n in running) and self.meta_leader()
                    and self.volumes_registered() >= volumes and self.s3_healthy()):
                return
            time.sleep(0.3)
        raise StackError(f"cluster not healthy after {timeout_s:.0f}s (logs in {self.root / 'logs'})")

    # --- whole cluster --------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> None:
        for name in (*NATS_NODES, "master", *VOLUMES, "filer", "s3"):
            self.spawn(name)
        try:
            self.wait_healthy(timeout_s)
            from shared.config import StoreConfig
            from shared.store import Store

            key, secret = ensure_credentials(self.root)
            Store(StoreConfig(endpoint=self.s3_endpoint, bucket=self.bucket, retry_deadline_s=30), key, secret).ensure_bucket()
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for name in ("s3", "filer", *VOLUMES, "master", *NATS_NODES):
            proc = self.procs[name]
            if proc.pid is None:
                continue
            if proc.frozen:
                self.thaw(name)
            if _pid_alive(proc.pid, self._binary(name)):
                os.kill(proc.pid, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and _pid_alive(proc.pid, self._binary(name)):
                    _reap(proc.pid)
                    time.sleep(0.05)
            self.kill(name)

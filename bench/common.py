"""What every benchmark needs: an embedded stack of its own on free ports, a config pointed at it, results JSON."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.config import Config, load_config  # noqa: E402
from shared.stack import EmbeddedStack, Ports  # noqa: E402

NATS_SYNC = os.environ.get("BENCH_NATS_SYNC", "always")  # the embedded default; "2m" is nats-server's own


@contextlib.contextmanager
def bench_stack(keep: Path | None = None, nats_sync: str = NATS_SYNC) -> Iterator[EmbeddedStack]:
    """An embedded stack in a temporary folder, or in `keep` (made if missing, left in place) so that
    a later call picks up its streams and objects (with the same credentials, kept there 0600); a stack
    already running in `keep` is used and left running.
    Its JetStream fsync is `nats_sync` (BENCH_NATS_SYNC): "always" as `dfpipe stack up` starts it."""
    creds = {"AWS_ACCESS_KEY_ID": "bench" + secrets.token_hex(4), "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(24)}
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        saved = keep / "credentials.json"
        if saved.exists():
            creds = json.loads(saved.read_text())
        else:
            saved.touch(mode=0o600)
            saved.write_text(json.dumps(creds))
        os.environ.update(creds)
    for k, v in creds.items():
        os.environ.setdefault(k, v)
    running = EmbeddedStack.load(keep) if keep is not None else None
    if running is not None and all(c["alive"] for c in running.status().values()):
        yield running  # another bench's stack, still up: used as it is and left to it
        return
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        root = keep or Path(tmp)
        stack = EmbeddedStack(root, Ports.free(), nats_sync=nats_sync)
        stack.start()
        try:
            yield stack
        finally:
            stack.stop()


def bench_config(stack: EmbeddedStack, run: str, **sections: dict[str, Any]) -> Config:
    cfg = load_config(env={})
    cfg = msgspec.structs.replace(
        cfg, run=run, bus=msgspec.structs.replace(cfg.bus, url=stack.nats_url),
        store=msgspec.structs.replace(cfg.store, endpoint=stack.s3_endpoint, bucket=stack.bucket),
        stack=msgspec.structs.replace(cfg.stack, data_dir=str(stack.root)),
    )
    for name, values in sections.items():
        cfg = msgspec.structs.replace(cfg, **{name: msgspec.structs.replace(getattr(cfg, name), **values)})
    return cfg


def write_result(name: str, result: dict[str, Any]) -> Path:
    out = ROOT / "bench" / "results" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpus": os.cpu_count()}, **result}
    out.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return out


AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def cpu_description() -> dict:
    """The CPU's model, its matrix-relevant flags, the kernel restriction in force (AVX2_ONLY's variables, read
    when torch loads) and torch's view of it."""
    import torch

    from shared.machine import cpu_flags, cpu_model

    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    restriction = {k: os.environ[k] for k in AVX2_ONLY if k in os.environ}
    return {"model": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags(wanted),
            "restriction": restriction, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def proc_numbers(pid: int) -> tuple[float, float] | None:
    """(peak RSS MB, CPU seconds) of a live process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return hwm / 1024, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def keep_latest(cfg: Any, name: str) -> str:
    """Copy the run's latest checkpoint to runs/<run>/kept/<name>/ (outside what a bench removes)."""
    from shared.store import Store
    from shared.topology import Keys

    store = Store.open(cfg)
    src = json.loads(store.get_bytes(Keys.checkpoint_latest(cfg.run)))["key"]
    dst = f"{Keys.run(cfg.run)}kept/{name}/"
    for key in store.list(src):
        store.put_bytes(dst + key[len(src):], store.get_bytes(key))
    store.put_bytes(dst + "SOURCE", src.encode())
    return dst

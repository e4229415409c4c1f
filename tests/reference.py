"""z-lab's reference DFlash implementation (PyPI `dflash==0.1.0`, MIT), installed for the interop tests.

Installed once per test session with `pip install --no-deps --target <tmp>`: its own requirements pin
transformers 5.15 and torch 2.13; it runs on ours (transformers 5.25) with the shim below, and the
tests say so if that stops. The package installs a `dflash` console command into `<tmp>/bin`, which
is never put on PATH, so it cannot shadow ours (`dfpipe`, and `python -m shared.cli` in tests).
Nothing of it is committed or copied here: it is imported from that directory only.

Skipped, with the reason, only when the package index cannot be reached; any other install failure fails.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from urllib.parse import urlparse

import pytest

REFERENCE = "dflash==0.1.0"


def _index_reachable() -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    host = urlparse(url).hostname or "pypi.org"
    try:
        socket.create_connection((host, 443), timeout=10).close()
        return True
    except OSError:
        return False


@functools.cache
def reference_dflash_dir() -> Path:
    """A directory holding the installed reference package (`<dir>/dflash`), once per session."""
    target = Path(tempfile.mkdtemp(prefix="dflash-reference-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                           "--target", str(target), REFERENCE], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        if not _index_reachable():
            pytest.skip(f"the package index is unreachable, so the reference {REFERENCE} cannot be installed")
        raise RuntimeError(f"pip install {REFERENCE} failed:\n{proc.stdout}\n{proc.stderr}")
    if not (target / "dflash" / "model.py").exists():
        raise RuntimeError(f"{REFERENCE} installed without dflash/model.py under {target}")
    return target


@functools.cache
def reference_model_module() -> ModuleType:
    """The reference's `dflash.model`, imported from the session's install directory.

    Shim, CPU only: `dflash_generate(..., return_stats=True)` (the only way it returns per-cycle acceptance
    lengths) times itself with `torch.cuda.synchronize()`, which raises on a CPU-only torch; its timer is
    replaced by a plain clock there. Nothing it computes is touched. (With transformers 5.25 it also warns
    that `past_key_values` is deprecated, removed in 5.40: when that lands, these tests fail loudly.)
    """
    import torch

    path = str(reference_dflash_dir())
    if path not in sys.path:
        sys.path.insert(0, path)
    import dflash.model as model

    if not model.__file__.startswith(path):
        raise RuntimeError(f"`dflash` was imported from {model.__file__}, not from the reference install {path}")
    if not torch.cuda.is_available():
        model._cuda_time = time.perf_counter
    return model

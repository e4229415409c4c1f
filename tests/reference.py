"""z-lab's reference DFlash package (`dflash==0.1.0`, MIT), installed for the interop tests.

It goes into a directory of its own (`pip install --no-deps --target`), once per test session: its
dependencies (torch, transformers) are ours already, and its own `dflash` console command lands in
that directory's bin/, where it cannot shadow anything. Tests put the directory first on sys.path.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REFERENCE = "dflash==0.1.0"
_installed: Path | None = None


def reference_dflash_dir() -> Path:
    """The directory holding the reference's `dflash` package (installed on first use this session)."""
    global _installed
    if _installed is None:
        target = Path(tempfile.mkdtemp(prefix="dflash-reference-"))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                        "--target", str(target), REFERENCE], check=True, timeout=600)
        if not (target / "dflash" / "model.py").is_file():
            raise RuntimeError(f"pip install {REFERENCE} --target {target} left no dflash/model.py")
        _installed = target
    return _installed

"""Our console command (`dfpipe`) and the reference DFlash package's (`dflash`) live side by side in one venv.

A throwaway venv sees this interpreter's packages through a .pth line (nothing is installed into the
shared one), then gets this project and z-lab's `dflash==0.1.0`, both `--no-deps`, from PyPI/the tree.
"""

import os
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.stack  # pip installs into a venv
def test_dfpipe_and_reference_dflash_commands_coexist(tmp_path: Path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "parent-site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for target in (str(ROOT), "dflash==0.1.0"):
        r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", target], capture_output=True, text=True)
        assert r.returncode == 0, f"pip install {target}: {r.stderr[-2000:]}"
    installed = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install's copy, not a source tree
    ours = subprocess.run([env_dir / "bin" / "dfpipe", "--help"], capture_output=True, text=True, env=installed)
    assert ours.returncode == 0 and "dfpipe" in ours.stdout and "stack" in ours.stdout, ours.stderr
    # the packages' own subcommands, found through the installed `dfpipe.commands` entry points
    assert all(c in ours.stdout for c in ("feed", "generate", "tokenize", "train", "run", "status")), ours.stdout
    where = subprocess.run([py, "-c", "import shared.plugins; print(shared.plugins.SOURCE_PYPROJECT.is_file())"],
                           capture_output=True, text=True, cwd=tmp_path, env=installed)
    assert where.stdout.strip() == "False", where.stderr  # imported from the install, not a source tree
    theirs = subprocess.run([env_dir / "bin" / "dflash", "--help"], capture_output=True, text=True)
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    assert "stack" not in theirs.stdout and theirs.stdout != ours.stdout  # the reference's own command

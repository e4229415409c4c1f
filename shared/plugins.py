"""What the packages register with the product: entry-point groups in pyproject.toml, read in one place.

`shared/` names no service, yet the CLI lists every package's commands and the config checks a backend kind;
both read the registrations here. From a source tree (tests, the supervisor's `python -m shared.cli`, a checkout
with an older or another checkout's install) the tree's own pyproject.toml lists them, so a new command or
backend needs no reinstall; an installed build (the image) reads its package metadata.
"""

from __future__ import annotations

import tomllib
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

COMMANDS = "dfpipe.commands"  # name = "package.cli:register"
BACKENDS = "dfpipe.backends"  # generator backend kind = "services.generator.backends.module:Class"
SOURCE_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@cache
def registered(group: str) -> tuple[EntryPoint, ...]:
    """Every registration of `group`, in the order pyproject.toml lists them."""
    if SOURCE_PYPROJECT.is_file():
        project = tomllib.loads(SOURCE_PYPROJECT.read_text()).get("project", {})
        if table := project.get("entry-points", {}).get(group):
            return tuple(EntryPoint(name, value, group) for name, value in table.items())
    return tuple(entry_points(group=group))


def backend_kinds() -> list[str]:
    """The generator backend kinds, sorted (the `--backend` choices, the config check, error messages)."""
    return sorted(ep.name for ep in registered(BACKENDS))

"""Two "only this module" claims, read from the source (ast; nothing is imported): `nats` is imported only by
shared/bus.py (every other module reads and writes JetStream through the bus, so the failure policy and the
failover handling live in one place), and the failure types come from shared/failures.py alone."""

from __future__ import annotations

import ast
from pathlib import Path

import shared.failures

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("shared", "services", "dashboard", "bench")  # the project's code (tests may use nats to test the bus)
BUS = ROOT / "shared" / "bus.py"
FAILURE_NAMES = {name for name, value in vars(shared.failures).items()
                 if not name.startswith("_") and getattr(value, "__module__", None) == "shared.failures"}


def python_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]


def nats_imports(path: Path) -> list[str]:
    """`line: statement` for every import of nats (or a nats submodule) anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"{node.lineno}: {n}" for n in names if n == "nats" or n.startswith("nats.")]
    return found


def failure_types_from_bus(path: Path) -> list[str]:
    return [f"{node.lineno}: {a.name}" for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.module == "shared.bus"
            for a in node.names if a.name in FAILURE_NAMES]


def test_nats_is_imported_only_by_the_bus() -> None:
    offenders = {str(p.relative_to(ROOT)): found for p in python_files(*SOURCES) if p != BUS and (found := nats_imports(p))}
    assert not offenders, f"nats imported outside shared/bus.py (use a Bus method): {offenders}"
    assert nats_imports(BUS), "the check reads imports: shared/bus.py itself imports nats"


def test_failure_types_come_from_failures_only() -> None:
    assert {"Retry", "Poison", "Halt", "GaveUp", "Failure", "classify"} <= FAILURE_NAMES
    offenders = {str(p.relative_to(ROOT)): found for p in python_files(*SOURCES, "tests")
                 if (found := failure_types_from_bus(p))}
    assert not offenders, f"failure types imported from shared.bus, not shared.failures: {offenders}"


def test_the_checks_see_an_offender(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import nats.js.errors\n    from nats.js import api\n    from shared.bus import Bus, Retry\n")
    assert nats_imports(bad) == ["2: nats.js.errors", "3: nats.js"]
    assert failure_types_from_bus(bad) == ["4: Retry"]

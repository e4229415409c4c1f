"""Stream names, subjects and object keys are spelled in shared/topology.py only (read from the source with ast,
nothing imported): a stream name, a `dflash.` subject or a `runs/` key written as a literal anywhere else in the
code (shared/, services/, dashboard/, bench/) fails here with its file and line, so a rename happens once."""

from __future__ import annotations

import ast
from pathlib import Path

from shared.topology import PREFIX, Streams, streams

ROOT = Path(__file__).resolve().parents[1]
CODE = ("shared", "services", "dashboard", "bench")
TOPOLOGY = ROOT / "shared" / "topology.py"
STREAM_NAMES = {spec.name for spec in streams(1.0)}
SUBJECT_START = f"{PREFIX}."
KEY_START = "runs/"


def leading_text(node: ast.AST) -> str | None:
    """A string literal's text, or an f-string's text up to its first placeholder."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
    return None


def docstrings(tree: ast.Module) -> set[int]:
    owners = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))]
    return {id(o.body[0].value) for o in owners
            if o.body and isinstance(o.body[0], ast.Expr) and isinstance(o.body[0].value, ast.Constant)}


def logger_names(tree: ast.Module) -> set[int]:
    """`logging.getLogger("dflash.x")`: a logger's name shares the prefix, and is not a subject."""
    return {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "getLogger"
            for a in n.args}


def topology_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree) | logger_names(tree)
    skip |= {id(part) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for part in n.values}  # seen whole
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        text = leading_text(node)
        if text is None or id(node) in skip:
            continue
        if (isinstance(node, ast.Constant) and text in STREAM_NAMES) or text.startswith((SUBJECT_START, KEY_START)):
            found.append((node.lineno, f"{where}:{node.lineno} {text!r}"))
    return [hit for _, hit in sorted(found)]


def test_the_stream_names_are_the_tables() -> None:
    assert {v for k, v in vars(Streams).items() if k.isupper()} == STREAM_NAMES


def test_no_stream_subject_or_key_literal_outside_topology() -> None:
    files = [p for pkg in CODE for p in sorted((ROOT / pkg).rglob("*.py")) if p != TOPOLOGY]
    assert len(files) > 50
    assert [hit for p in files for hit in topology_literals(p)] == []


def test_the_walk_finds_each_kind_of_literal(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text(
        '"""Reads the SHARDS stream and dflash.R.generate.shard (a docstring may name them)."""\n'
        "import logging\n"
        'log = logging.getLogger("dflash.probe")\n'
        'a = bus.replay("SHARDS", s)\n'
        'b = f"dflash.{run}.generate.progress.*"\n'
        'c = f"runs/{run}/tokenized/"\n'
        'd = "PROGRESS stream"\n'  # prose, not a name
    )
    assert [h.split(" ", 1)[1] for h in topology_literals(src)] == [
        "'SHARDS'", "'dflash.'", "'runs/'"]

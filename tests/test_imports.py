"""The import graph, read from the source (ast; nothing is imported): `shared/` never imports a service or the
dashboard (services register their commands with `dfpipe` the other way round: pyproject.toml's
`dfpipe.commands` entry points), and no two modules import each other, directly or around a loop. Every
import counts, also one inside a function or under TYPE_CHECKING: a cycle there is still two modules that
cannot be read, or changed, one without the other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "services", "dashboard")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of ours, or a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


MODULE_PATH = re.compile(r"(services|dashboard)(\.\w+)+(:\w+)?")


def modules_named_in_strings(path: Path) -> set[str]:
    """Service or dashboard modules a file names as a string (`importlib.import_module("services.x")`)."""
    return {node.value for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value)}


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_every_package() -> None:
    graph = import_graph()
    # the reader finds what it should: a relative import, a `from pkg import module`, and a function-local import
    assert "services.tokenizer.samples" in graph["services.tokenizer.service"]
    assert "services.tokenizer.gate" in graph["services.tokenizer.service"]  # `from . import gate as gatemod`
    assert "shared.stack" in graph["shared.cli"]  # imported inside load()
    assert {n.split(".")[0] for n in graph} == set(PACKAGES)


def test_shared_never_imports_a_service_or_the_dashboard() -> None:
    graph = import_graph()
    wrong = {m: sorted(t for t in targets if t.split(".")[0] in ("services", "dashboard"))
             for m, targets in graph.items() if m.split(".")[0] == "shared"}
    assert {m: t for m, t in wrong.items() if t} == {}
    named = {m: sorted(modules_named_in_strings(p)) for m, p in our_modules().items() if m.split(".")[0] == "shared"}
    assert {m: n for m, n in named.items() if n} == {}


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_loop_and_only_a_loop() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []

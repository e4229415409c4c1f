"""Exit codes have one source, `shared/exits.py`: no command returns or raises a bare integer (read from the
source with ast, nothing imported), every code has one meaning, and docs/reference.md shows the same table."""

from __future__ import annotations

import ast
from pathlib import Path

from shared.exits import Exit, table

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "services", "dashboard")
EXIT_CALLS = {"sys.exit", "exit", "quit", "os._exit", "SystemExit"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def bare_ints(node: ast.AST | None) -> list[int]:
    """The integer literals an expression can evaluate to: itself, or a branch of `a if c else b` / `a or b`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    if isinstance(node, ast.IfExp):
        return bare_ints(node.body) + bare_ints(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [v for value in node.values for v in bare_ints(value)]
    if isinstance(node, ast.Call) and dotted(node.func) == "int" and node.args:
        return bare_ints(node.args[0])  # `int(func(args) or 0)`
    return []


def command_functions(tree: ast.Module) -> set[str]:
    """The functions a module hands argparse (`set_defaults(func=f)`, or a lambda calling f), `main`, and what
    those return the result of, in the same module."""
    names = {"main"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and dotted(node.func).endswith("set_defaults"):
            for kw in node.keywords:
                if kw.arg == "func":
                    names |= {dotted(n) for n in ast.walk(kw.value) if isinstance(n, ast.Name)} - {"asyncio", "args"}
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    todo = list(names & defs.keys())
    while todo:
        for ret in (r for r in ast.walk(defs[todo.pop()]) if isinstance(r, ast.Return) and r.value is not None):
            for call in (c for c in ast.walk(ret.value) if isinstance(c, ast.Call)):
                callee = dotted(call.func)
                if callee in defs and callee not in names:
                    names.add(callee)
                    todo.append(callee)
    return names & defs.keys()


def bare_exits(path: Path) -> list[str]:
    """`file:line what` for every bare integer exit in one source file."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and dotted(node.func) in EXIT_CALLS and node.args:
            found += [f"{where}:{node.lineno} {dotted(node.func)}({v})" for v in bare_ints(node.args[0])]
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for name in sorted(command_functions(tree)):
        for ret in (r for r in ast.walk(defs[name]) if isinstance(r, ast.Return)):
            found += [f"{where}:{ret.lineno} {name} returns {v}" for v in bare_ints(ret.value)]
    return found


def test_no_command_exits_with_a_bare_integer() -> None:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50
    assert [hit for p in files for hit in bare_exits(p)] == []


def test_the_walk_finds_a_bare_exit(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text(
        "import sys\n"
        "def _cmd(args):\n    if args.x:\n        return 3\n    return _inner(args)\n"
        "def _inner(args):\n    return 0 if args.y else Exit.OK\n"
        "def helper():\n    return 5\n"  # not a command: a count is an int
        "def register(sub):\n    sub.set_defaults(func=lambda args: asyncio.run(_cmd(args)))\n"
        "def main():\n    raise SystemExit(2)\n"
        "sys.exit(int(main() or 1))\n"
    )
    hits = bare_exits(src)
    assert sorted(h.split(" ", 1)[1] for h in hits) == sorted(
        ["SystemExit(2)", "sys.exit(1)", "_cmd returns 3", "_inner returns 0"])


def test_every_code_has_one_meaning() -> None:
    codes = list(Exit)
    assert len({e.value for e in codes}) == len(codes) == len(Exit.__members__)  # no alias: one name per code
    meanings = [e.meaning for e in codes]
    assert all(m.strip() for m in meanings) and len(set(meanings)) == len(meanings)
    assert Exit.OK == 0 and Exit.USAGE == 2 and Exit.STOPPED == 75  # what shells, argparse and schedulers expect
    assert Exit.HALTED != Exit.QUALITY_GATE


def test_the_reference_shows_the_table() -> None:
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert table() in reference
    assert len(table().splitlines()) == 2 + len(Exit)

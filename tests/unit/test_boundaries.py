"""Package boundaries: the simulator and planner import without torch, and no `rlfusion` module
imports itself back through a circle of module-level imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `src`."""
    out = {}
    for path in (src / package).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(stmts: list[ast.stmt]):
    """The import statements that run when the module is imported: module level, in `if`,
    `try`, `with` and class bodies; not inside functions, not under `if TYPE_CHECKING:`."""
    for stmt in stmts:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not _type_checking(stmt.test):
                yield from _import_time_imports(stmt.body)
            yield from _import_time_imports(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                yield from _import_time_imports(block)
        elif isinstance(stmt, (ast.With, ast.ClassDef)):
            yield from _import_time_imports(stmt.body)


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package modules its import-time imports execute. `from a.b import c` names
    the submodule `a.b.c` when there is one, else `a.b`; importing `a.b.c` also runs the
    packages above it (`a`, `a.b`) unless they enclose the importer (already being imported)."""
    modules = _modules(src, package)
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in _import_time_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from the module's package, up level - 1
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
            for target in targets:
                parts = target.split(".")
                deps.update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                            if m in modules and m not in enclosing)
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles():
    graph = import_graph(SRC, "rlfusion")
    assert len(graph) > 50 and "rlfusion.measure.calibrate" in graph["rlfusion.measure.contention"]
    assert import_cycles(graph) == []


def test_cycle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")  # a -> pkg.sub.b (and pkg.sub)
    (pkg / "sub" / "b.py").write_text("class B:\n    from ..c import C\n")  # b -> c
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\n"
                              "def f():\n    import pkg.a\n")  # neither counts
    assert import_cycles(import_graph(tmp_path, "pkg")) == []
    (pkg / "c.py").write_text("try:\n    from pkg import a\nexcept ImportError:\n    pass\n")
    assert import_cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.c", "pkg.sub", "pkg.sub.b"]]


def test_sim_imports_without_torch():
    modules = sorted(_modules(SRC, "rlfusion/sim"))
    assert "rlfusion.sim.rl_sim" in modules and "rlfusion.sim.cli" in modules
    code = ("import importlib, sys; sys.modules['torch'] = None\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

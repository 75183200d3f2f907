"""Package layering, read from the source with `ast`: every import of every `rlfusion` module
(module level, inside functions, under `if TYPE_CHECKING:`) is an edge of one module graph, and
the graph has no circle, no import up the layer table below, and no private name taken from
another module. The simulator and the torch-free planners also import with torch blocked."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# The floors of `rlfusion`, bottom to top. A unit is a subpackage (`sim`) or a module at the
# package root (`cli`); a module may import its own unit and the units of its floor or below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "config", "obs", "memory_plan", "partition"),  # foundations: import nothing of rlfusion
    ("queue", "stalesync"),  # the DistQueue and StaleSync's torch-free rules: no model
    ("model",),  # the decoder, its configs and FLOPs: no parallelism, no RL
    ("rl",),  # RL math, tasks and verifiers: no placement, no transport
    ("parallel",),  # layouts applied to a plain model
    ("fusion",),  # the train <-> inference switch
    ("engine",),  # the rollout engine
    ("evaluate", "pretrain"),  # held-out evaluation, supervised pretraining
    ("runtime",),  # the controller and the device workers
    ("sim", "measure"),  # the simulator and the harnesses that measure its costs
    ("cli",),  # the `rlfusion` command
)
# Units kept apart although their floors allow it: the simulator reuses the runtime's torch-free
# rules (`stalesync/`), never the runtime itself.
APART = {("sim", "runtime")}
TORCH_FREE = ("rlfusion.memory_plan", "rlfusion.model.flops", "rlfusion.obs.peak", "rlfusion.partition")


def _modules(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `src`."""
    out = {}
    for path in (src / package).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported module, imported name or None) for every import statement anywhere in the
    module. `from a.b import c` imports the module `a.b.c` when there is one, else the name `c`
    of `a.b`; `import a.b.c` imports `a.b.c`. Relative forms count from the module's package."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                module = f"{base}.{alias.name}"
                yield (module, None) if module in modules else (base, alias.name)


def _owner(target: str, modules: dict[str, Path]) -> str | None:
    """The package module that defines `target` (itself, or the nearest package above it)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_graph(src: Path, package: str) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the package modules it imports (its own enclosing packages left out: a module
    naming its package's `__init__` re-exports), and every private name one module takes from
    another, as 'importer imports _name from module'."""
    modules = _modules(src, package)
    graph, private = {}, []
    for name, path in modules.items():
        enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps = set()
        for target, attr in _imports(name, path, modules):
            owner = _owner(target, modules)
            if owner is None or owner == name:
                continue
            leaf = attr if attr is not None else target.rpartition(".")[2]
            if leaf.startswith("_") and not leaf.startswith("__"):
                private.append(f"{name} imports {leaf} from {owner}")
            if owner not in enclosing:
                deps.add(owner)
        graph[name] = deps
    return graph, sorted(private)


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


def unit(module: str) -> str | None:
    """`rlfusion.sim.costs` -> `sim`, `rlfusion.cli` -> `cli`; the root package has none."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]], layers=LAYERS, apart=APART) -> list[str]:
    """Every import of a unit on a higher floor, or between units kept apart."""
    floor = {u: i for i, names in enumerate(layers) for u in names}
    out = []
    for name, deps in graph.items():
        for dep in deps:
            a, b = unit(name), unit(dep)
            if a is None or b is None or a == b:
                continue
            if floor[b] > floor[a] or (a, b) in apart:
                out.append(f"{name} ({a}, floor {floor[a]}) -> {dep} ({b}, floor {floor[b]})")
    return sorted(out)


def _graph():
    graph, private = import_graph(SRC, "rlfusion")
    assert len(graph) > 100 and "rlfusion.measure.calibrate" in graph["rlfusion.measure.contention"]
    return graph, private


def test_every_unit_has_a_floor():
    graph, _ = _graph()
    placed = [u for names in LAYERS for u in names]
    assert len(placed) == len(set(placed))
    assert sorted({unit(m) for m in graph} - {None} - set(placed)) == []


def test_no_import_circles():
    graph, _ = _graph()
    assert import_cycles(graph) == []


def test_no_upward_imports():
    graph, _ = _graph()
    assert upward_imports(graph) == []


def test_no_private_names_across_modules():
    _, private = _graph()
    assert private == []


def test_the_checks_find_what_they_look_for(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from .a import A\n")
    (pkg / "low" / "a.py").write_text("A = 1\n_B = 2\ndef f():\n    from pkg.high import h\n")
    (pkg / "low" / "b.py").write_text("from . import a\nfrom pkg.low.a import _B\n")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "high" / "h.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from ..low import A\n")
    graph, private = import_graph(tmp_path, "pkg")
    assert graph["pkg.low.a"] == {"pkg.high.h"} and graph["pkg.low.b"] == {"pkg.low.a"}
    assert graph["pkg.high.h"] == {"pkg.low"} and graph["pkg.low"] == {"pkg.low.a"}
    assert private == ["pkg.low.b imports _B from pkg.low.a"]
    assert import_cycles(graph) == [["pkg.high.h", "pkg.low", "pkg.low.a"]]
    assert upward_imports(graph, (("low",), ("high",)), set()) == [
        "pkg.low.a (low, floor 0) -> pkg.high.h (high, floor 1)"]
    assert upward_imports(graph, (("low", "high"),), {("high", "low")}) == [
        "pkg.high.h (high, floor 0) -> pkg.low (low, floor 0)"]


def test_sim_and_planners_import_without_torch():
    modules = sorted(_modules(SRC, "rlfusion/sim")) + list(TORCH_FREE)
    assert "rlfusion.sim.rl_sim" in modules and "rlfusion.sim.cli" in modules
    code = ("import importlib, sys; sys.modules['torch'] = None\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

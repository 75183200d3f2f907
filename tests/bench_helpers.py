"""Loading a `bench/NAME.py` script as a module, for tests of its own logic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_bench(name: str) -> ModuleType:
    """`bench/{name}.py` as the module `bench_{name}` (registered in sys.modules, which its
    dataclasses need)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module

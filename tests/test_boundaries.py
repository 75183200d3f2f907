"""Package boundaries: the simulator and planner import without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rlfusion"


def _modules(package: str) -> list[str]:
    folder = SRC / package
    return [f"rlfusion.{package}"] + sorted(
        f"rlfusion.{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")


def test_sim_imports_without_torch():
    modules = _modules("sim")
    assert "rlfusion.sim.rl_sim" in modules and "rlfusion.sim.cli" in modules
    code = ("import importlib, sys; sys.modules['torch'] = None\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

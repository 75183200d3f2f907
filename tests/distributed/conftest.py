"""One gloo world for the modules here that compare parallel layouts on 4 spawned ranks.

Spawning a world is the slow part on 2 cores (4 fresh processes importing torch, ~4 s), so the
modules that need one do not spawn one each: a module names what its ranks run as
`WORLD = (function, args, timeout)` and its tests take the `world` fixture (every rank's
result). The first such module to run starts one world that runs the parts of every module
of the session that has them, one after another (`parallel_helpers.run_parts`); a part that
fails is that module's error, and the parts after it do not run.
"""

import pytest

from parallel_helpers import run_parts

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def _shared_world(request):
    modules = {item.module.__name__: item.module for item in request.session.items
               if "world" in getattr(item, "fixturenames", ()) and hasattr(item.module, "WORLD")}
    results: dict[str, list] = {}

    def ranks_of(module) -> list:
        if module.__name__ not in results:
            from rlfusion.parallel.launch import run_world

            todo = {name: m for name, m in modules.items() if name not in results} or {module.__name__: module}
            parts = [(name, m.WORLD[0], tuple(m.WORLD[1])) for name, m in todo.items()]
            ranks = run_world(run_parts, WORLD_SIZE, parts, timeout=sum(m.WORLD[2] for m in todo.values()))
            results.update({name: [rank[name] for rank in ranks] for name in todo})
        return results[module.__name__]
    return ranks_of


@pytest.fixture(scope="module")
def world(request, _shared_world) -> list:
    """Every rank's result of this module's `WORLD` part, failing with the first rank's error."""
    ranks = _shared_world(request.module)
    errors = [r["error"] for r in ranks if isinstance(r, dict) and "error" in r]
    assert not errors, errors[0]
    return ranks

"""Shared by the three tiers (tests/unit, tests/distributed, tests/e2e): the helpers' folder on
sys.path, each tier's marker (`pytest -m unit`), a tiny base checkpoint for the session and a
local Ray cluster for the modules whose tests ask for one (kept up from one such module into
the next, stopped before any other)."""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
TIERS = ("unit", "distributed", "e2e")

# Lets every tier import the helpers here (hf_helpers, parallel_helpers, ...) and configs name
# them as `module:function` (e.g. reward="reward_fns:length_reward").
sys.path.insert(0, str(TESTS))


def pytest_collection_finish(session):
    """The benches' smoke runs that this session selected (tests/e2e/test_bench_smoke.py) start
    now in a process of their own (tests/bench_runner.py), beside the rest of the session, and
    their tests read the results at the end."""
    scripts = [item.callspec.params["script"] for item in session.items
               if getattr(item, "originalname", None) == "test_bench_smoke"]
    if scripts and not session.config.option.collectonly:
        from bench_runner import Background

        session.bench_smoke = Background(scripts)


def pytest_sessionfinish(session):
    smoke = getattr(session, "bench_smoke", None)
    if smoke is not None:
        smoke.close()


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker from the folder it lives in."""
    for item in items:
        tier = Path(item.path).relative_to(TESTS).parts[0]
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """A randomly initialised tiny base checkpoint (seed 0): fast runs that need no learning."""
    import torch

    from rlfusion.model.checkpoint import save_checkpoint
    from rlfusion.model.config import get_preset
    from rlfusion.model.tokenizer import CharTokenizer
    from rlfusion.model.transformer import MoETransformer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base")
    save_checkpoint(path, MoETransformer(get_preset("tiny")), CharTokenizer.arithmetic())
    return path


RAY_CPUS = 4  # the most CPUs a test's devices take (4 devices of 1 thread); logical, not cores


@pytest.fixture(scope="module")
def _ray_module(request):
    """Ray stops after the last test of a module that asked for it: a later test may need Ray
    not running (an address it must fail to reach, a cluster of its own, workers that inherit
    environment variables it sets first). Unless the next module asks for it too: then it
    runs on into that one (a start and a stop fewer), which finds it up as its own later tests
    find it."""
    yield
    import ray

    if ray.is_initialized() and not _next_module_asks_for_ray(request):
        ray.shutdown()


def _next_module_asks_for_ray(request) -> bool:
    """Whether the module that runs after this one has a test that asks for `ray_session`."""
    items, here = request.session.items, request.node.path
    mine = [i for i, item in enumerate(items) if item.path == here]
    if not mine or mine[-1] + 1 == len(items):
        return False
    following = items[mine[-1] + 1].path
    return any(item.path == following and "ray_session" in getattr(item, "fixturenames", ()) for item in items)


@pytest.fixture
def ray_session(_ray_module):
    """One local Ray cluster for a module's tests that run Ray devices or queues (its GCS
    address), started by the first that asks: a `RayDevices` finds Ray running and leaves it
    up (it stops only a Ray it started), so those tests skip a cluster start each. A test that
    stops Ray, or starts its own, only makes the next test that asks start it again."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address

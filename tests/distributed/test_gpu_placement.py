"""`deploy.device`: GPU placement through a local Ray cluster whose GPUs are declared (this
machine has none): bundles ask for one GPU per device, each device worker is shown its own GPU,
a cluster with too few GPUs is one clear error, and a CUDA device on a CPU-only torch is named."""

import os

import pytest

from rlfusion.config import load_config
from rlfusion.errors import RunError
from rlfusion.model.checkpoint import find_base
from rlfusion.runtime.deployment import DeployConfig, DeploymentPlan
from rlfusion.runtime.device_binding import local_device
from rlfusion.runtime.ray_devices import RayDevices, cluster_device, device_bundles, worker_options
from rlfusion.runtime.train_config import TrainConfig


def _plan(n: int, device: str) -> DeploymentPlan:
    return DeploymentPlan.build(DeployConfig(num_devices=n, device=device)).on(device)


def test_bundles_and_worker_options_ask_one_gpu_per_device_on_cuda():
    assert device_bundles(_plan(3, "cuda"), 4) == [{"CPU": 4, "GPU": 1}] * 3
    assert worker_options(_plan(3, "cuda"), 4) == {"num_cpus": 4, "num_gpus": 1}
    assert device_bundles(_plan(2, "cpu"), 1) == [{"CPU": 1}] * 2
    assert worker_options(_plan(2, "cpu"), 1) == {"num_cpus": 1, "num_gpus": 0}


def test_the_device_kind_resolves_from_the_cluster():
    assert cluster_device("auto", {"CPU": 8, "GPU": 4}, 4) == "cuda"
    assert cluster_device("auto", {"CPU": 8}, 4) == "cpu"
    assert cluster_device("cpu", {"CPU": 8, "GPU": 4}, 4) == "cpu"
    with pytest.raises(RunError, match=r"needs one GPU per device: 4 devices .* has 2 GPU\(s\)") as e:
        cluster_device("cuda", {"CPU": 8, "GPU": 2}, 4)
    assert "\n" not in str(e.value)
    with pytest.raises(RunError, match="has 0 GPU"):
        cluster_device("cuda", {"CPU": 8}, 1)
    assert local_device("auto") == ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="deploy.device='gpu' is invalid: allowed: auto, cpu, cuda"):
        DeployConfig(device="gpu")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only error")
def test_a_cuda_device_without_cuda_is_named_locally():
    with pytest.raises(RunError, match="deploy.device=cuda: torch .* sees no CUDA device"):
        local_device("cuda")


@pytest.fixture(scope="module")
def gpu_cluster():
    """A local Ray cluster that declares 2 GPUs (Ray assigns their ids; nothing uses them), for
    this module's tests (each leaves it as it found it)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_each_device_worker_gets_its_own_gpu(gpu_cluster):
    ray = gpu_cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class Probe:  # placed exactly as `RayDevices` places a device worker
        def gpus(self):
            return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

    plan = _plan(2, "cuda")
    pg = placement_group(device_bundles(plan, 1), strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        probes = [Probe.options(**worker_options(plan, 1), scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=d)).remote() for d in range(2)]
        seen = ray.get([p.gpus.remote() for p in probes])
    finally:
        remove_placement_group(pg)
    ids = [ids for ids, _ in seen]
    assert all(len(i) == 1 for i in ids) and len({str(i[0]) for i in ids}) == 2
    assert [visible for _, visible in seen] == [str(i[0]) for i in ids]  # each sees only its own


@pytest.mark.slow
def test_cuda_devices_on_a_gpu_cluster_start_or_say_why(gpu_cluster, tmp_path):
    def cfg(n):
        return load_config(TrainConfig, None, ["deploy.device=cuda", f"deploy.num_devices={n}",
                                               "deploy.mode=colocated", f"out_dir={tmp_path}"])

    plan = lambda c: DeploymentPlan.build(c.deploy)  # noqa: E731
    with pytest.raises(RunError, match=r"3 devices \(deploy.num_devices\), and the Ray cluster has 2 GPU"):
        RayDevices(cfg(3), plan(cfg(3)), str(find_base()))
    assert gpu_cluster.is_initialized()  # a cluster the run did not start is left running
    if not __import__("torch").cuda.is_available():  # a CPU-only torch: the worker names its GPU and why
        with pytest.raises(RunError, match=r"device \d could not start: .*deploy.device=cuda: device \d was given "
                                           r"GPU '\d' but torch .* has no CUDA"):
            RayDevices(cfg(2), plan(cfg(2)), str(find_base()))

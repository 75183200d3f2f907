"""Hardware specs as data: chips, links and the clusters built from them.

Owns `ChipSpec`, `LinkSpec`, `ClusterSpec`, the named presets (`910b`, `cm384`, `h100`,
`h200`, `cpu`), JSON load/save of a spec, and parsing of `KIND:NUM_CHIPS` cluster strings.
Knows nothing about models or parallel plans. Every number states its unit in the field
name (`_tflops`, `_GB`, `_GBps` = 1e9 bytes/s, `_us`) and its source next to the preset.

Numbers for the accelerators are public vendor figures as commonly quoted; the *efficiency*
fields are assumptions (what large kernels reach), not measurements, and are the first thing
to replace with a measured spec file (`measure_cpu` shows the format for this machine).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LinkSpec:
    """One level of the interconnect, seen from a single chip."""

    bandwidth_GBps: float  # unidirectional bytes/s one chip can push into this fabric, 1e9 B/s
    latency_us: float  # per-message (per ring hop) latency, microseconds


@dataclass(frozen=True)
class ChipSpec:
    """One accelerator (or one CPU worker process)."""

    name: str
    peak_tflops: float  # dense bf16/fp16 matmul peak, 1e12 FLOP/s (the MFU denominator)
    memory_GB: float  # device memory usable by the framework, 1e9 bytes
    memory_bandwidth_GBps: float  # device memory bandwidth, 1e9 B/s
    matmul_efficiency: float  # fraction of peak reached by large GEMMs (assumption/measured)
    attention_efficiency: float  # fraction of peak reached by fused (flash) attention
    half_efficiency_rows: int  # GEMM rows (tokens) at which efficiency is half its maximum


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: `num_chips` chips in fast domains of `chips_per_domain`.

    A *domain* is the set of chips on the fast fabric: one 8-chip server (HCCS, NVLink) or a
    whole supernode (384 chips on one unified bus). Traffic leaving a domain uses `inter`.
    """

    kind: str
    chip: ChipSpec
    num_chips: int
    chips_per_domain: int
    intra: LinkSpec  # fabric inside a domain
    inter: LinkSpec  # scale-out network between domains (per-chip NIC share)
    host: LinkSpec  # device <-> host memory (swap / offload), per chip
    host_memory_GB_per_chip: float  # host DRAM available per chip for offload, 1e9 bytes

    def __post_init__(self) -> None:
        if self.num_chips <= 0:
            raise ValueError(f"cluster num_chips={self.num_chips} must be > 0")
        if self.chips_per_domain <= 0:
            raise ValueError(f"cluster chips_per_domain={self.chips_per_domain} must be > 0")

    @property
    def num_domains(self) -> int:
        return -(-self.num_chips // self.chips_per_domain)

    def with_chips(self, num_chips: int) -> "ClusterSpec":
        return dataclasses.replace(self, num_chips=num_chips)

    def link_for(self, group_size: int, stride: int = 1) -> LinkSpec:
        """The slowest link a group of `group_size` ranks spaced `stride` apart crosses."""
        span = (group_size - 1) * stride + 1
        return self.intra if span <= self.chips_per_domain else self.inter


# ---- presets -------------------------------------------------------------------------------

# Ascend 910B: ~313 TFLOPS fp16/bf16 dense, 64 GB HBM2e at ~1.6 TB/s (public figures for the
# 910B3-class part). Server: 8 chips fully meshed by HCCS (7 links x 56 GB/s = 392 GB/s
# aggregate; we use 196 GB/s unidirectional as the all-to-all rate), one 200 Gb/s RoCE NIC
# per chip (25 GB/s) between servers, PCIe 4.0 x16 to the host (~25 GB/s achievable).
ASCEND_910B = ChipSpec("ascend-910b", peak_tflops=313.0, memory_GB=64.0,
                       memory_bandwidth_GBps=1600.0, matmul_efficiency=0.70,
                       attention_efficiency=0.45, half_efficiency_rows=96)

# CloudMatrix-384-style supernode chip (Ascend 910C: two 910B-class dies in one package):
# ~752 TFLOPS bf16 dense, 128 GB HBM at ~3.2 TB/s; every chip on one unified-bus fabric at
# 392 GB/s unidirectional; 400 Gb/s (50 GB/s) RDMA per chip between supernodes.
ASCEND_910C = ChipSpec("ascend-910c", peak_tflops=752.0, memory_GB=128.0,
                       memory_bandwidth_GBps=3200.0, matmul_efficiency=0.70,
                       attention_efficiency=0.45, half_efficiency_rows=96)

# NVIDIA H100 SXM5: 989 TFLOPS bf16 dense, 80 GB HBM3 at 3.35 TB/s; NVLink4 450 GB/s
# unidirectional per GPU inside an 8-GPU HGX node; 400 Gb/s InfiniBand NDR (50 GB/s) per GPU.
H100 = ChipSpec("h100-sxm", peak_tflops=989.0, memory_GB=80.0, memory_bandwidth_GBps=3350.0,
                matmul_efficiency=0.70, attention_efficiency=0.50, half_efficiency_rows=128)

# NVIDIA H200 SXM: same compute as H100, 141 GB HBM3e at 4.8 TB/s.
H200 = dataclasses.replace(H100, name="h200-sxm", memory_GB=141.0, memory_bandwidth_GBps=4800.0)

# NVIDIA H20 (HGX): 148 TFLOPS bf16 dense, 96 GB HBM3 at 4.0 TB/s; NVLink 900 GB/s per GPU
# (450 GB/s each way) inside an 8-GPU node; 400 Gb/s (50 GB/s) RDMA per GPU between nodes.
H20 = dataclasses.replace(H100, name="h20", peak_tflops=148.0, memory_GB=96.0, memory_bandwidth_GBps=4000.0)

# This machine before `measure_cpu` has run: one worker process on 2 cores. The FLOP rate
# matches the ~8K train tokens/s of the 0.9M-active tiny model measured here
# (6 * 0.9M * 8K ~ 43 GFLOP/s, at the assumed 30% efficiency ~ 0.15 TFLOP/s peak).
CPU_DEFAULT = ChipSpec("cpu-2core", peak_tflops=0.15, memory_GB=8.0, memory_bandwidth_GBps=10.0,
                       matmul_efficiency=0.30, attention_efficiency=0.15, half_efficiency_rows=8)


def _cluster_910b(num_chips: int) -> ClusterSpec:
    return ClusterSpec("910b", ASCEND_910B, num_chips, chips_per_domain=8,
                       intra=LinkSpec(196.0, 5.0), inter=LinkSpec(25.0, 10.0),
                       host=LinkSpec(25.0, 10.0), host_memory_GB_per_chip=192.0)


def _cluster_cm384(num_chips: int) -> ClusterSpec:
    return ClusterSpec("cm384", ASCEND_910C, num_chips, chips_per_domain=384,
                       intra=LinkSpec(392.0, 3.0), inter=LinkSpec(50.0, 10.0),
                       host=LinkSpec(50.0, 10.0), host_memory_GB_per_chip=256.0)


def _cluster_h100(num_chips: int) -> ClusterSpec:
    return ClusterSpec("h100", H100, num_chips, chips_per_domain=8,
                       intra=LinkSpec(450.0, 3.0), inter=LinkSpec(50.0, 8.0),
                       host=LinkSpec(55.0, 10.0), host_memory_GB_per_chip=256.0)


def _cluster_h200(num_chips: int) -> ClusterSpec:
    return dataclasses.replace(_cluster_h100(num_chips), kind="h200", chip=H200)


def _cluster_h20(num_chips: int) -> ClusterSpec:
    return dataclasses.replace(_cluster_h100(num_chips), kind="h20", chip=H20)


def _cluster_cpu(num_chips: int) -> ClusterSpec:
    # One "chip" = one worker process; processes talk through shared memory (gloo).
    return ClusterSpec("cpu", CPU_DEFAULT, num_chips, chips_per_domain=num_chips,
                       intra=LinkSpec(2.0, 50.0), inter=LinkSpec(1.0, 100.0),
                       host=LinkSpec(5.0, 1.0), host_memory_GB_per_chip=8.0)


CLUSTER_KINDS = {
    "910b": _cluster_910b,
    "cm384": _cluster_cm384,
    "h100": _cluster_h100,
    "h200": _cluster_h200,
    "h20": _cluster_h20,
    "cpu": _cluster_cpu,
}


def get_cluster(kind: str, num_chips: int) -> ClusterSpec:
    if kind not in CLUSTER_KINDS:
        raise ValueError(f"unknown cluster kind {kind!r}; allowed: {', '.join(CLUSTER_KINDS)}")
    return CLUSTER_KINDS[kind](num_chips)


def parse_cluster(text: str, flag: str = "--cluster") -> ClusterSpec:
    """`910b:6144` -> the 910B preset with 6144 chips; `path.json:64` -> a saved spec."""
    kind, sep, count = text.rpartition(":")
    if not sep or not count.isdigit() or int(count) <= 0:
        raise ValueError(f"{flag}={text!r} must be KIND:NUM_CHIPS with NUM_CHIPS > 0, "
                         f"KIND one of {', '.join(CLUSTER_KINDS)} or a spec .json file")
    if kind.endswith(".json"):
        return load_cluster(kind).with_chips(int(count))
    if kind not in CLUSTER_KINDS:
        raise ValueError(f"{flag}={text!r}: unknown kind {kind!r}; "
                         f"allowed: {', '.join(CLUSTER_KINDS)} or a spec .json file")
    return get_cluster(kind, int(count))


# ---- JSON ----------------------------------------------------------------------------------

def cluster_to_dict(spec: ClusterSpec) -> dict:
    return dataclasses.asdict(spec)


def cluster_from_dict(data: dict) -> ClusterSpec:
    fields = dict(data)
    try:
        fields["chip"] = ChipSpec(**fields["chip"])
        for key in ("intra", "inter", "host"):
            fields[key] = LinkSpec(**fields[key])
        return ClusterSpec(**fields)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"invalid cluster spec: {exc}") from exc


def save_cluster(spec: ClusterSpec, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cluster_to_dict(spec), indent=2) + "\n")


def load_cluster(path: str | Path) -> ClusterSpec:
    return cluster_from_dict(json.loads(Path(path).read_text()))

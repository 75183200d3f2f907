"""Cluster planner and RL simulator; importable without torch.

Specs (`hardware`, `calibration`), the training cost model (`costs`, `comm`, `plan`,
`memory`, `step`), the parallel-strategy search (`search`), the discrete-event RL simulator
(`rl_config`, `rl_sim`, `report`) and the `plan` / `simulate` subcommands (`cli`).
"""

from rlfusion.sim.calibration import Calibration, cpu_default, load_calibration
from rlfusion.sim.hardware import ClusterSpec, get_cluster, parse_cluster
from rlfusion.sim.plan import ParallelPlan, TrainJob
from rlfusion.sim.rl_config import RLSimConfig, load_rl_config
from rlfusion.sim.rl_sim import simulate
from rlfusion.sim.rl_state import SimResult, TimelineEvent
from rlfusion.sim.search import SearchResult, search_plans
from rlfusion.sim.step import StepEstimate, estimate_step

__all__ = [
    "Calibration", "ClusterSpec", "ParallelPlan", "RLSimConfig", "SearchResult", "SimResult",
    "StepEstimate", "TimelineEvent", "TrainJob", "cpu_default", "estimate_step", "get_cluster",
    "load_calibration", "load_rl_config", "parse_cluster", "search_plans", "simulate",
]

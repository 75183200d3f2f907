"""The RL controller: the loop over the RL stages, with evaluation, metrics, checkpoints and
resume. It holds metadata only; the devices (`devices.Devices`) hold the models and the
samples, which move between them through the DistQueue.

    step k:  devices.rollout(group ids, v_k)     rows: problem, tokens, logprobs, reward, ref logprobs
             devices.update(n rows)   first train device: advantages on each row's numbers,
                                      the kept rows split by tokens; every train device reads
                                      its rows and steps, v_k → v_k+1; the rows retire
             metrics / periodic evaluation (on the devices) / checkpoint

With StaleSync (`stalesync.enabled`) the rollout is partial and runs under the staleness bound
(`rlfusion.stalesync` holds the rules and the book); the rollout devices put each finished
group into the queue themselves and keep the paused samples, the book holds ids and versions,
and the update reads the rows of the groups the book hands out by id.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rlfusion.config import from_dict
from rlfusion.errors import CollapseError, RunError
from rlfusion.evaluate import EvalResult, eval_max_new_tokens, summarize
from rlfusion.model import lora
from rlfusion.model.checkpoint import load_base
from rlfusion.obs.files import atomic_write_text
from rlfusion.obs.metrics import MetricsWriter, truncate_metrics
from rlfusion.obs.timeline import Timeline
from rlfusion.rl.env import import_env, stop_ids
from rlfusion.rl.rewards import import_reward
from rlfusion.rl.tasks import make_task
from rlfusion.runtime import base_fit, run_state
from rlfusion.runtime.devices import Devices, LocalDevices
from rlfusion.runtime.heap import freeze_long_lived, release_long_lived
from rlfusion.runtime.train_config import TrainConfig
from rlfusion.runtime.deployment import DeploymentPlan
from rlfusion.model.flops import forward_flops
from rlfusion.runtime.stalesync_devices import RuntimeScheduleDevices, learn
from rlfusion.stalesync.book import StalenessBook
from rlfusion.stalesync.rules import overlaps
from rlfusion.stalesync.schedule import StaleSyncSchedule
from rlfusion.runtime.stop import RunInterrupted, StopRequest
from rlfusion.runtime.ray_devices import RayDevices


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    base_accuracy: float
    final_accuracy: float
    seconds: float
    stopped: str  # why the loop ended


class RLTrainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, base_path: Path):
        torch.set_num_threads(cfg.threads)
        if cfg.deterministic or torch.are_deterministic_algorithms_enabled():  # else a no-op that
            torch.use_deterministic_algorithms(cfg.deterministic)  # imports torch._inductor (~0.3 s)
        torch.manual_seed(cfg.seed)
        self.cfg, self.run_dir = cfg, run_dir
        base_fit.check_base(cfg, base_path, stalesync_overlaps(cfg))  # from its config files, before any copy is built
        model, tokenizer, _ = load_base(base_path, max_seq_len=cfg.context_len or None)
        if tokenizer is None:
            raise ValueError(f"base checkpoint {base_path} has no tokenizer")
        if cfg.rollout.max_new_tokens >= model.config.max_seq_len:
            raise ValueError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                             f"model's context of {model.config.max_seq_len} tokens (base {base_path}); lower it or "
                             f"set context_len > {cfg.rollout.max_new_tokens}")
        if cfg.env.max_episode_tokens >= model.config.max_seq_len:
            raise ValueError(f"env.max_episode_tokens={cfg.env.max_episode_tokens} leaves no room for a prompt in the "
                             f"model's context of {model.config.max_seq_len} tokens (base {base_path}); lower it or "
                             f"set context_len > {cfg.env.max_episode_tokens}")
        spec = cfg.optim.lora_spec(cfg.seed)
        if spec is not None:  # adapters on the frozen base, as on every device (checkpoints hold them only)
            lora.attach(model, spec, base=base_path)
        self.tokenizer, self.model = tokenizer, model  # the controller's copy: checkpoints are written from it
        self.task = make_task(cfg.task, cfg.data, tokenizer, model.config.max_seq_len - cfg.rollout.max_new_tokens)
        plan = DeploymentPlan.build(cfg.deploy, overlap=stalesync_overlaps(cfg))
        if plan.train_layout or plan.infer_ep > 1:
            _check_train_layout(cfg, plan, model.config)
        if (cfg.algo.routing_replay != "none" or cfg.rollout.record_routes) and not model.config.num_moe_layers:
            raise ValueError(f"algo.routing_replay={cfg.algo.routing_replay} / rollout.record_routes is invalid with "
                             f"the base {base_path}: it has no MoE layer, so there are no routes to record or replay")
        if cfg.rollout.backend == "vllm":
            check_vllm_rollout(cfg, model, base_path)
        if cfg.reward != "task":  # a bad spec is named here, not as a device that failed to start
            import_reward(cfg.reward)
        if cfg.env.name:  # and an environment's, with its stop texts against the run's tokenizer
            stop_ids(import_env(cfg.env.name), tokenizer, cfg.env.name)
        if cfg.deploy.backend == "ray":
            self.devices: Devices = RayDevices(cfg, plan, base_path)
        else:
            self.devices = LocalDevices(cfg, plan, base_path)
        self.timeline = Timeline()
        self.step = 0
        self.elapsed = 0.0  # RL seconds of earlier segments of a resumed run
        self.base_accuracy: float | None = None
        self.bad_steps = 0  # consecutive steps that look like a collapse
        self.saved_step: int | None = None  # the step of the run folder's checkpoint
        self.progress = True
        self.stale = (StalenessBook(cfg.stalesync, cfg.rollout.prompts_per_step, cfg.rollout.group_size)
                      if cfg.stalesync.enabled else None)
        # separated devices with s >= 1: the next update's rollout runs alongside this update
        self.overlap = stalesync_overlaps(cfg)
        self.hybrid = cfg.deploy.mode == "hybrid"
        self.schedule = (StaleSyncSchedule(self.stale, RuntimeScheduleDevices(self.devices, self.hybrid), self.overlap,
                                           self.hybrid) if self.stale is not None else None)
        self._eval_spans: list[tuple[str, float, float]] = []
        if cfg.deploy.backend == "ray":  # the driver of a multi-process run: a long-lived process
            freeze_long_lived()  # full collections no longer walk imports, model and task

    @property
    def version(self) -> int:
        """The policy version: updates so far (the devices' counter)."""
        return self.devices.version

    # ---- one RL step ----------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        if self.stale is not None:
            return self._stalesync_step()
        wall0 = time.time()
        t0 = time.perf_counter()
        P = self.cfg.rollout.prompts_per_step
        generated = self.devices.rollout(list(range(self.step * P, (self.step + 1) * P)), self.version)
        t_rollout = time.perf_counter() - t0
        metrics, _ = learn(self.devices, P * self.cfg.rollout.group_size)
        metrics.update(self._step_metrics(generated, t0, t_rollout))
        metrics.update(self._record_timeline(wall0, time.time()))
        self.step += 1
        return metrics

    def _step_metrics(self, generated: int, t0: float, t_rollout: float) -> dict[str, float]:
        return {
            "rollout_tokens_per_s": generated / max(t_rollout, 1e-9),
            "time_rollout_s": t_rollout,
            "time_step_s": time.perf_counter() - t0,
            "generated_tokens": generated,
        }
    # ---- StaleSync (rlfusion.stalesync) ----

    def _stalesync_step(self) -> dict[str, float]:
        """One update under the staleness bound, as `StaleSyncSchedule.step` orders it: partial
        rollout until the threshold (co-located), or the next update's rollout alongside this
        update (separated and hybrid, s >= 1). The batch the book hands out is rows the rollout
        devices put in the queue; the update reads them by id."""
        wall0, t0 = time.time(), time.perf_counter()
        out = self.schedule.step(self.version)
        metrics = out.update.metrics
        if self.hybrid and metrics["trained"]:
            metrics["time_weight_sync_s"] = self.schedule.devices.last_sync_s
        metrics.update(out.stats)
        metrics.update({"dropped_groups": out.dropped_groups, "groups_in_flight": float(self.schedule.in_flight()),
                        "dropped_tokens_total": float(self.stale.stats["dropped_tokens"])})
        t_rollout = sum(r.seconds for r in out.rollouts)  # the rollouts' own wall time (the fill's included)
        metrics.update(self._step_metrics(out.generated_tokens, t0, t_rollout))
        metrics.update(self._record_timeline(wall0, time.time()))
        self.step += 1
        return metrics

    def _record_timeline(self, start: float, end: float) -> dict[str, float]:
        """Add this step's spans (and those of an evaluation since the last step) to the run
        timeline; returns per-device utilization of the step (busy / step wall time), engine
        pass counts, memory peaks and queue bytes."""
        reports = self.devices.reports()
        step = Timeline(origin_wall_s=start)
        for d, report in reports.items():
            device = f"device{d}"
            step.add_wall(device, "idle", start, end)  # the step's window, so wall = step time
            for phase, s, e in report["spans"]:
                if s >= start:
                    step.add_wall(device, phase, s, e, step=self.step)
                self.timeline.add_wall(device, phase, s, e, step=self.step)
        util = {d: u.fraction for d, u in step.utilization().items()}
        switch_s, queue_s = ([sum(e - s for phase, s, e in r["spans"] if phase == name and s >= start)
                              for r in reports.values()] for name in ("switch", "queue"))
        out = {**{f"utilization_{d}": u for d, u in util.items()},
               "utilization_mean": sum(util.values()) / len(util), "time_switch_s": max(switch_s),
               # queue reads, writes and retires (waits for rows included), busiest device / all devices
               "time_queue_s": max(queue_s), "queue_share": sum(queue_s) / (len(queue_s) * max(end - start, 1e-9)),
               "device_matmul_peak_gflop_per_s": statistics.median(r["matmul_peak_gflop_per_s"] for r in reports.values()),
               **_engine_metrics([{**r["engine"], "matmul_peak_flops": r["matmul_peak_gflop_per_s"] * 1e9}
                                  for r in reports.values() if r["engine"]], self.model.config),
               **_env_metrics([r["engine"] for r in reports.values() if r["engine"]])}
        memory = [r["memory"] for r in reports.values()]
        out["zero_redundancy_ok"] = float(all(m["zero_redundancy"] for m in memory))
        budgets = [m.get("budget_bytes", 0) for m in memory]  # deploy.device_memory_mb (0 = none)
        if any(budgets):
            out["memory_budget_mb"] = max(budgets) / 2**20
        for phase in ("train", "rollout", "switch"):
            peaks = [m["peaks"][phase] for m in memory if phase in m["peaks"]]
            if peaks:
                out[f"memory_peak_{phase}_mb"] = max(peaks) / 2**20
            used = [m["peaks"][phase] / b for m, b in zip(memory, budgets) if b and phase in m["peaks"]]
            if used:  # the fullest device's peak as a share of its budget
                out[f"memory_budget_used_{phase}"] = max(used)
            actor = [m["actor_weight_peaks"][phase] for m in memory if phase in m.get("actor_weight_peaks", {})]
            if actor:  # the actor's weights on the fullest device (a split replica holds part of them)
                out[f"memory_actor_weights_{phase}_mb"] = max(actor) / 2**20
            held = [m["allocator_peaks"][phase] for m in memory if phase in m.get("allocator_peaks", {})]
            if held:  # on CUDA: what the caching allocator really held, activations included
                out[f"memory_allocated_peak_{phase}_mb"] = max(held) / 2**20
        out["optimizer_offloads"] = float(sum(m["offloads"] for m in memory))
        out["optimizer_restores"] = float(sum(m["restores"] for m in memory))
        out["engine_weight_loads"] = float(sum(m["engine_loads"] for m in memory))
        # what moved: through the queue between devices, and across the controller (commands,
        # answers, reports and its own queue reads and writes; none in process)
        queue_bytes = sum(r["queue_bytes"] for r in reports.values())
        out["queue_bytes"] = float(queue_bytes)
        # the part that crossed a process boundary (a device's own rows move in process)
        out["queue_remote_bytes"] = float(sum(r.get("queue_remote_bytes", 0) for r in reports.values()))
        if self.devices.count_bytes:
            driver = self.devices.take_driver_bytes()
            out["driver_bytes"] = float(driver)
            out["driver_bytes_share"] = driver / (driver + queue_bytes) if driver + queue_bytes else 0.0
        return out

    def _check_collapse(self, m: dict[str, float]) -> None:
        bad = m["correct_mean"] == 0.0 or m["truncated_fraction"] > 0.5
        self.bad_steps = self.bad_steps + 1 if bad else 0
        patience = self.cfg.collapse_patience
        if patience and self.bad_steps >= patience:
            raise CollapseError(
                f"policy collapsed: {patience} steps in a row with zero reward or over half the "
                f"responses truncated at {self.cfg.rollout.max_new_tokens} tokens (last: reward "
                f"{m['correct_mean']:.2f}, truncated {m['truncated_fraction']:.0%}); lower optim.lr "
                f"(now {self.cfg.optim.lr}) or set collapse_patience=0 to disable this guard")

    def sync_model(self) -> None:
        """Bring the controller's copy of the policy up to date, for a checkpoint (the devices
        hold the real one)."""
        self.devices.pull_weights(self.model)

    def close(self) -> None:
        if self.devices is not None:
            self.devices.shutdown()
            self.devices = None
            if self.cfg.deploy.backend == "ray":
                release_long_lived()  # what this trainer held may be collected again

    def evaluate(self) -> EvalResult:
        """Greedy held-out accuracy, data-parallel on the rollout devices with the current
        policy (no weights move to the controller)."""
        problems = self.task.heldout()[:self.cfg.eval_problems]
        max_new = eval_max_new_tokens(self.tokenizer, problems, self.cfg.env.max_episode_tokens
                                      or self.cfg.rollout.max_new_tokens, self.model.config.max_seq_len)
        return summarize(self.devices.evaluate(list(range(len(problems))), max_new))

    # ---- the loop ---------------------------------------------------------------------------

    def run(self, progress: bool = True) -> RunResult:
        self.progress = progress
        if self.saved_step is None:  # a new run (not resumed): never over another run's outputs
            run_state.refuse_outputs(self.run_dir)
        write_run_config(self.run_dir, self.cfg)
        # a signal during the final evaluation and save lets them finish: the run is then complete
        with StopRequest() as stop:
            if self.base_accuracy is None:
                self.base_accuracy = self.evaluate().accuracy
            if not run_state.has_checkpoint(self.run_dir):
                self._save()  # a way back from the first step on, whatever stops the run
            writer = MetricsWriter(self.run_dir, purge_step=self.step + 1 if self.step else None)
            if self.step == 0:
                writer.log(0, {"heldout_accuracy": self.base_accuracy})
            try:
                stopped, last_acc, last_eval = self._loop(writer, stop)
            except RunError as e:
                writer.close()
                if isinstance(e, RunInterrupted):
                    raise
                raise type(e)(f"{e}; the run stopped at step {self.step}: its last checkpoint (step "
                              f"{self.saved_step}) is in {self.run_dir / 'checkpoint'} and `rlfusion train "
                              f"--resume {self.run_dir}` continues from it") from None
            final = last_acc if last_eval == self.step else self._final_eval(writer)
            writer.close()
            self._write_timeline()
            self._save()
            run_state.save_final(self, final)
        return RunResult(self.run_dir, self.step, self.base_accuracy, final, self.elapsed, stopped)

    def _final_eval(self, writer: MetricsWriter) -> float:
        final = self.evaluate().accuracy
        writer.log(self.step, {"heldout_accuracy": final})
        return final

    def _loop(self, writer: MetricsWriter, stop: StopRequest) -> tuple[str, float, int]:
        """Steps until max_steps, the time budget or a stop signal (then checkpoint and raise
        `RunInterrupted`). Returns why it ended, the last held-out accuracy and its step."""
        cfg = self.cfg
        start = time.monotonic() - self.elapsed
        bar = tqdm(total=cfg.max_steps or None, initial=self.step, disable=not self.progress, unit="step")
        stopped, last_acc, last_eval = "time budget", self.base_accuracy, self.step
        try:
            while True:
                if stop.requested:
                    self._stop_on_signal(stop)
                if cfg.max_steps and self.step >= cfg.max_steps:
                    return "max_steps", last_acc, last_eval
                if time.monotonic() - start >= cfg.time_budget_s:
                    return stopped, last_acc, last_eval
                metrics = self.train_step()
                if self.step % cfg.eval_every == 0:
                    last_acc = metrics["heldout_accuracy"] = self.evaluate().accuracy
                    last_eval = self.step
                self.elapsed = time.monotonic() - start
                writer.log(self.step, metrics)
                self._check_collapse(metrics)
                bar.update(1)
                bar.set_postfix_str(_progress_line(self, metrics, last_acc, start))
                if self.step % cfg.checkpoint_every == 0:
                    self._save()
        finally:
            bar.close()

    def _stop_on_signal(self, stop: StopRequest) -> None:
        if self.saved_step != self.step:
            self._save()
        self._write_timeline()
        raise RunInterrupted(f"stopped by {stop.requested} after step {self.step}; its checkpoint is in "
                             f"{self.run_dir / 'checkpoint'} and `rlfusion train --resume {self.run_dir}` "
                             f"continues from it", stop.signum)

    def _save(self) -> None:
        run_state.save(self)
        self.saved_step = self.step

    def _write_timeline(self) -> None:
        for d, report in self.devices.reports().items():  # spans since the last step (a final evaluation)
            for phase, s, e in report["spans"]:
                self.timeline.add_wall(f"device{d}", phase, s, e, step=self.step)
        if self.timeline.spans:
            self.timeline.write_chrome_trace(self.run_dir / "timeline.json")
            self.timeline.plot_gantt(self.run_dir / "timeline.png", title=f"{self.run_dir.name}: device timeline")


def write_run_config(run_dir: Path, cfg: TrainConfig) -> None:
    """`run_dir/config.json`: what `--resume` rebuilds the run from."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))


def _check_train_layout(cfg: TrainConfig, plan: DeploymentPlan, model_cfg) -> None:
    """Refuse a training layout this run cannot use, before any worker starts."""
    if cfg.algo.advantage == "gae":
        raise ValueError(f"{cfg.deploy.layout_name} is invalid with "
                         "algo.advantage=gae: the critic trains full replicas only (use deploy.train_tp=1, "
                         "train_ep=1 and train_fsdp=false, or a group advantage such as grpo)")
    try:
        plan.parallel_layout().validate(len(plan.train), model_cfg)
        plan.inference_layout().validate(len(plan.rollout), model_cfg)
    except ValueError as e:
        raise ValueError(f"{cfg.deploy.layout_name} does not fit the model: "
                         f"{e}") from None
    if plan.infer_ep > 1 and cfg.rollout.backend != "native":
        raise ValueError(f"deploy.infer_ep={plan.infer_ep} is invalid with rollout.backend={cfg.rollout.backend}: "
                         "an expert-parallel rollout runs on the native engine here (allowed: native)")


def check_vllm_rollout(cfg: TrainConfig, model, base_path: Path) -> None:
    """Refuse `rollout.backend=vllm` where it cannot run, before any worker starts: vLLM is not
    installed, or it cannot serve this policy exactly."""
    import importlib.util

    from rlfusion.engine.vllm_backend import EXTRA, check_servable

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"rollout.backend=vllm needs vLLM, which is not installed: on a machine with CUDA GPUs "
                         f"run pip install 'rlfusion[{EXTRA}]' (or set rollout.backend=native)")
    if cfg.optim.router_bias_update:
        raise ValueError("rollout.backend=vllm is invalid with optim.router_bias_update=true: the routers' "
                         "expert bias has no place in vLLM's Qwen MoE models (use rollout.backend=native)")
    try:
        check_servable(model)
    except ValueError as e:
        raise ValueError(f"rollout.backend=vllm cannot serve base {base_path}: {e} (use an HF base, "
                         f"base=PATH, or rollout.backend=native)") from None


def stalesync_overlaps(cfg: TrainConfig) -> bool:
    """Whether StaleSync will run the next rollout alongside the update (`stalesync.rules.overlaps`)."""
    return overlaps(cfg.deploy.mode, cfg.stalesync)


def _progress_line(trainer: RLTrainer, m: dict[str, float], acc: float, start: float) -> str:
    left = max(0.0, trainer.cfg.time_budget_s - (time.monotonic() - start))
    return (f"reward {m['reward_mean']:.2f} len {m['response_length_mean']:.0f} "
            f"acc {acc:.1%} ETA {left:.0f}s")


def resume(run_dir: Path, overrides: dict | None = None) -> RLTrainer:
    """Rebuild a trainer from `run_dir/config.json` and its last checkpoint."""
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not an rlfusion run folder (no config.json)")
    if not run_state.has_checkpoint(run_dir):
        raise FileNotFoundError(run_state.no_state_message(run_dir))
    try:
        data = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{cfg_path} is not a readable run config ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cfg_path} is not a run config (expected a JSON object)")
    # run folders of earlier versions hold the pretraining keys `rlfusion train` no longer has
    data.pop("pretrain", None)
    for key, value in (overrides or {}).items():
        data[key] = value
    cfg = from_dict(TrainConfig, data)
    trainer = RLTrainer(cfg, run_dir, Path(cfg.base))
    run_state.load(trainer)
    truncate_metrics(run_dir / "metrics.jsonl", trainer.step)
    return trainer


def _env_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """This step's episodes over the rollout devices (`env.name` runs): turns per episode,
    environment calls and failures, the environment's seconds and the share of the time a call
    was in flight that the engine decoded through (hidden), and each `env_info_*` number summed
    and per call (e.g. `env_info_tool_call_correct_per_call`: the share of correct tool calls)."""
    if not any("env_episodes" in e for e in stats):
        return {}
    total = {k: sum(e.get(k, 0.0) for e in stats) for k in dict.fromkeys(k for e in stats for k in e if k.startswith("env_"))}
    episodes, calls = total["env_episodes"], total["env_calls"]
    flight = total["env_hidden_s"] + total["env_exposed_s"]
    out = {"env_episodes": episodes, "env_turns_per_episode": total["env_turns"] / episodes if episodes else 0.0,
           "env_calls": calls, "env_failures": total["env_failures"], "time_env_s": total["env_call_s"],
           "env_hidden_share": total["env_hidden_s"] / flight if flight else 1.0}
    for k, v in total.items():
        if k.startswith("env_info_"):
            out[k] = v
            out[f"{k}_per_call"] = v / calls if calls else 0.0
    return out


def _engine_metrics(stats: list[dict[str, float]], model_cfg) -> dict[str, float]:
    """This step's rollout engine passes, from the busiest engine (the one that sets the pace):
    decode and prefill seconds, passes and mean rows per decode pass, and the useful FLOP/s its
    decode passes achieved (`model.flops.forward_flops`; 0 where the engine does not report the
    positions its rows attended), with their share of its device's matmul peak where the stats
    carry it (`matmul_peak_flops`)."""
    if not stats:
        return {}
    busiest = max(stats, key=lambda e: e["decode_s"] + e["prefill_s"])
    passes = busiest["decode_passes"]
    flops = forward_flops(model_cfg, busiest["decode_rows"], busiest.get("decode_context", 0.0))
    known = busiest.get("decode_context", 0.0) > 0 and busiest["decode_s"] > 0
    rate = flops / busiest["decode_s"] if known else 0.0
    peak = busiest.get("matmul_peak_flops", 0.0)
    return {"time_decode_s": busiest["decode_s"], "time_prefill_s": busiest["prefill_s"],
            "engine_decode_gflop_per_s": rate / 1e9,
            **({"engine_decode_peak_share": rate / peak} if peak else {}),
            "engine_decode_passes": passes, "engine_prefill_passes": busiest["prefill_passes"],
            "engine_decode_rows_mean": busiest["decode_rows"] / passes if passes else 0.0,
            # a lock-step engine (`deploy.infer_ep`) with no rows of its own joins its group's passes empty
            "engine_idle_passes": max(e.get("idle_passes", 0.0) for e in stats),
            "time_idle_pass_s": max(e.get("idle_s", 0.0) for e in stats),
            # sequences the smallest KV cache holds (what a memory budget leaves it)
            "engine_kv_rows": min(e.get("kv_rows", 0.0) for e in stats),
            # StaleSync's stop-rule sums on the busiest engine: the time it waited for the others
            "time_stop_sync_s": busiest.get("stop_sync_s", 0.0),
            "stop_sync_calls": busiest.get("stop_sync_calls", 0.0)}


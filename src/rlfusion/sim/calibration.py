"""Measured inputs of the RL simulator: what one rollout engine and one trainer cost.

Owns `Calibration` (a typed record of microbenchmark numbers) and its JSON load/save. The
honesty rule of the simulator lives here: every field is a *measured microbenchmark* input
(decode step time vs batch size, train tokens/s, switch time, transfer bandwidth) — never a
value fitted to the RL throughput the simulator is asked to predict.

Three sources write one: `measure.measure_calibration()` times the real engine, actor update,
reference forward, switch, weight broadcast and two-process contention on this machine
(`rlfusion simulate --calibrate PATH`); `cluster_calibration.calibration_from_hardware()`
derives one for an accelerator cluster from the training cost model and hardware specs (for
projections, every assumption listed in `source_notes`); `cpu_default()` holds the figures measured
on a 2-core CPU with the tiny MoE (decode 1 -> 3.0 ms, 8 -> 5.5, 32 -> 7.7, 128 -> 13.4, 256 -> 19.1 ms per step;
RL update 7-9K tokens/s), with the fields it does not give marked `placeholder`.
"""

from __future__ import annotations

import dataclasses
import json
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from rlfusion.model.row_segments import row_segments


KIND_SPEEDS = ("decode_speed", "decode_lockstep_speed", "context_speed", "context_lockstep_speed",
               "train_speed", "train_lockstep_speed")


@dataclass(frozen=True)
class Calibration:
    """Costs of one rollout engine instance and of the trainer, per device where stated."""

    decode_batch_sizes: tuple[int, ...]  # active sequences in one decode step (ascending)
    decode_step_ms: tuple[float, ...]  # wall time of one decode step at that batch size, ms
    prefill_ms_per_token: float  # prompt (or resumed-context) prefill cost per token, ms
    train_tokens_per_s_per_device: float  # actor update throughput (fwd+bwd+optim) per device
    train_step_overhead_s: float  # fixed cost per update (optimizer step, sync), s
    switch_s: float  # one train<->inference switch of the actor on one device group, s
    transfer_GBps: float  # DistQueue / weight-sync bandwidth per reader, 1e9 B/s
    weight_GB: float  # actor weights moved by one weight sync (separated mode), 1e9 B
    devices_per_engine: int = 1  # devices one rollout engine instance spans
    forward_fraction: float = 1.0 / 3.0  # forward-only (ref/reward) cost / train cost per token
    prefill_fixed_ms: float = 0.0  # fixed cost of one prefill pass (any rows), ms
    reference_tokens_per_s_per_device: float = 0.0  # measured ref forward rate; 0: use fraction
    reference_overhead_s: float = 0.0  # fixed cost of one reference pass over a batch, s
    train_context_ns: float = 0.0  # update time per token and per position of its sequence
    #                                (attention over the sequence): a sample of L tokens adds
    #                                L^2 x this to the tokens / rate line, ns
    reference_context_ns: float = 0.0  # the same for the reference (or reward) forward, ns
    reference_switch_s: float | None = None  # bring the offloaded reference in and out
    #                                          (fully_shared mode); None: same as switch_s
    concurrent_speed: float = 1.0  # per-device speed while every device of a host is busy,
    #                                relative to one busy device alone (CPU cores that share
    #                                caches and memory bandwidth: < 1; accelerators: 1)
    lockstep_speed: float = 0.0  # the same while the devices work in lock-step, as colocated and
    #                              fully shared devices do (they meet at the driver's phase barriers
    #                              and the gradient all-reduce, so work that slows one holds up
    #                              the other); 0: concurrent_speed
    # the same two speeds per kind of work, from the probe's parts timed apart (0: the whole
    # workload's `concurrent_speed` / `lockstep_speed`): two busy CPU processes slow memory-bound
    # work (the attention's cache reads) more than compute-bound work (the update's matmuls)
    decode_speed: float = 0.0  # decode passes at the table's context, and prefill
    decode_lockstep_speed: float = 0.0
    context_speed: float = 0.0  # the attention's reads beyond the table's context (`decode_context_ms`)
    context_lockstep_speed: float = 0.0
    train_speed: float = 0.0  # the update and the reference (or reward) forward
    train_lockstep_speed: float = 0.0
    grad_sync_GB: float = 0.0  # gradient bytes each train device all-reduces per update across
    #                            the train devices (data-parallel replicas); 0: in the train rate
    stop_sync_s: float = 0.0  # one stop-rule sum of the rollout devices (a 4-integer gloo
    #                          all-reduce) during a StaleSync partial rollout, s, measured
    #                          while both devices decode (the wait for the other's step
    #                          jitter included)
    decode_context_ms: float = 0.0  # extra decode-step time per active row and per context
    #                                 position beyond `decode_reference_context`, ms (attention
    #                                 over the KV cache; every row attends over the longest
    #                                 context of the step); 0: context-independent
    decode_reference_context: int = 0  # the context length the decode table was measured at
    decode_segment_ms: float = 0.0  # each run of rows a decode pass reads apart beyond the first
    #                                 (`row_segments`: its own slices, matmuls and masked softmax
    #                                 per layer over rows of mixed lengths), ms
    advantage_s_per_sample: float = 0.0  # the advantage stage's work per sample between the
    #                                      rollout and the update, on the first train device
    #                                      (reading each row's numbers, advantages, the split), s
    probe_s: float = 0.0  # seconds of a fixed reference workload on one idle device when these
    #                       numbers were measured (a machine-speed mark; 0 = not recorded)
    source: str = "unspecified"  # where the numbers come from
    source_notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        sizes, times = self.decode_batch_sizes, self.decode_step_ms
        if not sizes or len(sizes) != len(times):
            raise ValueError("calibration.decode_batch_sizes and decode_step_ms must be "
                             "non-empty and the same length")
        if list(sizes) != sorted(set(sizes)) or sizes[0] <= 0:
            raise ValueError(f"calibration.decode_batch_sizes={sizes} must be ascending, > 0")
        for key in ("train_tokens_per_s_per_device", "transfer_GBps", "devices_per_engine"):
            if getattr(self, key) <= 0:
                raise ValueError(f"calibration.{key}={getattr(self, key)} must be > 0")
        if not 0.0 < self.concurrent_speed <= 1.0:
            raise ValueError(f"calibration.concurrent_speed={self.concurrent_speed} must be "
                             "in (0, 1]")
        for key in ("lockstep_speed",) + KIND_SPEEDS:
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"calibration.{key}={getattr(self, key)} must be in [0, 1] "
                                 "(0 = the whole workload's speed)")
        for key in ("prefill_ms_per_token", "prefill_fixed_ms", "train_step_overhead_s",
                    "switch_s", "weight_GB", "reference_tokens_per_s_per_device",
                    "reference_overhead_s", "grad_sync_GB", "stop_sync_s", "decode_context_ms",
                    "decode_reference_context", "advantage_s_per_sample", "train_context_ns",
                    "reference_context_ns", "decode_segment_ms"):
            if getattr(self, key) < 0:
                raise ValueError(f"calibration.{key}={getattr(self, key)} must be >= 0")

    @property
    def lockstep(self) -> float:
        """Per-device speed of devices working in lock-step (`lockstep_speed`, else
        `concurrent_speed`)."""
        return self.lockstep_speed or self.concurrent_speed

    def speed(self, kind: str, lockstep: bool) -> float:
        """Per-device speed of `kind` work ("decode", "context" or "train") while every device of
        the host is busy, independently or in lock-step; the whole workload's where the kind's
        was not measured."""
        if kind not in ("decode", "context", "train"):
            raise ValueError(f"unknown kind of work {kind!r}: decode, context or train")
        measured = getattr(self, f"{kind}_lockstep_speed" if lockstep else f"{kind}_speed")
        return measured or (self.lockstep if lockstep else self.concurrent_speed)

    def contended(self, lockstep: bool) -> "Calibration":
        """These costs while every device of the host is busy (independently, or in lock-step as
        co-located devices and data-parallel trainers work): each kind of work divided by its
        speed. The result has no contention left to apply (every speed 1)."""
        decode, context, train = (self.speed(k, lockstep) for k in ("decode", "context", "train"))
        return self.replace(
            decode_step_ms=tuple(t / decode for t in self.decode_step_ms),
            prefill_ms_per_token=self.prefill_ms_per_token / decode,
            prefill_fixed_ms=self.prefill_fixed_ms / decode,
            decode_context_ms=self.decode_context_ms / context,
            decode_segment_ms=self.decode_segment_ms / decode,
            train_tokens_per_s_per_device=self.train_tokens_per_s_per_device * train,
            train_step_overhead_s=self.train_step_overhead_s / train,
            train_context_ns=self.train_context_ns / train,
            reference_context_ns=self.reference_context_ns / train,
            reference_tokens_per_s_per_device=self.reference_tokens_per_s_per_device * train,
            reference_overhead_s=self.reference_overhead_s / train,
            concurrent_speed=1.0, lockstep_speed=0.0, **dict.fromkeys(KIND_SPEEDS, 0.0))

    def decode_step_s(self, batch: int, context: int = 0) -> float:
        """Step time at `batch` active sequences, every one read up to `context` positions: the
        table plus the attention beyond the table's context."""
        if batch <= 0:
            return 0.0
        extra = batch * max(0, context - self.decode_reference_context) * self.decode_context_ms
        return (self._table_ms(batch) + extra) / 1e3

    def decode_pass_s(self, lengths: list[int]) -> float:
        """One decode pass over rows of these context lengths, in slot order: the table at their
        number plus the attention beyond the table's context over each run of rows the pass
        reads up to its own longest (`row_segments`, as the model reads the cache), plus each
        run beyond the first (`decode_segment_ms`)."""
        if not lengths:
            return 0.0
        segments = row_segments(lengths)
        reads = sum((end - start) * max(0, positions - self.decode_reference_context)
                    for start, end, positions in segments)
        return (self._table_ms(len(lengths)) + reads * self.decode_context_ms
                + (len(segments) - 1) * self.decode_segment_ms) / 1e3

    def _table_ms(self, batch: int) -> float:
        """The decode table at `batch` rows: piecewise linear between measured points, flat below
        the first, extrapolated with the last slope above the last."""
        sizes, times = self.decode_batch_sizes, self.decode_step_ms
        if batch <= sizes[0] or len(sizes) == 1:
            return times[0] if batch <= sizes[0] else times[-1]
        i = min(bisect_left(sizes, batch), len(sizes) - 1)
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)

    def decode_steps_s(self, batch: int, context: int, steps: int) -> float:
        """`steps` decode steps of `batch` rows, the longest context `context` in the first and
        one longer in each next (closed form of the sum of `decode_step_s`)."""
        if steps <= 0 or batch <= 0:
            return 0.0
        base = self.decode_step_s(batch) * steps
        lo = max(1, context - self.decode_reference_context)  # first positive excess
        hi = context + steps - 1 - self.decode_reference_context
        excess = (lo + hi) * (hi - lo + 1) / 2 if hi >= lo else 0.0
        return base + batch * excess * self.decode_context_ms / 1e3

    def prefill_s(self, tokens: int) -> float:
        """One prefill pass over `tokens` prompt (or resumed-context) tokens."""
        if tokens <= 0:
            return 0.0
        return (self.prefill_fixed_ms + tokens * self.prefill_ms_per_token) / 1e3

    def reference_s(self, tokens: int, devices: int, squares: float = 0.0, fixed: bool = True) -> float:
        """Reference (or reward-model) forward over `tokens` split across `devices`; `squares`:
        the sum of the squared sequence lengths (their attention, `reference_context_ns`);
        `fixed`: with the fixed cost of a pass."""
        if self.reference_tokens_per_s_per_device > 0:
            return ((self.reference_overhead_s if fixed else 0.0)
                    + (tokens / self.reference_tokens_per_s_per_device
                       + squares * self.reference_context_ns * 1e-9) / devices)
        return (tokens / self.train_tokens_per_s_per_device
                + squares * self.train_context_ns * 1e-9) / devices * self.forward_fraction

    def train_s(self, tokens: float, devices: int, squares: float = 0.0) -> float:
        """One update over `tokens` (prompt + response) split across `devices` data-parallel
        devices; `squares`: the sum of the squared sequence lengths (their attention)."""
        return (self.train_step_overhead_s
                + (tokens / self.train_tokens_per_s_per_device + squares * self.train_context_ns * 1e-9) / devices)

    def at_probe_speed(self, probe_s: float) -> "Calibration":
        """These costs on the same machine when the reference workload takes `probe_s` (other
        work sharing a CPU machine slows every computation by about the same factor)."""
        if self.probe_s <= 0 or probe_s <= 0:
            raise ValueError("calibration.probe_s and the new probe time must be > 0")
        f = probe_s / self.probe_s
        return self.replace(
            decode_step_ms=tuple(t * f for t in self.decode_step_ms),
            decode_context_ms=self.decode_context_ms * f,
            decode_segment_ms=self.decode_segment_ms * f,
            prefill_ms_per_token=self.prefill_ms_per_token * f,
            prefill_fixed_ms=self.prefill_fixed_ms * f,
            train_tokens_per_s_per_device=self.train_tokens_per_s_per_device / f,
            train_step_overhead_s=self.train_step_overhead_s * f,
            train_context_ns=self.train_context_ns * f,
            reference_context_ns=self.reference_context_ns * f,
            reference_tokens_per_s_per_device=self.reference_tokens_per_s_per_device / f,
            reference_overhead_s=self.reference_overhead_s * f,
            switch_s=self.switch_s * f,
            advantage_s_per_sample=self.advantage_s_per_sample * f,
            reference_switch_s=None if self.reference_switch_s is None
            else self.reference_switch_s * f,
            probe_s=probe_s)

    def reference_rate(self, devices: int) -> float:
        """Reference forward tokens/s of `devices` devices, without the fixed per-pass cost."""
        if self.reference_tokens_per_s_per_device > 0:
            return self.reference_tokens_per_s_per_device * devices
        return self.train_tokens_per_s_per_device * devices / self.forward_fraction

    @property
    def reference_switch(self) -> float:
        return self.switch_s if self.reference_switch_s is None else self.reference_switch_s

    def replace(self, **changes) -> "Calibration":
        return dataclasses.replace(self, **changes)


def cpu_default() -> Calibration:
    """This machine (2-core CPU, tiny MoE, figures measured once by hand), until measured files exist."""
    return Calibration(
        decode_batch_sizes=(1, 8, 32, 128, 256),
        decode_step_ms=(3.0, 5.5, 7.7, 13.4, 19.1),
        prefill_ms_per_token=0.05,
        train_tokens_per_s_per_device=8000.0,
        train_step_overhead_s=0.02,
        switch_s=0.05,
        transfer_GBps=1.0,
        weight_GB=0.0072,  # 1.79M params * 4 bytes
        source="measured by hand (2-core CPU, tiny MoE)",
        source_notes=(
            "decode_step_ms: measured (engine decode step per batch size)",
            "train_tokens_per_s_per_device: measured 7-9K tokens/s, midpoint",
            "prefill_ms_per_token, train_step_overhead_s, switch_s, transfer_GBps: "
            "placeholder until bench/ microbenchmarks write a measured file",
        ),
    )


def save_calibration(cal: Calibration, path: str | Path) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(cal), indent=2) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    data = json.loads(Path(path).read_text())
    for key in ("decode_batch_sizes", "decode_step_ms", "source_notes"):
        if key in data:
            data[key] = tuple(data[key])
    try:
        return Calibration(**data)
    except TypeError as exc:
        raise ValueError(f"invalid calibration file {path}: {exc}") from exc

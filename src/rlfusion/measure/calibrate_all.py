"""Every microbenchmark of `calibrate.py` and `contention.py` on this machine -> a measured
`Calibration` the simulator reads (`rlfusion simulate --calibrate`).

    python -m rlfusion.measure.calibrate_all calibration.json [--quick]
    rlfusion simulate --calibrate calibration.json [--quick]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlfusion.measure.calibrate import (CONTEXT_ROWS, LONG_CONTEXT, default_setup, load_base_model, measure_advantage,
                                        measure_engine, measure_train_and_reference)
from rlfusion.measure.contention import measure_contention, speeds_line
from rlfusion.measure.pair import measure_pair
from rlfusion.sim.calibration import Calibration, save_calibration


def measure_calibration(path: str | Path | None = None, threads: int = 1, quick: bool = False,
                        log=print, smoke: bool = False) -> Calibration:
    """Run every microbenchmark (about 30 s; `quick` about 20 s) and save the calibration.
    `smoke` (a bench's `--smoke`, with `quick`): the repeated timings once each."""
    setup = default_setup(threads, quick, smoke)
    t0 = time.perf_counter()
    model, tokenizer = load_base_model(setup)
    long_model, _ = load_base_model(setup, max_seq_len=max(model.config.max_seq_len, LONG_CONTEXT))
    engine = measure_engine(model, tokenizer, quick, long_model)
    log(f"  engine: decode ms {dict(zip(engine['decode_batch_sizes'], (round(x, 2) for x in engine['decode_step_ms'])))} "
        f"at context {engine['decode_reference_context']}, + {engine['decode_context_ms'] * 1e6:.0f} ns per row "
        f"and longer context token, {engine['decode_segment_ms']:.2f} ms per run of rows read apart, prefill {engine['prefill_fixed_ms']:.2f} ms + "
        f"{engine['prefill_ms_per_token'] * 1e3:.1f} us/token")
    # long samples need the long context; the switch's KV cache is the base's (the default task's)
    train = measure_train_and_reference(long_model, tokenizer, quick, switch_model=model, smoke=smoke)
    log(f"  train {train['train_tokens_per_s_per_device']:,.0f} tok/s + {train['train_step_overhead_s'] * 1e3:.1f} ms "
        f"+ {train['train_context_ns']:.1f} ns x sequence length^2, "
        f"reference {train['reference_tokens_per_s_per_device']:,.0f} tok/s + "
        f"{train['reference_overhead_s'] * 1e3:.1f} ms + {train['reference_context_ns']:.1f} ns x length^2, switch {train['switch_s'] * 1e3:.1f} ms, "
        f"reference switch {train['reference_switch_s'] * 1e3:.1f} ms")
    advantage = measure_advantage(tokenizer, model.config.vocab_size, quick)
    log(f"  advantage stage: {advantage * 1e6:.0f} us per sample between the rollout and the update "
        f"(each row's numbers through the queue, advantages, the data-parallel split)")
    pair = measure_pair(setup)
    bcast_s, idle_sum_s = pair.pop("_bcast_s"), pair.pop("_idle_sum_s")
    log(f"  weight broadcast {pair['weight_GB'] * 1e3:.2f} MB in {bcast_s * 1e3:.1f} ms "
        f"({pair['transfer_GBps']:.2f} GB/s); stop-rule sum (4-int all-reduce) "
        f"{pair['stop_sync_s'] * 1e6:.0f} us while both decode ({idle_sum_s * 1e6:.0f} us idle)")
    contention = measure_contention(setup)
    alone, together, lockstep = contention.pop("_contention")
    log(f"  2 Ray device actors, rollout + long-context decode + update workload: alone {alone:.3f} s, "
        f"both at once {together:.3f} s, in lock-step {lockstep:.3f} s -> speeds (independent / "
        f"lock-step) {speeds_line(contention)}")
    cal = Calibration(
        **engine, **train, **pair, **contention, devices_per_engine=1, advantage_s_per_sample=advantage,
        source=f"measured on this machine by rlfusion.measure.calibrate_all ({threads} thread(s) per "
               f"device, {time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - t0:.0f} s)",
        source_notes=(
            "decode_step_ms / prefill: LLMEngine steps of the shipped base model, fixed-length runs",
            "train / reference: ActorStage.update / ReferenceStage.logprobs on 64 and 256 "
            "synthetic task-shaped samples (line through the two)",
            "switch_s: optimizer offload + KV cache restore and back, / 2; reference_switch_s: "
            "reference weights to host and back",
            "transfer_GBps: gloo broadcast of the weights in 4 MB buckets between 2 processes",
            "stop_sync_s: gloo all-reduce of 4 int64 counts between the same 2 processes while "
            "both decode 64 rows, one every STOP_SYNC_EVERY engine steps (waiting for the other included)",
            "advantage_s_per_sample: the first train device's advantage stage on 256 synthetic "
            "samples (numbers per row read from and written to a DistQueue, the data-parallel "
            "split, the retire), per sample",
            "concurrent_speed / lockstep_speed: 2 Ray actors, rollout + long-context decode + update "
            "workload, alone vs both at once (independent / meeting after each part and in the gradient "
            "all-reduce); decode_speed, context_speed, train_speed (and lock-step): the same per part; "
            "probe_s: that workload alone (machine-speed mark)",
            "train_context_ns / reference_context_ns: a third batch of 32 long samples (responses "
            "of median 300, up to 1,000 tokens): the plane through the three batches' (tokens, "
            "sum of squared lengths, seconds)",
            f"decode_context_ms: {CONTEXT_ROWS} rows at the reference context vs {LONG_CONTEXT - 1} "
            "(the base built for that context)",
            "not measured (small here): reward rule scoring, Ray's own call latency",
        ),
    )
    if path is not None:
        save_calibration(cal, path)
    return cal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="calibration JSON to write")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--threads", type=int, default=1, help="threads per device process")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads={args.threads} must be >= 1")
    measure_calibration(args.out, threads=args.threads, quick=args.quick)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

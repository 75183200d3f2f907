"""The measurement harness: runs the real rollout engine, trainer stages, switch, weight
broadcast and device workers on this machine to produce the measured costs (a `Calibration`)
that the torch-free simulator in `rlfusion.sim` predicts RL throughput from.

`calibrate`: the microbenchmarks; `calibrate_all`: all of them and the contention probe into a
`Calibration` (`rlfusion simulate --calibrate`, `python -m rlfusion.measure.calibrate_all`);
`contention`: how much two busy device processes slow
each other (two Ray device actors, alone, together and in lock-step); `kernels`: where a pass
spends its time — the machine's matmul peak, the per-op dispatch floor, and the host-bound share
of a decode, prefill or update (wall time the profiler finds outside compute kernels), which
`bench/engine.py` prints beside each pass's achieved FLOP/s.
"""

"""What a decode pass costs at long contexts: rows read by runs of similar length vs every row read
to the longest.

A decode pass reads every row's cached keys and values. At the replay workload's contexts
(`configs/replay.toml`: responses up to 1,000 tokens) those reads are most of the pass, and the
engine reads each run of similar-length rows (`model/row_segments.py`) only up to its own
longest, with the running rows kept longest first by the scheduler. This bench times one decode
pass of the shipped base (1 thread, built at 1,280 positions) over 128 rows whose contexts are
drawn as a continuous-batching rollout of the replay workload holds them (each row a response
of the replay length distribution, part way through), one row at 1,000 positions:

  - by runs, longest first (what the engine does);
  - by runs, in random order (no reordering: a run ends at every change of length class);
  - every row at the longest context (the same rows read to the longest, as a pass that pads
    every row to its batch's longest reads them);
  - every row at 64 positions (the pass without long contexts).

Passes are interleaved, 30 repetitions each, medians; ratios in one run.

    python bench/decode_reads.py            # full run
    python bench/decode_reads.py --quick    # 10 repetitions
    python bench/decode_reads.py --smoke    # 1 repetition (a test runs it)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from rlfusion.model.checkpoint import find_base, load_base
from rlfusion.model.kv_cache import CacheBatch
from rlfusion.model.row_segments import SEGMENT_OVERHEAD, read_cost
from rlfusion.rl.replay import replay_length

ROWS, CONTEXT, LONGEST, PROMPT = 128, 1280, 1000, 10


def contexts(seed: int = 0) -> list[int]:
    """128 running rows of a replay rollout: each a response drawn from the replay lengths
    (median 150, sigma 1.48, cap 1,000) in proportion to its length (a long response holds its
    row longer, so more of the running rows are long ones), at a uniform point of its length;
    one at 1,000."""
    rng = random.Random(seed)
    out = [LONGEST]
    while len(out) < ROWS:
        n = replay_length(rng.randrange(10**6), rng.randrange(8), 150.0, 1.48, 0.9, LONGEST)
        if rng.random() < n / LONGEST:
            out.append(PROMPT + rng.randint(1, n))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="1 repetition, to check it runs")
    args = parser.parse_args()
    if args.smoke:
        print("smoke run: sizes cut to seconds; figures are not measurements")
    reps = 1 if args.smoke else 10 if args.quick else 30
    torch.set_num_threads(1)
    model, _, _ = load_base(find_base(), max_seq_len=CONTEXT)
    model.eval()
    cache = model.new_kv_cache(ROWS, CONTEXT)
    tokens = torch.randint(1, model.config.vocab_size, (ROWS, 1), generator=torch.Generator().manual_seed(0))
    mixed = contexts()
    shuffled = random.Random(1).sample(mixed, len(mixed))
    cases = {"runs, longest first": sorted(mixed, reverse=True), "runs, random order": shuffled,
             "every row at the longest": [max(mixed)] * ROWS, "every row at 64": [64] * ROWS}
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for _ in range(reps + 2):
            for name, lengths in cases.items():
                start_B = torch.tensor(lengths) - 1  # the new token sits at position length - 1
                t0 = time.perf_counter()
                model(tokens, CacheBatch(cache, 0, start_B))
                times[name].append(time.perf_counter() - t0)
    ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
    print(f"128 rows, mean context {statistics.mean(mixed):.0f}, longest {max(mixed)}; "
          f"row-positions read: longest first {read_cost(cases['runs, longest first'])}, random order "
          f"{read_cost(shuffled)} (each run counted with {SEGMENT_OVERHEAD} for its overhead), all to the longest "
          f"{ROWS * max(mixed)}")
    print("| pass | ms (median) | vs every row at the longest |")
    print("|---|---|---|")
    for name, value in ms.items():
        print(f"| {name} | {value:.1f} | {value / ms['every row at the longest']:.2f} |")


if __name__ == "__main__":
    main()

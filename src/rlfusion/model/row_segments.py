"""Which cached positions a decode pass reads: contiguous runs of cache rows (segments), each read
up to its longest row. Pure Python: the engine's scheduler uses the same rule to keep its rows
in an order that makes the runs cheap, and the simulator to cost a decode step.

A decode pass over rows of very different context lengths that read every row up to the
longest one reads mostly padding: at 128 rows of a long-tailed rollout (one row at 1,000
positions, the mean near 300) about 3x the keys and values it needs, and on a CPU those reads
are most of the step. Rows ordered longest first split into a few segments of similar lengths.
"""

from __future__ import annotations

# rows whose lengths are within this factor of each other (or this many positions apart) share
# a segment: a segment's extra reads are bounded by the factor
SEGMENT_RATIO = 1.5
SEGMENT_SLACK = 64
# what one more segment costs, in row-positions read (its few kernel launches per layer)
SEGMENT_OVERHEAD = 512


def row_segments(lengths: list[int]) -> list[tuple[int, int, int]]:
    """`(first row, end row, positions)` runs over the rows in order: every row of a run is read
    up to `positions`, the run's longest length. A run grows while its longest and shortest row
    stay within `SEGMENT_RATIO` (or `SEGMENT_SLACK` positions)."""
    segments, start = [], 0
    while start < len(lengths):
        top = low = lengths[start]
        end = start + 1
        while end < len(lengths):
            hi, lo = max(top, lengths[end]), min(low, lengths[end])
            if hi > SEGMENT_RATIO * lo and hi - lo > SEGMENT_SLACK:
                break
            top, low, end = hi, lo, end + 1
        segments.append((start, end, top))
        start = end
    return segments


def read_cost(lengths: list[int]) -> int:
    """Row-positions a decode pass over rows of these lengths reads, in this order, counting each
    segment's overhead."""
    return sum((end - start) * positions + SEGMENT_OVERHEAD
               for start, end, positions in row_segments(lengths))

"""Keep Python's cyclic garbage collector off the long-lived objects of a worker process.

After imports (torch, Ray) and setup a process tracks ~300K container objects that live until
it exits. A full (generation-2) collection walks all of them: 0.1–0.18 s measured in a device
worker here, landing in whatever phase allocates at that moment — a partial rollout's request
admission, say — while the peer device waits in the next collective. `gc.freeze()` moves them
to the permanent generation, which collections skip; objects made later are collected as usual.

The frozen generation is one per process, so holders are counted: a process that runs several
trainers (benches, tests) thaws it only when the last one releases it.
"""

from __future__ import annotations

import gc

_holders = 0  # freeze_long_lived() calls not yet matched by release_long_lived()


def freeze_long_lived() -> None:
    """Collect once, then exempt every object alive now from later collections. Call when a
    process (or a trainer in it) has finished its setup; pair with `release_long_lived`."""
    global _holders
    gc.collect()
    gc.freeze()
    _holders += 1


def release_long_lived() -> None:
    """One holder is done (a trainer closed): once none is left, every frozen object may be
    collected again."""
    global _holders
    _holders = max(0, _holders - 1)
    if not _holders:
        gc.unfreeze()

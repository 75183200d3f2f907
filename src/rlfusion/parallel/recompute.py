"""Selective recompute: the recompute-phase flag other modules consult (counting hooks must not
count tokens replayed for backward)."""

from __future__ import annotations

import threading

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed module re-runs its forward during backward."""
    return getattr(_state, "depth", 0) > 0

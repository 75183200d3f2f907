import gc

from rlfusion.runtime import heap


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _tracked(obj) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_frozen_objects_are_skipped_and_later_garbage_is_still_collected():
    kept = _Node()
    heap.freeze_long_lived()
    try:
        assert gc.get_freeze_count() > 1000  # imports alone leave many thousands of tracked objects
        assert not _tracked(kept)  # a full collection no longer walks it
        _Node()  # an unreachable cycle made after the freeze
        assert gc.collect() >= 1
    finally:
        heap.release_long_lived()
    assert _tracked(kept) and gc.get_freeze_count() == 0


def test_the_last_holder_thaws():
    # two trainers in one process: the first one's close must not thaw the other's objects
    heap.freeze_long_lived()
    heap.freeze_long_lived()
    try:
        heap.release_long_lived()
        assert gc.get_freeze_count() > 0
    finally:
        heap.release_long_lived()
    assert gc.get_freeze_count() == 0
    heap.release_long_lived()  # an extra release is harmless
    assert gc.get_freeze_count() == 0

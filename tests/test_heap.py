import gc

from rlfusion.runtime.heap import freeze_long_lived


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_objects_are_skipped_and_later_garbage_is_still_collected():
    try:
        kept = _Node()
        frozen = freeze_long_lived()
        assert frozen > 1000  # imports alone leave many thousands of tracked objects
        assert not any(o is kept for o in gc.get_objects())  # a full collection no longer walks it
        _Node()  # unreachable cycle made after the freeze
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())

"""Finished samples of a running synchronous rollout that an idle peer device may score
(`deploy.share_scoring`): the generating device offers each sample as it finishes; a peer takes
them a chunk at a time (`Scorer.take_finished`, served on its own thread), the generating
device scores the rest once it stops decoding.

Owns the pool's state (open, still decoding) and its waiting rules, thread-safe. It does not
score or put anything.
"""

from __future__ import annotations

import threading
import time

from rlfusion.rl.trajectory import Trajectory


class FinishedPool:
    def __init__(self) -> None:
        self._pool: list[Trajectory] = []
        self._open = self._decoding = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an offer, or the pool's state moved on

    def open(self) -> None:
        with self._lock:
            self._pool, self._open, self._decoding = [], True, True

    def offer(self, traj: Trajectory) -> None:
        with self._changed:
            self._pool.append(traj)
            self._changed.notify_all()

    def decoding_done(self) -> None:
        """From now on a peer takes even the last few samples."""
        with self._changed:
            self._decoding = False
            self._changed.notify_all()

    def close(self) -> None:
        """Empty and closed: a waiting peer learns it at once."""
        with self._changed:
            self._pool, self._open, self._decoding = [], False, False
            self._changed.notify_all()

    def take(self, max_tokens: int, min_count: int = 1) -> list[Trajectory]:
        """The oldest pooled samples up to `max_tokens` tokens (at least one), if `min_count` wait."""
        with self._lock:
            if len(self._pool) < min_count:
                return []
            n, tokens = 0, 0
            while n < len(self._pool) and (n == 0 or tokens + self._pool[n].num_tokens <= max_tokens):
                tokens += self._pool[n].num_tokens
                n += 1
            out, self._pool = self._pool[:n], self._pool[n:]
        return out

    def take_waiting(self, min_count: int, max_tokens: int, wait_s: float) -> tuple[list[Trajectory], bool]:
        """Samples for a peer, and whether the pool is still open. While the owner decodes, none
        unless `min_count` wait; once it scores its own, any that wait. An open pool with too few
        is waited on up to `wait_s`: the answer comes as soon as enough are offered or it closes."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                if not self._open:
                    return [], False
                if len(self._pool) >= (min_count if self._decoding else 1):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return [], True
                self._changed.wait(left)
            decoding = self._decoding
        return self.take(max_tokens, min_count if decoding else 1), True

"""Stopping a run at a step boundary: Ctrl-C (SIGINT) or SIGTERM asks the RL loop to finish the
step it is in, save a checkpoint and exit, so an interrupted run always leaves a way back.

    signal ─► StopRequest.requested = "SIGINT"   (the step goes on; the loop checks between steps)
    a second Ctrl-C (after GRACE_S) ─► KeyboardInterrupt at once (no checkpoint of that step)

Ray's own processes are not stopped by a terminal's Ctrl-C (they ignore it), so the device
workers finish the step too. Not here: what the loop saves (`run_state.py`).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from rlfusion.errors import RunError

GRACE_S = 1.0  # a second SIGINT this soon after the first is the same keypress delivered twice


class RunInterrupted(RunError):
    """The run stopped on a signal after saving a checkpoint; `exit_code` is 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopRequest:
    """Context manager: while active, SIGINT and SIGTERM set `requested` (the signal's name)
    instead of raising. Outside the main thread it installs nothing (Python delivers signals
    to the main thread only)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self.signum = 0
        self._since = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.requested is None:
            self.requested, self.signum, self._since = signal.Signals(signum).name, signum, time.monotonic()
            print(f"\n{self.requested}: stopping after this step and saving a checkpoint "
                  f"(Ctrl-C again to stop at once, without it)", file=sys.stderr, flush=True)
        elif signum == signal.SIGINT and time.monotonic() - self._since > GRACE_S:
            raise KeyboardInterrupt

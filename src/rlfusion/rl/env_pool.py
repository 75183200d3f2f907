"""Environment worker processes: where the episodes' `step` calls run while the engine decodes.

`EnvPool` keeps `workers` processes (`python -m rlfusion.rl.env_pool SPEC`), each serving one call
at a time over its stdin/stdout (length-prefixed pickles; what the environment prints goes
nowhere). An episode keeps to one worker, which holds its environment between calls; a call
carries the episode's actions so far, and a worker that does not hold the episode at that point
(a restarted worker, an episode resumed from a checkpoint) rebuilds it by `reset` and replaying
them. A call past `timeout_s` kills its worker (a fresh one takes its queue), and so does a
worker that exits by itself: either fails that call's episode, never the run (a rebuild's replayed
actions get the timeout each). A worker runs in a session of its own, killed as a group with what
it started, and ends itself when its parent is gone. Nothing here imports torch: a worker starts
in a fraction of a second.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, BinaryIO

from rlfusion.rl.env import EnvStep, checked_step, import_env
from rlfusion.rl.problem import Problem

_HEADER = struct.Struct("<I")


@dataclass
class EnvResult:
    """One call's outcome: `step` on success, else `error` (why the episode fails); `seconds`
    the worker spent in the environment (a rebuild's replay included), `latency` from dispatch
    to the answer's arrival here."""

    episode: str
    step: EnvStep | None
    error: str
    seconds: float
    latency: float = 0.0


@dataclass
class _Call:
    episode: str
    problem: Problem
    actions: list[str]
    sent: float = 0.0
    steps: int = 1  # the step() calls it may take: the worker rebuilds an episode it does not hold


class _Worker:
    """One worker process and the calls queued for it."""

    def __init__(self, index: int, spec: str, results: queue.SimpleQueue):
        self.index, self.spec, self.results = index, spec, results
        self.queue: deque[_Call] = deque()
        self.current: _Call | None = None
        self.generation = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.generation += 1
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlfusion.rl.env_pool", self.spec],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        threading.Thread(target=_read_answers, args=(self.proc.stdout, self.results, self.index, self.generation),
                         daemon=True, name=f"env worker {self.index}").start()

    def kill(self) -> None:
        """Kill the worker and whatever it started (its own session's process group); its reader
        thread sees the end of its output and closes it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except OSError:  # (unsent bytes to a dead worker)
            pass
        self.proc = None

    def send(self, message: tuple) -> bool:
        """Write one message; False when the worker is gone (its answer will say so)."""
        if self.proc is None:
            self.start()
        try:
            _write(self.proc.stdin, message)
            return True
        except (BrokenPipeError, OSError):
            return False


class EnvPool:
    """`workers` processes running the environment class `spec` names, calls answered within
    `timeout_s` seconds or failed."""

    def __init__(self, spec: str, workers: int, timeout_s: float):
        import_env(spec)  # a bad spec is one line here, not a dead worker per call
        self.spec, self.timeout_s = spec, timeout_s
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [_Worker(i, spec, self._results) for i in range(workers)]
        for w in self._workers:  # started now, so the first calls do not wait for an interpreter to start
            w.start()
        self._home: dict[str, int] = {}  # episode -> the worker it keeps to
        self._held: dict[str, int] = {}  # episode -> the worker generation that answered its last call
        self._done: list[EnvResult] = []

    @property
    def in_flight(self) -> int:
        """Calls sent or queued, not yet answered."""
        return sum(len(w.queue) + (w.current is not None) for w in self._workers)

    def submit(self, episode: str, problem: Problem, actions: list[str]) -> None:
        """Ask for episode `episode`'s answer to its last action (`actions[-1]`)."""
        if episode not in self._home:
            self._home[episode] = min(self._workers, key=lambda w: len(w.queue) + (w.current is not None)).index
        worker = self._workers[self._home[episode]]
        held = self._held.get(episode) == worker.generation
        # a rebuild replays the earlier actions: each may take the timeout too
        worker.queue.append(_Call(episode, problem, list(actions), steps=1 if held else len(actions)))
        self._dispatch(worker)

    def close_episode(self, episode: str) -> None:
        """The episode ended: its worker forgets its environment."""
        index = self._home.pop(episode, None)
        self._held.pop(episode, None)
        if index is not None and self._workers[index].proc is not None:
            self._workers[index].send(("close", episode))

    def poll(self, wait_s: float = 0.0) -> list[EnvResult]:
        """The answers that arrived (waiting up to `wait_s` for the first), and the calls failed
        for their timeout or a dead worker."""
        deadline = time.perf_counter() + wait_s
        while True:
            try:
                self._take(self._results.get(timeout=max(0.0, min(deadline - time.perf_counter(), 0.01)))
                           if wait_s else self._results.get_nowait())
                while True:
                    self._take(self._results.get_nowait())
            except queue.Empty:
                pass
            self._expire()
            if self._done or time.perf_counter() >= deadline:
                break
        out, self._done = self._done, []
        return out

    def close(self) -> None:
        for w in self._workers:
            w.kill()

    def _dispatch(self, worker: _Worker) -> None:
        while worker.current is None and worker.queue:
            call = worker.queue.popleft()
            call.sent = time.perf_counter()
            worker.current = call
            message = ("step", call.episode, call.problem, call.actions)
            if not worker.send(message):  # it exited while idle: a fresh one takes the call
                worker.kill()
                call.steps = len(call.actions)
                if not worker.send(message):
                    self._fail(worker, f"env worker {worker.index} could not be restarted")

    def _take(self, item: tuple) -> None:
        index, generation, answer = item
        worker = self._workers[index]
        if generation != worker.generation or worker.current is None:
            return  # an answer from a worker since killed
        call = worker.current
        if answer is None:  # the worker's output ended: it exited
            code = worker.proc.poll() if worker.proc is not None else None
            self._fail(worker, f"the environment's worker process exited (status {code}) during step()")
            return
        kind, payload, seconds = answer
        latency = time.perf_counter() - call.sent
        worker.current = None
        if kind == "ok":
            self._held[call.episode] = worker.generation
            self._done.append(EnvResult(call.episode, payload, "", seconds, latency))
        else:
            self._done.append(EnvResult(call.episode, None, payload, seconds, latency))
        self._dispatch(worker)

    def _expire(self) -> None:
        now = time.perf_counter()
        for w in self._workers:
            if w.current is not None and now - w.current.sent > self.timeout_s * w.current.steps:
                self._fail(w, f"step() did not return within env.timeout_s={self.timeout_s:g} s"
                           + (f" (x {w.current.steps}: the episode was rebuilt)" if w.current.steps > 1 else ""))

    def _fail(self, worker: _Worker, why: str) -> None:
        """Fail the worker's current call, replace the process, go on with its queue."""
        call = worker.current
        worker.kill()
        worker.current = None
        if call is not None:
            waited = time.perf_counter() - call.sent
            self._done.append(EnvResult(call.episode, None, why, waited, waited))
        # the environments of the worker's other episodes died with it: the fresh worker rebuilds
        # each by replay on its next call
        self._dispatch(worker)


def _read_answers(stream: BinaryIO, results: queue.SimpleQueue, index: int, generation: int) -> None:
    while True:
        try:
            answer = _read(stream)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            answer = None
        results.put((index, generation, answer))
        if answer is None:
            stream.close()  # here, not by `kill`: closing a stream another thread reads blocks
            return


def _write(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


# ---- the worker process ----

def serve(spec: str, inp: BinaryIO, out: BinaryIO) -> None:
    """Answer `("step", episode, problem, actions)` and `("close", episode)` until stdin ends."""
    cls = import_env(spec)
    held: dict[str, tuple[Any, int]] = {}  # episode -> (its environment, actions applied)
    while True:
        try:
            message = _read(inp)
        except EOFError:
            return
        if message[0] == "close":
            held.pop(message[1], None)
            continue
        _, episode, problem, actions = message
        t0 = time.perf_counter()
        try:
            env, applied = held.pop(episode, (None, -1))
            if applied != len(actions) - 1:
                env = cls()
                env.reset(problem)
                for action in actions[:-1]:
                    env.step(action)
            step = checked_step(env.step(actions[-1]))
            held[episode] = (env, len(actions))
            answer = ("ok", step)
        except BaseException as e:  # noqa: BLE001 — the user's environment: any failure fails the episode
            text = " ".join(str(e).split())[:300]
            answer = ("error", f"{type(e).__name__} in the environment: {text}")
        _write(out, (*answer, time.perf_counter() - t0))


def _watch_parent(parent: int) -> None:
    """End this worker's process group (it and anything its environment started) once the
    process that started it is gone, even while a step() hangs."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(os.getpid(), signal.SIGKILL)


def _main() -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # the protocol owns the original stdin/stdout; the environment's own prints go nowhere
    inp, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    serve(sys.argv[1], inp, out)


if __name__ == "__main__":
    _main()

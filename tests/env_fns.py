"""Environments the tests name as `env="env_fns:Class"` (this folder is on the workers' path).

`ScriptedEnv` answers every action with "=" + its length mod 10 + ";" (deterministic, so a
replayed episode is rebuilt exactly). Its stop text is "1", the token the tests' random tiny
model writes most, so its greedy episodes have several turns. The `_Faulty` ones misbehave on
the episodes whose prompt has an even length.
"""

import os
import time

from rlfusion.rl.env import EnvStep

STOP = "1"


class ScriptedEnv:
    stop = (STOP,)

    def reset(self, problem):
        self.problem, self.calls = problem, 0

    def step(self, action):
        self.calls += 1
        return EnvStep(f"={len(action) % 10};", reward=0.25, done=False, info={"calls": 1.0})


def observation(action: str) -> str:
    """What `ScriptedEnv` answers to `action`."""
    return f"={len(action) % 10};"


class _Faulty(ScriptedEnv):
    """Misbehaves on the episodes whose prompt has an even length, answers the others."""

    def step(self, action):
        if len(self.problem.prompt) % 2 == 0:
            return self.fault()
        return super().step(action)


class RaisingEnv(_Faulty):
    def fault(self):
        raise RuntimeError("the tool broke")


class SleepingEnv(_Faulty):
    def fault(self):
        time.sleep(30)


class ChattyEnv(_Faulty):
    def fault(self):
        print("x" * 10_000_000)  # goes nowhere; what it returns is the problem
        return "x" * 10_000_000


class ExitingEnv(_Faulty):
    def fault(self):
        os._exit(3)


class GarbageEnv(_Faulty):
    def fault(self):
        return EnvStep("=1;", reward=float("nan"))


class NoStep:
    stop = ("]",)

    def reset(self, problem):
        pass


class EmptyEnv(_Faulty):
    def fault(self):
        return ""

"""Errors that end a command for a reason the user can act on (printed as one line, no trace)."""


class RunError(Exception):
    """A run stopped on purpose: non-finite loss, collapse guard, missing input."""


class RewardError(RunError):
    """The reward function or reward model failed: it raised, hung past `reward_timeout_s`, or
    returned something that is not a finite number. The message names the `reward=` spec and
    the sample."""


class CollapseError(RunError):
    """Rewards stayed at 0 or responses ran to the length limit for too long (the trainer's
    collapse guard)."""

"""Errors that end a command for a reason the user can act on (printed as one line, no trace)."""


class RunError(Exception):
    """A run stopped on purpose: non-finite loss, collapse guard, missing input."""

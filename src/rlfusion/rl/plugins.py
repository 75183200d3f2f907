"""User code a run names as `module:name` (`reward=`, `env=`): imported here, each failure one
line naming the key, the spec and what went wrong."""

from __future__ import annotations

import importlib
from typing import Any


def import_named(key: str, spec: str, form: str) -> tuple[str, str, Any]:
    """`(module name, attribute name, the attribute or None)` of `spec` (`key=spec` in messages;
    `form`: what a spec must look like, for the message when it does not)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}={spec!r} must be {form}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r} ({e})") from None
    except (Exception, SystemExit) as e:  # the module itself failed while importing (syntax, its own code)
        raise ValueError(f"{key}={spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e}") from e
    return module_name, attr, getattr(module, attr, None)

"""Typed configs from TOML files plus `key=value` overrides.

Every component owns a frozen dataclass that validates itself in `__post_init__`. This module only
turns text into those dataclasses: nested tables map to nested dataclasses, dotted keys
(`engine.max_num_seqs=32`) reach into them, and a wrong key, type or value is one `ValueError`
line that names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Build `cls` from an optional TOML file, then apply `key=value` overrides in order."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_toml(Path(path))
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(data, key, value)
    return from_dict(cls, data)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")  # TOML is UTF-8; "-sig" accepts an editor's leading BOM
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"config file {path} is not UTF-8 text (byte {raw[e.start]:#04x} on line "
                         f"{line}); allowed: a TOML file saved as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ValueError(f"config file {path}: TOML nested too deeply to read") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` -> `(key, value)`; the value is typed later against the config's fields."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} is not of the form key=value")
    return key.strip(), _Override(raw.strip(), _parse_scalar(raw.strip()))


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key {prefix + unknown[0]!r}; allowed: "
                         f"{', '.join(prefix + k for k in fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"config {prefix or cls.__name__}: {e}") from None


@dataclasses.dataclass(frozen=True)
class _Override:
    """A command-line value: parsed as TOML, but kept verbatim for string keys (`run_name=nan`)."""

    raw: str
    parsed: Any


def check_fields(section: str, checks: dict[str, tuple[bool, str]], obj: Any) -> None:
    """Raise one `ValueError` for the first failed `key: (ok, allowed)` check of a config."""
    for key, (ok, allowed) in checks.items():
        if not ok:
            raise ValueError(f"{section}.{key}={getattr(obj, key)!r} is invalid: {allowed}")


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if isinstance(value, _Override) and typing.get_origin(hint) not in (typing.Union, types.UnionType):
        value = value.raw if hint is str and not isinstance(value.parsed, str) else value.parsed
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        errors = []
        for option in options:
            try:
                return _coerce(option, value, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0])
    if dataclasses.is_dataclass(hint):
        shorthand = getattr(hint, "SHORTHAND", None)
        if isinstance(value, _Override) and shorthand:
            value = {shorthand: value}
        if not isinstance(value, dict):
            if shorthand and isinstance(value, str):
                return from_dict(hint, {shorthand: value}, prefix=key + ".")
            raise ValueError(f"config key {key!r} must be a table, got {value!r}")
        if _PLAIN in value and shorthand:
            value = {shorthand: value[_PLAIN], **{k: v for k, v in value.items() if k != _PLAIN}}
        return from_dict(hint, value, prefix=key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key {key!r} must be a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1]
        return tuple(_coerce(item, v, key) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = _int_to_float(value, key)
    if hint in (int, float, str, bool) and not (type(value) is hint):
        raise ValueError(f"config key {key!r} must be {hint.__name__}, got {value!r}")
    if hint is float:
        _check_finite(value, key)
    if hint is int:
        _check_int64(value, key)
    return value


def _int_to_float(value: int, key: str) -> float:
    try:
        return float(value)
    except OverflowError:  # a TOML integer has no size limit; a float does
        raise ValueError(f"config key {key!r} must be a finite number, got {_short(value)}") from None


def _check_finite(value: float, key: str) -> None:
    # inf passes range checks like `kl_coef >= 0` and no float setting means anything at inf or
    # nan; "no limit" is a large value (json.dumps(inf) in config.json is not JSON either).
    if not math.isfinite(value):
        hint = " (for no limit give a large value such as 1e9)" if value > 0 else ""
        raise ValueError(f"config key {key!r} must be a finite number, got {value!r}{hint}")


def _check_int64(value: int, key: str) -> None:
    # Ints end in torch and numpy (seeds, sizes), which take at most 64 bits.
    if not -2**63 <= value < 2**63:
        raise ValueError(f"config key {key!r} must be a 64-bit integer, got {_short(value)}; "
                         f"allowed: -2**63 to 2**63 - 1")


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"an integer of {len(text.lstrip('-'))} digits"


def _parse_scalar(raw: str) -> Any:
    """Parse an override value as TOML (`3`, `1e-3`, `true`, `"x"`, `[1, 2]`); bare words are strings."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# a section's plain value kept beside its dotted keys (`env=mod:Cls env.max_turns=3`): the
# section's SHORTHAND field
_PLAIN = "\0plain"


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        parent = data
        data = data.setdefault(part, {})
        if isinstance(data, _Override | str):
            data = parent[part] = {_PLAIN: data}
        if not isinstance(data, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a table")
    if isinstance(data.get(leaf), dict) and not isinstance(value, dict):
        data[leaf][_PLAIN] = value
        return
    data[leaf] = value

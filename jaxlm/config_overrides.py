"""`--set dotted.key=value` overrides of a config: each value parsed by its field's declared type, an unknown or
misplaced key one ConfigError naming the closest field. A leaf below `jaxlm.config`, which re-exports
`apply_overrides`."""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any

from jaxlm.config_checks import ConfigError


def apply_overrides(cfg: Any, assignments: list[str]) -> Any:
    """Applies `dotted.key=value` strings, parsing each value by the field's declared type."""
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects dotted.key=value, got {assignment!r}")
        cfg = _set_path(cfg, key.strip().split("."), raw.strip(), key.strip())
    return cfg


def _set_path(obj: Any, parts: list[str], raw: str, full_key: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = parts[0]
    if name not in fields:
        where = type(obj).__name__
        close = difflib.get_close_matches(name, fields, n=1)
        section = full_key[: len(full_key) - len(".".join(parts))]
        hint = f"did you mean '{section}{close[0]}'?" if close else f"fields: {', '.join(fields)}"
        raise ConfigError(f"unknown config key {full_key!r}: {where} has no field {name!r} ({hint})")
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
        if len(parts) == 1:
            raise ConfigError(
                f"config key {full_key!r} is a section; set one of its fields, e.g. {full_key}.<field>=..."
            )
        return dataclasses.replace(obj, **{name: _set_path(current, parts[1:], raw, full_key)})
    if len(parts) > 1:
        raise ConfigError(f"unknown config key {full_key!r}: {name!r} is not a section")
    hint = typing.get_type_hints(type(obj))[name]
    return dataclasses.replace(obj, **{name: _parse_value(raw, hint, full_key)})


def _parse_value(raw: str, hint: Any, key: str) -> Any:
    try:
        if hint is bool:
            lowered = raw.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if hint is int:
            return int(raw)
        if hint is float:
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return value
        if hint is str:
            return raw
    except ValueError:
        raise ConfigError(f"bad value for {key}: {raw!r} is not a valid {hint.__name__}") from None
    raise ConfigError(f"config key {key} has unsupported type {hint}")

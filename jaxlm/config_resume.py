"""What a resumed run may not change: a checkpoint's saved config against the current one, key by key.

Kept apart from `jaxlm.config` (the sections and how configs are read): only the trainer's resume check uses it.
"""

from __future__ import annotations

from jaxlm.config import TrainConfig


def diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ between two config dicts, as 'key: saved -> current'."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def resume_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """What differs, as 'key: saved -> current', between a checkpoint's config and `cfg` in the fields that shape
    the saved state or the data order (each section's `fixed_on_resume`); a field the checkpoint predates counts
    as its default."""
    changes = []
    for name, section in cfg.sections().items():
        default = type(section)().fixed_on_resume()
        was = {k: v for k, v in {**default, **saved.get(name, {})}.items() if k in default}
        changes += diff(was, section.fixed_on_resume(), f"{name}.")
    return changes

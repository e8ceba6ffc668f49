"""What every config section shares: the error type, the base class, and the small range checks.

A leaf below `jaxlm.config` and the sections other packages own (`jaxlm.diloco.config`), so a section can
validate itself next to its fields without importing the config that gathers the sections.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the problem in one line."""


class Section:
    """A config section (a frozen dataclass): it validates its own fields and names the ones a resumed run may
    change (those that change how fast the run goes, or where it syncs, never what the saved state is)."""

    RESUME_MAY_CHANGE: ClassVar[tuple[str, ...]] = ()

    def validate(self, run) -> None:
        """Raises ConfigError naming the first bad field; `run` is the whole TrainConfig, for cross-section rules."""

    def fixed_on_resume(self) -> dict:
        """The fields a checkpoint written with this section must have had to be continued."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RESUME_MAY_CHANGE}


def check_positive(**values) -> None:
    """Each value > 0; keys are dotted names with `__` for `.` (model__d_model -> model.d_model)."""
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{_dotted(key)} must be positive, got {value}")


def check_non_negative(**values) -> None:
    for key, value in values.items():
        if value < 0:
            raise ConfigError(f"{_dotted(key)} must be >= 0, got {value}")


def check_choice(key: str, value: str, allowed, how: str = "list") -> None:
    """`value` is one of `allowed`; the message lists them as the config documents them."""
    if value not in allowed:
        shown = {"list": str(list(allowed)), "sorted": str(sorted(allowed)), "comma": ", ".join(allowed)}[how]
        raise ConfigError(f"{key} must be one of {shown}, got {value!r}")


ROUTERS = ("softmax", "sigmoid_bias")


def check_moe(m) -> None:
    """A ModelConfig's mixture-of-experts fields (jaxlm.moe); nothing to check for a dense model."""
    check_non_negative(
        model__num_experts=m.num_experts,
        model__num_shared_experts=m.num_shared_experts,
        model__moe_aux_loss=m.moe_aux_loss,
        model__moe_z_loss=m.moe_z_loss,
        model__capacity_factor=m.capacity_factor,
        model__router_bias_rate=m.router_bias_rate,
    )
    if not m.num_experts:
        return
    check_positive(
        model__experts_per_token=m.experts_per_token,
        model__expert_mlp_dim=m.expert_mlp_dim,
        model__moe_every=m.moe_every,
    )
    if m.num_layers % m.moe_every:
        raise ConfigError(
            f"model.moe_every ({m.moe_every}) must divide model.num_layers ({m.num_layers}): the layers run in groups "
            f"of moe_every, the last of each an MoE layer"
        )
    if m.experts_per_token > m.num_experts:
        raise ConfigError(
            f"model.experts_per_token ({m.experts_per_token}) must be at most model.num_experts ({m.num_experts})"
        )
    check_choice("model.router", m.router, ROUTERS, how="comma")


def _dotted(key: str) -> str:
    return key.replace("__", ".")

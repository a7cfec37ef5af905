"""How much local work a learner does before it pushes: fixed H, DyLU, or a time budget.

Under DyLU (Liu et al. 2024) learner m runs ⌊v_m / max_v · H⌋ steps (v = its speed), so every
learner reports after about the same wall-clock time and faster slices take more local steps.
`policy.dylu_rounding='nearest'` rounds instead: the floor makes a slow learner's round up to a
step shorter than the fastest's, every round, so its pushes drift ahead and grace windows split.
Speeds are declared (hardware profile) or measured (an EMA of observed step times). A time
budget trains until the round's time is up.
"""

import dataclasses
import math

from decoupled_diloco import settings as settings_lib

POLICIES = ("fixed", "dylu", "time_budget")
SPEED_SOURCES = ("declared", "measured")
DYLU_ROUNDINGS = ("floor", "nearest")


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.policy`, validated: unknown policies and non-positive budgets are refused up front."""
  kind: str
  speed_source: str = "declared"
  round_seconds: float = 0.0
  dylu_rounding: str = "floor"

  def __post_init__(self):
    settings_lib.check((
        (self.kind in POLICIES, f"policy.kind={self.kind!r} is unknown: use one of {POLICIES}"),
        (self.speed_source
         in SPEED_SOURCES, f"policy.speed_source={self.speed_source!r} is unknown: use one of {SPEED_SOURCES}"),
        (self.kind != "time_budget" or
         self.round_seconds > 0, f"policy.round_seconds={self.round_seconds} must be > 0 for a time budget"),
        (self.dylu_rounding
         in DYLU_ROUNDINGS, f"policy.dylu_rounding={self.dylu_rounding!r} is unknown: use one of {DYLU_ROUNDINGS}"),
    ))

  @classmethod
  def from_config(cls, policy_cfg) -> "Settings":
    """The policy group of a config (or a Settings already); unknown fields are refused by name."""
    return settings_lib.from_config(cls, policy_cfg, "policy")


def dylu_steps(speed: float, max_speed: float, inner_steps: int, rounding: str = "floor") -> int:
  """⌊v/max v · H⌋ as the paper has it, or to the nearest step so that every learner's round lasts the
  fastest's to within half a step (docs/syncer.md); at least one step so that a slow learner still contributes."""
  steps = speed / max_speed * inner_steps
  return max(1, math.floor(steps + 1e-9) if rounding == "floor" else round(steps))


def target_steps(policy_cfg, inner_steps: int, speed: float, max_speed: float) -> int | None:
  """Steps for the next round, or None when the time budget decides step by step."""
  if policy_cfg.kind == "fixed":
    return inner_steps
  if policy_cfg.kind == "dylu":
    return dylu_steps(speed, max_speed, inner_steps, policy_cfg.dylu_rounding)
  return None


def measured_round_steps(policy_cfg, inner_steps: int, own_speed: float, others_max_speed: float, declared_speed: float,
                         declared_max_speed: float) -> int:
  """A round's length decided up front from wall-clock speeds (steps per second; 0 = not measured yet).

  Why up front: a learner process (or a multi-host group, which must agree) fixes its round
  before computing it. Until it has measured itself, a round is H. A time budget becomes
  the steps that fit `round_seconds` at the measured speed; measured DyLU compares this
  learner with the fastest other one it has heard of; everything else is `target_steps`.
  """
  if policy_cfg.kind == "time_budget":
    return max(1, int(policy_cfg.round_seconds * own_speed)) if own_speed else inner_steps
  if policy_cfg.kind == "dylu" and policy_cfg.speed_source == "measured":
    return (dylu_steps(own_speed, max(own_speed, others_max_speed), inner_steps, policy_cfg.dylu_rounding)
            if own_speed else inner_steps)
  return target_steps(policy_cfg, inner_steps, declared_speed, declared_max_speed)


def keep_training(policy_cfg, target: int | None, steps_done: int, elapsed: float, next_step: float) -> bool:
  """Whether to take one more local step before pushing."""
  if target is not None:
    return steps_done < target
  return steps_done == 0 or elapsed + next_step <= policy_cfg.round_seconds


@dataclasses.dataclass
class SpeedTracker:
  """Per-learner speed estimates (steps per second): declared, refined by measured step times."""
  speeds: list[float]
  ema: float = 0.5  # Weight of the newest measurement.

  def observe(self, learner: int, step_seconds: float) -> None:
    """Folds one measured step time into the learner's speed estimate (the first one, if it has none)."""
    previous = self.speeds[learner]
    self.speeds[learner] = 1 / step_seconds if not previous else (1 - self.ema) * previous + self.ema / step_seconds

  @property
  def max_speed(self) -> float:
    """The fastest learner's speed: DyLU's reference for H."""
    return max(self.speeds)

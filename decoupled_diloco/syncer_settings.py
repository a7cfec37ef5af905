"""The syncer's config group (`config.syncer`): the merge policy, validated once.

Apart from the syncer's state machine (syncer.py) so that each stays one concept: what a merge
may do, and when it happens.
"""

import dataclasses

from decoupled_diloco import merge
from decoupled_diloco.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Settings:
  """Merge policy, from `config.syncer`."""
  quorum: int = 0  # Distinct learners needed to merge; 0 = all of them.
  staleness: str = "constant"  # One of merge.STALENESS_FUNCTIONS.
  staleness_a: float = 0.5
  staleness_b: float = 0.0
  max_staleness: int = -1  # Drop pushes staler than this; -1 = never drop.
  token_weighting: str = "tokens"  # One of merge.TOKEN_WEIGHTINGS.
  merge_rule: str = "mean"  # One of merge.MERGE_RULES.
  clip_multiple: float = 2.0  # clip: c, pushes scaled to at most c × the median of recent push norms.
  clip_window: int = 16  # clip: W, the merged pushes' norms that median is over (with the push's own).
  trim_fraction: float = 0.125  # trimmed_mean: β, ⌊β·n⌋ of a merge's n pushes trimmed at each end per coordinate.
  max_push_norm: float = 0.0  # Refuse (and count) a push whose decoded norm exceeds this; 0 = no bound.
  grace_gamma: float = 0.0  # γ of the grace window; 0 = merge as soon as the quorum is met.
  grace_overlap_steps: float = 0.0  # τ: steps of slack learners have before they need Θ.
  ema: float = 0.3  # Weight of the newest duration in the ξ EMAs.

  @classmethod
  def from_config(cls, syncer_cfg) -> "Settings":
    """Settings from `config.syncer`, rejecting unknown rule names with the allowed ones."""
    settings = cls(**{f.name: syncer_cfg[f.name] for f in dataclasses.fields(cls) if f.name in syncer_cfg})
    for name, allowed in (("staleness", merge.STALENESS_FUNCTIONS), ("token_weighting", merge.TOKEN_WEIGHTINGS),
                          ("merge_rule", merge.MERGE_RULES)):
      if getattr(settings, name) not in allowed:
        raise ConfigError(f"syncer.{name}={getattr(settings, name)!r} is unknown: use one of {allowed}")
    checks = ((settings.quorum >= 0, f"syncer.quorum={settings.quorum} must be >= 0 (0 = all learners)"),
              (0 <= settings.grace_gamma < 1, f"syncer.grace_gamma={settings.grace_gamma} must be in [0, 1)"),
              (settings.staleness_a >= 0, f"syncer.staleness_a={settings.staleness_a} must be >= 0"),
              (settings.staleness_b >= 0, f"syncer.staleness_b={settings.staleness_b} must be >= 0"),
              (settings.max_staleness >= -1, f"syncer.max_staleness={settings.max_staleness} must be >= -1"),
              (settings.clip_multiple >= 1, f"syncer.clip_multiple={settings.clip_multiple} must be >= 1 (below "
               "1 every push at the median norm is clipped)"),
              (isinstance(settings.clip_window, int) and
               settings.clip_window >= 1, f"syncer.clip_window={settings.clip_window!r} must be an int >= 1"),
              (0 < settings.trim_fraction < 0.5, f"syncer.trim_fraction={settings.trim_fraction} must be in (0, 0.5)"),
              (settings.max_push_norm >= 0, f"syncer.max_push_norm={settings.max_push_norm} must be >= 0 (0 = off)"),
              (0 < settings.ema <= 1, f"syncer.ema={settings.ema} must be in (0, 1]"))
    for ok, message in checks:
      if not ok:
        raise ConfigError(f"{message}: fix --config.syncer.*")
    return settings

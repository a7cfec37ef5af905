"""A faulty or hostile learner, injected on purpose: one learner's pushes corrupted before the syncer sees them.

Why: robust merges (`robust`, syncer.merge_rule 'clip' / 'trimmed_mean') exist for a learner that
sends garbage (corrupted memory, a bf16 overflow, a misconfigured or hostile learner); measuring
them needs such a learner in an otherwise honest run, as a validated setting rather than a
test-only hack (`failures.byzantine_*`). The kinds:
  scaled   Δ × byzantine_scale (e.g. 100: an overflow, a wrong learning rate)
  flipped  −Δ (a sign error, or an attacker pushing Θ back up the loss)
  noise    Gaussian noise with Δ's own norm (corrupted memory: no signal, honest size)
The corrupted push claims its own norm (`delta_norm`), as a learner computing it would. Noise is
drawn from (failures.seed, learner, the learner's step count), so a seeded run is identical twice
and a resumed one draws what the uninterrupted one drew. In-process runtimes only (sim, threads):
a learner process is the operator's to corrupt.
"""

import dataclasses

import jax
import numpy as np

from decoupled_diloco import settings as settings_lib

KINDS = ("scaled", "flipped", "noise")
RUNTIMES = ("sim", "threads")


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.failures.byzantine_*` once validated."""
  learner: int
  kind: str
  scale: float
  seed: int

  @classmethod
  def from_config(cls, config) -> "Settings | None":
    """None when no learner is byzantine; ConfigError (naming the fix) for a setting that cannot be honoured."""
    cfg = config.failures
    if cfg.byzantine_learner == -1:
      return None
    learners = len(config.learners.devices)
    checks = ((
        isinstance(cfg.byzantine_learner, int) and 0 <= cfg.byzantine_learner < learners,
        f"failures.byzantine_learner={cfg.byzantine_learner!r} must be a learner in [0, {learners}) or -1 (none)"),
              (cfg.byzantine_kind
               in KINDS, f"failures.byzantine_kind={cfg.byzantine_kind!r} is unknown: use one of {KINDS}"),
              (np.isfinite(cfg.byzantine_scale), f"failures.byzantine_scale={cfg.byzantine_scale} must be finite"),
              (config.runtime
               in RUNTIMES, f"failures.byzantine_learner corrupts pushes in-process (runtimes {RUNTIMES}), "
               f"not under runtime={config.runtime!r}: use --config.runtime=sim"),
              (config.mode != "ddp", "failures.byzantine_learner needs pushes to corrupt: mode='ddp' has none"),
              (config.compression.format == "fp32" and not config.compression.error_feedback,
               "failures.byzantine_learner corrupts fp32 pushes: set --config.compression.format=fp32 without error "
               "feedback"))
    settings_lib.check(checks)
    return cls(cfg.byzantine_learner, cfg.byzantine_kind, float(cfg.byzantine_scale), int(cfg.seed))


def corrupt_delta(delta, kind: str, scale: float, rng: np.random.Generator):
  """The pseudo-gradient tree as a `kind` learner would push it (numpy float32 leaves)."""
  leaves, treedef = jax.tree.flatten(jax.device_get(delta))
  leaves = [np.asarray(x, np.float32) for x in leaves]
  if kind == "scaled":
    out = [x * np.float32(scale) for x in leaves]
  elif kind == "flipped":
    out = [-x for x in leaves]
  else:
    noise = [rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
    noise_norm = _norm(noise)
    out = [x * np.float32(_norm(leaves) / noise_norm if noise_norm > 0 else 0.0) for x in noise]
  return jax.tree.unflatten(treedef, out)


def _norm(leaves) -> float:
  return float(np.sqrt(sum(float(np.dot(x.reshape(-1), x.reshape(-1))) for x in leaves)))


def corrupt(push, settings: Settings | None, steps: int):
  """`push` as the byzantine learner sends it (unchanged for every other learner, or with no settings).

  `steps`: the pushing learner's inner steps so far, which seeds its noise.
  """
  if settings is None or push.learner != settings.learner:
    return push
  rng = np.random.default_rng([settings.seed, push.learner, steps])
  delta = corrupt_delta(push.delta, settings.kind, settings.scale, rng)
  return dataclasses.replace(push, delta=delta, delta_norm=_norm(jax.tree.leaves(delta)))

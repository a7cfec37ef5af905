"""The settings a user leaves at 'auto': each mode's recipe, filled in once before the config is validated.

Why: one config file switches between synchronous DiLoCo and Decoupled DiLoCo with
`--config.mode=...`, but the outer step that suits one diverges under the other. Nesterov
momentum applied to every single arrival (quorum 1) moves the momentum M times per round:
on the demo the eval loss climbs to 25 and ends at 7.7, worse than a uniform guess (5.5),
where synchronous DiLoCo reaches 1.34 (docs/decoupled.md, "Defaults per mode"). So the
fields below default to 'auto' (-1 for the quorum and the grace window, 0 for the buffer) and
take the recipe that measured best for the mode at hand; a value the user sets always wins,
and the one combination known to diverge is named in a warning.

  field                      diloco, ddp       decoupled
  syncer.quorum (-1)         0 (all)           1: merge as soon as one learner reported
  syncer.grace_gamma (-1)    0 (no window)     0.9 } a window of ~γτ steps for the round's
  syncer.grace_overlap_steps 0                 2   } other pushes: keeps learners in phase
  outer.optimizer            'sgd' (Nesterov)  'delayed_nesterov'
  outer.buffer_size (0)      1                 M: one momentum step per round's worth of pushes
  policy.kind                'fixed'           'dylu' (H scaled by each learner's speed)
"""

from absl import logging

AUTO = "auto"
RECIPE_FIELDS = ("syncer.quorum", "syncer.grace_gamma", "syncer.grace_overlap_steps", "outer.optimizer",
                 "outer.buffer_size", "policy.kind")
# The decoupled grace window: γ and τ (steps) of ξ_grace = γ(τ·ξ_step − ξ_quorum − ξ_sync).
DECOUPLED_GRACE = (0.9, 2.0)


def merges_per_round(config) -> int:
  """Merges a round's worth of pushes makes at least: M learners' pushes, K = syncer.quorum (0 = all) per merge."""
  learners = len(config.learners.devices)
  quorum = config.syncer.quorum or learners
  return max(1, learners // max(1, quorum))


def resolve(config) -> dict:
  """Fills every recipe field left at 'auto' (-1, or buffer_size 0) in place; returns {field: value} of what it chose.

  Idempotent (a resolved config has nothing left to fill), and pure in the config, so the
  syncer and every learner process resolve the same values from the same flags.
  """
  decoupled = config.mode == "decoupled"
  chosen = {}
  if config.syncer.quorum == -1:
    chosen["syncer.quorum"] = config.syncer.quorum = 1 if decoupled else 0
  if config.syncer.grace_gamma == -1:
    chosen["syncer.grace_gamma"] = config.syncer.grace_gamma = DECOUPLED_GRACE[0] if decoupled else 0.0
  if config.syncer.grace_overlap_steps == -1:
    chosen["syncer.grace_overlap_steps"] = config.syncer.grace_overlap_steps = DECOUPLED_GRACE[1] if decoupled else 0.0
  if config.outer.optimizer == AUTO:
    chosen["outer.optimizer"] = config.outer.optimizer = "delayed_nesterov" if decoupled else "sgd"
  if config.outer.buffer_size == 0:
    dn = config.outer.optimizer == "delayed_nesterov"
    chosen["outer.buffer_size"] = config.outer.buffer_size = len(config.learners.devices) if dn else 1
  if config.policy.kind == AUTO:
    chosen["policy.kind"] = config.policy.kind = "dylu" if decoupled else "fixed"
  warn_known_bad(config)
  return chosen


def known_bad(config) -> str | None:
  """Why `config` is a combination measured to diverge, with the fix, or None.

  Nesterov (or heavy-ball) momentum on each merge of a decoupled run whose merges hold fewer than
  all learners: the naive asynchronous baseline (Liu et al. 2024), kept runnable for comparisons
  (configs/async_naive.py) and so warned about, not refused.
  """
  if (config.mode == "decoupled" and config.outer.optimizer == "sgd" and config.outer.momentum > 0 and
      merges_per_round(config) > 1):
    return (f"mode='decoupled' with outer.optimizer='sgd' and momentum {config.outer.momentum} moves momentum on "
            f"every merge ({merges_per_round(config)} per round): this diverges (docs/decoupled.md); use "
            "--config.outer.optimizer=delayed_nesterov (the default) or --config.syncer.quorum=0")
  return None


def warn_known_bad(config) -> None:
  """One warning line for a combination known to diverge (see `known_bad`)."""
  reason = known_bad(config)
  if reason:
    logging.warning("%s", reason)

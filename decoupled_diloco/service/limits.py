"""Bounds on what one push header may claim, checked before anything of the push is applied.

Why: a push header steers the run. `tokens` weighs the merge, `budget_steps` / `budget_tokens`
spend the budget, `compute_seconds` feeds the speeds DyLU sizes every learner's rounds by,
`seq` decides what is a duplicate. Without bounds one header (tokens=2**62,
budget_steps=10**12, seq=2**62) could dominate every merge, end the run (or, negative, extend
it), or make a learner's honest next pushes come back 'duplicate' and be lost. A push can
claim no more than its learner can have done:
  * local_steps and budget_steps <= ROUND_SLACK × one period (H steps per fragment, H × P in
    all): fixed and DyLU rounds are at most H steps, and a fragment is pushed once per period;
    a time-budget round, whose length no config fixes, within what the learner's fastest
    reported step time fits, ROUND_SLACK times over, in the wall time since that fragment's
    last push (`pace.Pace.most_steps`);
  * tokens <= local_steps × batch_size[learner] × seq_len, and budget_tokens likewise of
    budget_steps (every step reads one batch); neither budget field negative, and both 0 in a
    push to a syncer shard that does not keep the budget (service/shardrun.py);
  * compute_seconds per step within `pace.BAND` of the learner's own recent median and no
    more than `pace.BAND` times faster than its hardware's (`pace.Pace.check_step`);
  * seq <= acked seq + SEQ_WINDOW (a learner has at most a few pushes in flight; refused
    ones also take a seq).
"""

import dataclasses

from decoupled_diloco.run import schedule

SEQ_WINDOW = 64
ROUND_SLACK = 2  # Steps one push may carry over an honest round's: α = 0 with τ >= H skips a period's push.


class OutOfBounds(ValueError):
  """A push header claims more than its learner can have done; nothing of it was applied."""


@dataclasses.dataclass(frozen=True)
class PushLimits:
  """Per-run bounds: `tokens_per_step[m]` = batch_size[m] × seq_len; `round_steps`: the most steps one
  push may carry (ROUND_SLACK periods of H × P steps); `budget_steps`: the run's, which bounds a
  time-budget push until its learner's pace is known; `declared_speeds[m]`: steps per second its hardware
  promises (only their ratios are used); `keeps_budget`: whether this syncer counts the budget (shard 0)."""
  tokens_per_step: tuple[int, ...]
  round_steps: int
  budget_steps: int = 0
  time_budget: bool = False
  declared_speeds: tuple[float, ...] = ()
  keeps_budget: bool = True
  seq_window: int = SEQ_WINDOW

  @classmethod
  def from_config(cls, config, budget_steps: int, shard: int | None = None) -> "PushLimits":
    """The bounds of a service run's syncer (`shard`: which syncer shard, None or 0 keeps the budget)."""
    plan = schedule.RunPlan.from_config(config)
    return cls(tuple(b * config.model.seq_len for b in config.learners.batch_size),
               ROUND_SLACK * config.inner_steps * config.streaming.num_fragments, budget_steps,
               config.policy.kind == "time_budget", tuple(plan.declared_speeds), not shard)


def check_push(limits: PushLimits, header: dict, acked_seq: int, most_steps: int) -> None:
  """Raises OutOfBounds, naming the field and its bound, for a header no honest learner sends.

  `most_steps`: the steps this push may carry (`limits.round_steps`, or a time-budget learner's pace).
  """
  learner = header["learner"]
  for field in ("local_steps", "budget_steps"):
    if header[field] > most_steps:
      raise OutOfBounds(f"push from learner {learner} refused: {field}={header[field]} exceeds the {most_steps} "
                        "steps it can have taken since that fragment's last push")
  pairs = (("tokens", "local_steps"), ("budget_tokens", "budget_steps"))
  for tokens, steps in pairs:
    most_tokens = max(0, header[steps]) * limits.tokens_per_step[learner]
    if header[tokens] > most_tokens:
      raise OutOfBounds(f"push from learner {learner} refused: {tokens}={header[tokens]} exceeds {steps} × "
                        f"batch × seq_len = {most_tokens}")
  for field in ("budget_steps", "budget_tokens"):
    if header[field] < 0 or (header[field] and not limits.keeps_budget):
      where = "" if limits.keeps_budget else " (this syncer shard does not keep the budget: shard 0 does)"
      raise OutOfBounds(f"push from learner {learner} refused: {field}={header[field]} is not a share of the "
                        f"budget{where}")
  if header["seq"] > acked_seq + limits.seq_window:
    raise OutOfBounds(f"push from learner {learner} refused: seq={header['seq']} is beyond its acknowledged seq "
                      f"{acked_seq} + {limits.seq_window}")

"""Upper bounds on what one push header may claim, checked before anything of the push is applied.

Why: a push header steers the run. `tokens` weighs the merge, `local_steps` spends the
budget, `seq` decides what is a duplicate. Without bounds one header (tokens=2**62,
local_steps=10**12, seq=2**62) could dominate every merge, end the run, or make a learner's
honest next pushes come back 'duplicate' and be lost. A push can claim no more than its
learner can have done:
  * tokens <= local_steps × batch_size[learner] × seq_len (every step reads one batch);
  * local_steps <= steps left in the budget + one round (a round planned before another
    learner's push spent part of what was left still counts in full);
  * seq <= acked seq + SEQ_WINDOW (a learner has at most a few pushes in flight; refused
    ones also take a seq).
"""

import dataclasses

SEQ_WINDOW = 64


class OutOfBounds(ValueError):
  """A push header claims more than its learner can have done; nothing of it was applied."""


@dataclasses.dataclass(frozen=True)
class PushLimits:
  """Per-run bounds: `tokens_per_step[m]` = batch_size[m] × seq_len; `round_steps`: the most steps
  one push may carry beyond what the budget has left."""
  tokens_per_step: tuple[int, ...]
  round_steps: int
  seq_window: int = SEQ_WINDOW

  @classmethod
  def from_config(cls, config, budget_steps: int) -> "PushLimits":
    """The bounds of a service run. A time-budget round has no step count the config fixes, so it
    is bounded by the whole budget; other policies' rounds by one period (H steps, all fragments)."""
    round_steps = (budget_steps if config.policy.kind == "time_budget" else config.inner_steps *
                   config.streaming.num_fragments)
    return cls(tuple(b * config.model.seq_len for b in config.learners.batch_size), round_steps)


def check_push(limits: PushLimits, header: dict, acked_seq: int, steps_left: int) -> None:
  """Raises OutOfBounds, naming the field and its bound, for a header no honest learner sends."""
  learner = header["learner"]
  most_steps = steps_left + limits.round_steps
  if header["local_steps"] > most_steps:
    raise OutOfBounds(f"push from learner {learner} refused: local_steps={header['local_steps']} exceeds the "
                      f"{steps_left} steps left in the budget + one round of {limits.round_steps}")
  most_tokens = header["local_steps"] * limits.tokens_per_step[learner]
  if header["tokens"] > most_tokens:
    raise OutOfBounds(f"push from learner {learner} refused: tokens={header['tokens']} exceeds local_steps × "
                      f"batch × seq_len = {most_tokens}")
  if header["seq"] > acked_seq + limits.seq_window:
    raise OutOfBounds(f"push from learner {learner} refused: seq={header['seq']} is beyond its acknowledged seq "
                      f"{acked_seq} + {limits.seq_window}")

"""Metric records every runtime writes the same way (train-loss windows, evals, progress)."""

import os

from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.experiment import Experiment


def fresh_workdir(workdir: str, resume: bool, no_resume: str) -> str:
  """For runtimes that cannot resume: refuses `resume` (saying `no_resume`) and a workdir that
  already holds a run, before anything is written; returns the checkpoints directory."""
  if resume:
    raise ConfigError(no_resume)
  checkpoints = storage.makedirs(workdir) / "checkpoints"
  if checkpoints.is_dir() and any(checkpoints.iterdir()):
    raise ConfigError(f"workdir {workdir} already holds a run: pick a new --workdir")
  return os.fspath(checkpoints)


def train_records(learner, outer_step: int, log_every: int, extra: dict) -> list[dict]:
  """Mean loss per window of `log_every` inner steps; windows also end where a drain ends.

  Runtimes drain at round (or push) boundaries, so windows never span a checkpoint and a
  resumed run writes exactly the records the uninterrupted run wrote.
  """
  records, window = [], []
  losses = learner.drain_losses()
  for i, (step, loss) in enumerate(losses):
    window.append(loss)
    if (step + 1) % log_every == 0 or i == len(losses) - 1:
      records.append({"kind": "train", "outer_step": outer_step, "learner": learner.index,
                      "inner_step": step + 1, "tokens": (step + 1) * learner.batches.tokens_per_batch,
                      "loss": sum(window) / len(window), **extra})
      window = []
  return records


def eval_record(exp: Experiment, clock: dict, params=None) -> dict:
  """Held-out loss (and bits per byte) of the global params, or of a snapshot of them (and the optimum, when known).

  `params`: a snapshot taken earlier, for runtimes that evaluate off the training threads.
  """
  params = exp.global_params if params is None else params
  loss = exp.learners[0].evaluate(params, exp.eval_batches)
  record = {"kind": "eval", **clock, "eval_loss": loss, "eval_bits_per_byte": loss * exp.bits_per_byte}
  if exp.corpus.optimal_loss is not None:
    record["optimal_loss"] = exp.corpus.optimal_loss
  return record

"""Watches a run's records as they are written: one progress line per eval, and the divergence verdict.

Why one watcher for every runtime: a user of the virtual clock, the threads runtime or
`launch_local` deserves the same console as lockstep's (where the run is, its loss, its eval
and the gap to the optimum, speed, an ETA), and a run that is failing must say so at once in
all of them, not leave a diverged model behind an exit status of 0. The runtimes feed it the
records they write (MetricsWriter's observer); launch_local feeds it the syncer's
metrics.jsonl as it grows. What it concludes is pure in the records it saw.

Divergence: a non-finite eval loss, or `patience` evals in a row above the untrained model's
loss. An untrained model predicts a near-uniform distribution, so that loss is ln(vocab_size)
(measured: the demo's initialisations give 5.547-5.572 against ln 256 = 5.545); above it, the
model knows less than a uniform guess.
"""

import dataclasses
import math

from absl import logging

from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco.run import schedule

DIVERGED_EXIT_STATUS = 3  # What train and launch_local exit with when the run diverged (docs/usage.md).


def untrained_loss(vocab_size: int) -> float:
  """The untrained model's eval loss: a uniform guess over the vocabulary, ln V."""
  return math.log(vocab_size)


@dataclasses.dataclass
class Monitor:
  """The console and the divergence watch of one run, fed its records in the order they are written."""
  outer_steps: int  # The run's budget in rounds' worth of tokens.
  tokens_per_round: int
  untrained_loss: float
  patience: int  # Evals in a row above `untrained_loss` that make a divergence (0: only a non-finite loss).
  optimal_loss: float | None = None
  virtual_clock: bool = False  # Records' 'time' is virtual seconds (sim): shown beside the progress.
  diverged: str | None = None  # Why the run diverged (the loud line), once it has.
  last_eval: dict | None = None
  _above: int = 0
  _train_losses: dict = dataclasses.field(default_factory=dict)  # Learner -> its newest window's mean loss.
  _first: tuple | None = None  # (tokens, wall_time) of the first eval: speed and ETA exclude compile time.

  @classmethod
  def for_config(cls, config, optimal_loss: float | None = None) -> "Monitor":
    """The monitor of a validated config's run (every runtime's, and launch_local's)."""
    return cls(config.outer_steps,
               schedule.RunPlan.from_config(config).tokens_per_round, untrained_loss(config.model.vocab_size),
               config.divergence_evals, optimal_loss, virtual_clock=config.runtime == "sim")

  def observe(self, record: dict) -> None:
    """Takes one record: train windows update the loss shown, evals print a line and are judged."""
    if record.get("kind") == "train":
      self._train_losses[record.get("learner", 0)] = record["loss"]
    elif record.get("kind") == "eval":
      self.last_eval = record
      if self.optimal_loss is None:
        self.optimal_loss = record.get("optimal_loss")
      logging.info("%s", self.progress_line(record))
      self._judge(record)

  def progress_line(self, record: dict) -> str:
    """The progress line of an eval record: rounds' worth of tokens done of the budget, loss, eval and gap,
    virtual time (sim), tokens/s and ETA measured from the first eval on (no compile time in them)."""
    tokens, wall = record.get("tokens") or 0, record.get("wall_time")
    rate = eta = None
    if self._first is None:
      self._first = (tokens, wall)
    elif wall is not None and self._first[1] is not None and wall > self._first[1] and tokens > self._first[0]:
      rate = (tokens - self._first[0]) / (wall - self._first[1])
      eta = max(0, self.outer_steps * self.tokens_per_round - tokens) / rate
    losses = list(self._train_losses.values())
    line = metrics_lib.format_progress(outer_step=round(tokens / self.tokens_per_round),
                                       num_outer_steps=self.outer_steps, step=record.get("inner_step") or 0,
                                       loss=sum(losses) / len(losses) if losses else None,
                                       eval_loss=record["eval_loss"], optimum=self.optimal_loss, tokens_per_sec=rate,
                                       eta_seconds=eta)
    if self.virtual_clock and record.get("time") is not None:
      line += f" | virtual {metrics_lib.format_duration(record['time'])}"
    return line

  def _judge(self, record: dict) -> None:
    loss = record["eval_loss"]
    if self.diverged:
      return
    if not math.isfinite(loss):
      self._diverge(f"eval loss {loss} is not finite")
      return
    self._above = self._above + 1 if loss > self.untrained_loss else 0
    if self.patience and self._above >= self.patience:
      self._diverge(f"eval loss {loss:.3f} above the untrained model's {self.untrained_loss:.3f} for {self._above} "
                    "evals in a row")

  def _diverge(self, why: str) -> None:
    tokens = (self.last_eval or {}).get("tokens") or 0
    self.diverged = (f"DIVERGED at {tokens:,} tokens: {why}; the run stops. Lower "
                     "--config.outer.lr or --config.inner.lr (docs/usage.md, 'The console, and a run that diverges')")
    logging.error("%s", self.diverged)

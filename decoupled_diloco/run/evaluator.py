"""Held-out evaluation of Θ: the eval set, the one eval record, and the one background evaluator.

The virtual clock and the lockstep runtime evaluate in line (their order is the record
order); the threads runtime and the syncer process hand snapshots of Θ to `Evaluator`, a
thread that evaluates them in merge order, so no learner and no merge waits for an eval.
"""

import collections
import dataclasses
import threading
from typing import Callable

from absl import logging
import jax
import numpy as np

from decoupled_diloco.data import batches as batches_lib


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """The held-out batches, the loss -> bits-per-byte factor of their text, and the known optimum."""
  batches: list
  bits_per_byte: float = 1.0 / np.log(2)
  optimal_loss: float | None = None

  @classmethod
  def from_corpus(cls, config, corpus) -> "EvalSet":
    """config.eval_batches batches of config.eval_batch_size windows of the corpus's eval text."""
    batches = batches_lib.eval_batches(corpus, config.model.seq_len, config.eval_batch_size, config.eval_batches)
    return cls(batches, batches_lib.bits_per_byte_factor(corpus.tokenizer, batches), corpus.optimal_loss)

  def mean_loss(self, loss_fn: Callable, params) -> float:
    """Mean of `loss_fn(params, batch)` over the batches (dispatched together, fetched once)."""
    return float(np.mean(jax.device_get([loss_fn(params, batch) for batch in self.batches])))

  def record(self, loss: float, clock: dict) -> dict:
    """The `eval` record: the clock, the loss, its bits per byte and (when known) the optimum."""
    record = {"kind": "eval", **clock, "eval_loss": loss, "eval_bits_per_byte": loss * self.bits_per_byte}
    if self.optimal_loss is not None:
      record["optimal_loss"] = self.optimal_loss
    return record


class Evaluator:
  """Evaluates snapshots of Θ in order on one background thread, writing each record.

  `evaluate(params) -> loss`; `write(record)` must be thread-safe. Snapshots are safe to
  hold: merges replace Θ's arrays, they never change them in place. Each waiting snapshot is
  a copy of Θ, so a syncer process bounds them (`max_waiting=1`: the latest Θ is the one
  worth evaluating; records count the replaced ones in `evals_skipped`); the threads runtime
  evaluates every one (`max_waiting=None`), as the virtual clock does.
  """

  def __init__(self, evaluate: Callable, evals: EvalSet, write: Callable[[dict], None], max_waiting: int | None = None):
    self.evaluate, self.evals, self.write, self.max_waiting = evaluate, evals, write, max_waiting
    self.last: dict | None = None  # The newest record written.
    self.last_queued: dict | None = None  # The clock of the newest snapshot queued.
    self.skipped = 0  # Snapshots replaced by newer ones before their eval.
    self.failure: BaseException | None = None
    self._waiting: collections.deque = collections.deque()
    self._closed = False
    self._ready = threading.Condition()
    self._thread = threading.Thread(target=self._work, name="evaluator", daemon=True)
    self._thread.start()

  def submit(self, params, clock: dict) -> None:
    """Queues an eval of `params` at `clock` (outer_step, tokens, ...), dropping the oldest waiting
    snapshot when `max_waiting` are already queued."""
    with self._ready:
      self.last_queued = clock
      if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
        dropped = self._waiting.popleft()[1]
        self.skipped += 1
        logging.warning("eval of version %d skipped: version %d is newer", dropped["outer_step"], clock["outer_step"])
      self._waiting.append((params, clock))
      self._ready.notify()

  def _next(self) -> tuple | None:
    """The next snapshot and the skipped count so far, or None once closed and drained."""
    with self._ready:
      while not self._waiting and not self._closed:
        self._ready.wait()
      return (*self._waiting.popleft(), self.skipped) if self._waiting else None

  def _work(self) -> None:
    try:
      while (item := self._next()) is not None:
        params, clock, skipped = item
        record = self.evals.record(self.evaluate(params), clock)
        if self.max_waiting is not None:
          record["evals_skipped"] = skipped
        self.write(record)
        self.last = record  # Its writer's monitor (run/monitor.py) prints the progress line.
    except BaseException as error:  # pylint: disable=broad-except  # Re-raised by close().
      self.failure = error

  def close(self) -> None:
    """Finishes the queued evals; raises what the thread raised."""
    with self._ready:
      self._closed = True
      self._ready.notify()
    self._thread.join()
    if self.failure is not None:
      raise self.failure


def evaluate(exp, clock: dict) -> dict:
  """The eval record of the run's global params at `clock`, computed in line on learner 0's mesh (the
  virtual clock and lockstep: their order is the record order)."""
  return exp.evals.record(exp.learners[0].evaluate(exp.global_params, exp.evals), clock)

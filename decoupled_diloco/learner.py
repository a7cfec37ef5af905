"""One learner group: its compiled inner loop, its data shard and its train state.

A learner only knows how to pull global params, take inner steps and report what it
did; runtimes decide when each happens. Steps are dispatched without waiting for
results, so a runtime that interleaves several groups' steps keeps all their meshes busy.
"""

import dataclasses
from typing import Any

import jax
import numpy as np

from decoupled_diloco.data.batches import LearnerBatches
from decoupled_diloco.inner import InnerLoop, TrainState
from decoupled_diloco.syncer import Push


@dataclasses.dataclass
class Learner:
  """Mutable per-group bookkeeping around a pure, jitted inner step."""
  index: int
  loop: InnerLoop
  batches: LearnerBatches
  state: TrainState
  steps: int = 0                # Host mirror of state.step: picks the next batch without a device sync.
  anchor: Any = None            # Θ this learner last pulled (host); None when it trains alone (ddp).
  base_version: int = 0         # Syncer version of that Θ.
  tokens_since_pull: int = 0
  steps_since_pull: int = 0
  _pending_losses: list = dataclasses.field(default_factory=list)

  def pull(self, global_params, version: int) -> None:
    """Start local work from Θ; the AdamW state carries over untouched (never reset).

    The local params are freed before Θ arrives, so a pull never holds two parameter
    copies on the group's devices.
    """
    for leaf in jax.tree.leaves(self.state.params):
      leaf.delete()
    self.state = self.state._replace(params=self.loop.put_params(global_params))
    self.anchor, self.base_version = global_params, version
    self.tokens_since_pull = 0
    self.steps_since_pull = 0

  def step(self) -> None:
    """Dispatch one inner step asynchronously; the loss is fetched later in `drain_losses`."""
    batch = self.loop.put_batch(self.batches.batch(self.steps))
    self.state, metrics = self.loop.step(self.state, batch)
    self._pending_losses.append((self.steps, metrics["loss"]))
    self.steps += 1
    self.steps_since_pull += 1
    self.tokens_since_pull += self.batches.tokens_per_batch

  def drain_losses(self) -> list[tuple[int, float]]:
    """(inner step, loss) pairs since the last drain; blocks on the group's devices."""
    pending, self._pending_losses = self._pending_losses, []
    values = jax.device_get([loss for _, loss in pending])
    return [(step, float(v)) for (step, _), v in zip(pending, values)]

  def push(self, syncer, compute_seconds: float = 0.0) -> Push:
    """Pseudo-gradient of the local work against the anchor, moved to the syncer.

    The anchor is released: the next pull brings a new one, and holding the old Θ
    would keep a stale copy of the parameters alive on the host.
    """
    delta = syncer.pseudo_gradient(self.anchor, self.state.params)
    self.anchor = None
    return Push(self.index, delta, self.base_version, self.tokens_since_pull, self.steps_since_pull, compute_seconds)

  def evaluate(self, params, eval_batches) -> float:
    """Mean held-out loss of `params` (from anywhere), computed on this group's mesh."""
    params = self.loop.put_params(params)
    losses = [self.loop.loss(params, self.loop.put_batch(b)) for b in eval_batches]
    return float(np.mean(jax.device_get(losses)))

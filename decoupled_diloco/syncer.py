"""The syncer: owner of the global parameters Θ and the outer optimizer state.

It lives on the host (the CPU device of the process that runs it), apart from every
learner group's mesh, so a learner holds no extra device copy of Θ. State is a pure
value (`SyncerState`); `Syncer` only binds the optimizer and the host device to the
jitted pure functions that advance it.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from decoupled_diloco import merge, outer


class SyncerState(NamedTuple):
  """Everything a checkpoint of the syncer must hold."""
  params: Any      # Θ, float32 pytree on the host device.
  opt_state: Any   # Outer optimizer state (e.g. Nesterov momentum).
  version: int     # Number of outer steps taken; learners report the version they started from.


def host_device() -> jax.Device:
  """The device standing for host memory: the first CPU device of this process."""
  return jax.local_devices(backend="cpu")[0]


@dataclasses.dataclass(frozen=True)
class Syncer:
  """Binds an outer optimizer to jitted, host-placed outer steps."""
  optimizer: optax.GradientTransformation
  device: jax.Device = dataclasses.field(default_factory=host_device)

  def init(self, params) -> SyncerState:
    """Θ₀ = the learners' common initialisation, copied to the host."""
    params = jax.device_put(params, self.device)
    return SyncerState(params, jax.jit(self.optimizer.init)(params), 0)

  def to_host(self, tree):
    """Explicit move of a learner's arrays off its mesh, onto the syncer's device."""
    return jax.device_put(tree, self.device)

  def pseudo_gradient(self, anchor, local_params):
    """Δ_m = Θ_anchor − θ_m, computed on the host from the learner's current params."""
    return _jit_pseudo_gradient(anchor, self.to_host(local_params))

  def merge_and_step(self, state: SyncerState, deltas: Sequence[Any], tokens: Sequence[float]) -> SyncerState:
    """Synchronous DiLoCo round: token-weighted mean of Δ_m, then one outer step."""
    weights = merge.normalized_weights(tokens).astype(np.float32)
    params, opt_state = _jit_merge_and_step(self.optimizer, state.params, state.opt_state, list(deltas), weights)
    return SyncerState(params, opt_state, state.version + 1)


_jit_pseudo_gradient = jax.jit(outer.pseudo_gradient)


@jax.jit(static_argnums=0)
def _jit_merge_and_step(optimizer, params, opt_state, deltas, weights):
  merged = merge.weighted_average(deltas, weights)
  return outer.outer_step(optimizer, params, opt_state, merged)

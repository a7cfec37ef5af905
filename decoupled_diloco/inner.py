"""The inner loop of one learner group: AdamW with warmup + cosine, one sharded `jax.jit`.

The train step is a pure `(state, batch) -> (state, metrics)`; the jit pins its input and
output shardings to the group's mesh and donates the old state, so a step holds one copy
of params + AdamW moments. Nothing here knows about DiLoCo: the outer loop swaps
`state.params` between rounds and leaves the optimizer state alone (it is never reset).
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from decoupled_diloco import mesh as mesh_lib
from decoupled_diloco.model import LanguageModel


class TrainState(NamedTuple):
  """What one learner group carries from step to step."""
  step: jax.Array  # int32 scalar: inner steps taken, drives the LR schedule.
  params: Any
  opt_state: optax.OptState


def inner_optimizer(inner_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW as in DiLoCo: linear warmup, cosine decay, global-norm clipping.

  Weight decay skips vectors (norm scales, biases), as is standard for Transformers.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=inner_cfg.lr, warmup_steps=min(inner_cfg.warmup_steps, total_steps),
      decay_steps=max(total_steps, inner_cfg.warmup_steps + 1), end_value=inner_cfg.lr * inner_cfg.final_lr_fraction)
  return optax.chain(
      optax.clip_by_global_norm(inner_cfg.clip_norm),
      optax.adamw(schedule, b1=inner_cfg.b1, b2=inner_cfg.b2, weight_decay=inner_cfg.weight_decay,
                  mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)))


def train_step(model: LanguageModel, optimizer: optax.GradientTransformation, state: TrainState, batch):
  """One AdamW step on the mean next-token loss of `batch`."""
  loss, grads = jax.value_and_grad(model.loss)(state.params, batch)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
  return TrainState(state.step + 1, params, opt_state), metrics


@dataclasses.dataclass(frozen=True)
class InnerLoop:
  """A group's compiled steps and the shardings that tie them to its mesh."""
  mesh: Mesh
  param_shardings: Any
  state_shardings: TrainState
  batch_sharding: jax.sharding.NamedSharding
  init: Any  # params (any placement) -> TrainState on this mesh
  step: Any  # (TrainState, batch) -> (TrainState, metrics); donates the state
  loss: Any  # (params, batch) -> scalar, for evaluation

  def put_params(self, params):
    """Copies params (host or another mesh) onto this group's devices, explicitly.

    Never aliases: the step donates its state, and `device_put` reuses a source buffer
    that already sits on one of the mesh's devices (the syncer's Θ on a CPU-only host,
    whatever `may_alias` says), so such leaves are copied first.
    """
    return jax.tree.map(self.put_params_leaf, params, self.param_shardings)

  def put_params_leaf(self, leaf, sharding):
    """One leaf of `put_params`: a fresh buffer on this group's devices, never an alias."""
    if isinstance(leaf, jax.Array) and leaf.devices() & set(self.mesh.devices.flat):
      leaf = jnp.copy(leaf)
    return jax.device_put(leaf, sharding)

  def put_batch(self, batch):
    """Places a host batch split over the data axis."""
    return jax.device_put(batch, self.batch_sharding)

  def put_local_batch(self, rows):
    """Assembles the global batch from every process's own rows (this process holds only its share).

    Why: each host of a multi-host group reads only the rows its devices train on; with one
    process this is exactly `put_batch`.
    """
    if jax.process_count() == 1:
      return self.put_batch(rows)
    return jax.make_array_from_process_local_data(self.batch_sharding, rows)


def build_inner_loop(model: LanguageModel, optimizer: optax.GradientTransformation, mesh: Mesh,
                     params_shape, param_axes, fsdp: bool) -> InnerLoop:
  """Compiles a group's init/train/eval steps with explicit shardings on its mesh."""
  param_shardings = mesh_lib.param_shardings(mesh, params_shape, param_axes, fsdp)
  scalar = mesh_lib.replicated(mesh)
  batch = mesh_lib.batch_sharding(mesh)

  def init(params):
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  # Optimizer-state leaves shaped like a parameter take that parameter's sharding
  # (AdamW moments); everything else (counts) is replicated.
  abstract_state = jax.eval_shape(init, params_shape)
  opt_shardings = _opt_state_shardings(abstract_state.opt_state, params_shape, param_shardings, scalar)
  state_shardings = TrainState(scalar, param_shardings, opt_shardings)

  jit_init = jax.jit(init, in_shardings=(param_shardings,), out_shardings=state_shardings)
  jit_step = jax.jit(lambda s, b: train_step(model, optimizer, s, b),
                     in_shardings=(state_shardings, batch), out_shardings=(state_shardings, scalar),
                     donate_argnums=0)
  jit_loss = jax.jit(model.loss, in_shardings=(param_shardings, batch), out_shardings=scalar)
  loop = InnerLoop(mesh, param_shardings, state_shardings, batch, None, jit_step, jit_loss)
  return dataclasses.replace(loop, init=lambda params: jit_init(loop.put_params(params)))


def _opt_state_shardings(opt_state_shape, params_shape, param_shardings, scalar):
  """Shardings for an optax state: subtrees with the params' structure mirror them."""
  params_def = jax.tree.structure(params_shape)

  def is_params_like(node):
    return jax.tree.structure(node) == params_def

  return jax.tree.map(lambda node: param_shardings if is_params_like(node) else scalar,
                      opt_state_shape, is_leaf=is_params_like)

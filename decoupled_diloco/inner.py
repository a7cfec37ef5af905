"""The inner loop of one learner group: AdamW or Muon with warmup + cosine, one sharded `jax.jit`.

The train step is a pure `(state, batch) -> (state, metrics)`; the jit pins its input and
output shardings to the group's mesh and donates the old state, so a step holds one copy
of params + optimizer moments (each sharded as its param). Nothing here knows about DiLoCo: the outer loop swaps
`state.params` between rounds and leaves the optimizer state alone (it is never reset).
"""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from decoupled_diloco import inner_optimizers
from decoupled_diloco import mesh as mesh_lib
from decoupled_diloco import settings as settings_lib
from decoupled_diloco import sharded_init
from decoupled_diloco.errors import ConfigError
from decoupled_diloco import model as model_lib
from decoupled_diloco.model import LanguageModel


class TrainState(NamedTuple):
  """What one learner group carries from step to step."""
  step: jax.Array  # int32 scalar: inner steps taken, drives the LR schedule.
  params: Any
  opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.inner`, validated: optimizer settings optax would take and train with silently (a negative lr ascends).

  The muon_* fields (defaults as in configs/default.py) apply to optimizer 'muon' only; changed under
  'adamw' they are refused, not ignored.
  """
  lr: float
  warmup_steps: int
  final_lr_fraction: float
  weight_decay: float
  clip_norm: float
  b1: float
  b2: float
  microbatches: int = 1  # Checked against each group's batch by `validate_microbatches` (it needs the layout).
  optimizer: str = "adamw"
  muon_beta: float = 0.95
  muon_ns_steps: int = 5
  muon_consistent_rms: float = 0.2

  def __post_init__(self):
    checks = (
        (self.lr > 0, f"inner.lr={self.lr} must be > 0"),
        (self.warmup_steps >= 0, f"inner.warmup_steps={self.warmup_steps} must be >= 0"),
        (0 <= self.final_lr_fraction <= 1, f"inner.final_lr_fraction={self.final_lr_fraction} must be in [0, 1]"),
        (self.weight_decay >= 0, f"inner.weight_decay={self.weight_decay} must be >= 0"),
        (self.clip_norm > 0, f"inner.clip_norm={self.clip_norm} must be > 0"),
        (0 <= self.b1 < 1, f"inner.b1={self.b1} must be in [0, 1)"),
        (0 <= self.b2 < 1, f"inner.b2={self.b2} must be in [0, 1)"),
        (self.optimizer in inner_optimizers.OPTIMIZERS,
         f"inner.optimizer={self.optimizer!r} must be one of {inner_optimizers.OPTIMIZERS}"),
        (0 <= self.muon_beta < 1, f"inner.muon_beta={self.muon_beta} must be in [0, 1)"),
        (settings_lib.is_int(self.muon_ns_steps) and
         self.muon_ns_steps >= 1, f"inner.muon_ns_steps={self.muon_ns_steps!r} must be an int >= 1"),
        (self.muon_consistent_rms >= 0, f"inner.muon_consistent_rms={self.muon_consistent_rms} must be >= 0 "
         "(0 = width scaling)"),
        *((self.optimizer == "muon" or getattr(self, f.name) == f.default,
           f"inner.{f.name}={getattr(self, f.name)} applies to inner.optimizer='muon' only, which is "
           f"{self.optimizer!r} here; set it to muon or leave {f.name} at {f.default}")
          for f in dataclasses.fields(self) if f.name.startswith("muon_")),
    )
    settings_lib.check((ok, f"{message}: set --config.{message.split('=', 1)[0]} (defaults in configs/default.py)")
                       for ok, message in checks)
    if self.optimizer == "muon":
      inner_optimizers.require_optax_muon()

  @classmethod
  def from_config(cls, inner_cfg) -> "Settings":
    """The inner group of a config; unknown fields are refused by name."""
    return settings_lib.from_config(cls, inner_cfg, "inner")


def inner_optimizer(inner_cfg, total_steps: int) -> optax.GradientTransformation:
  """The configured inner optimizer (`inner_optimizers`) as in DiLoCo: linear warmup, cosine decay,
  global-norm clipping of the gradient before either optimizer sees it."""
  settings = Settings.from_config(inner_cfg)
  schedule = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=settings.lr,
                                                warmup_steps=min(settings.warmup_steps, total_steps),
                                                decay_steps=max(total_steps, settings.warmup_steps + 1),
                                                end_value=settings.lr * settings.final_lr_fraction)
  return optax.chain(optax.clip_by_global_norm(settings.clip_norm),
                     inner_optimizers.BUILDERS[settings.optimizer](settings, schedule))


def validate_microbatches(microbatches, batch_size: int, devices: int, group: int) -> None:
  """Each microbatch must split evenly over the group's devices, or the step would pad or gather."""
  if not isinstance(microbatches, int) or microbatches < 1 or batch_size % (microbatches * devices):
    raise ConfigError(f"inner.microbatches={microbatches!r} does not split learner group {group}'s batch_size "
                      f"{batch_size} into equal microbatches over its {devices} devices: use a positive int k "
                      f"with batch_size divisible by k * {devices}")


def loss_and_grads(model: LanguageModel, params, batch, microbatches: int = 1):
  """Metrics ({'loss': mean cross-entropy, router metrics of an MoE model}) and the gradient of the
  training loss (`model.train_loss`) over `batch`, computed `microbatches` rows-groups at a time.

  Gradient accumulation: activations are held for one microbatch only, and the mean of equal
  microbatches' means is the batch mean, so k > 1 trains the same model as one big batch (to
  float rounding). Microbatch j takes rows j, j+k, j+2k, ...: every device keeps a share of
  each microbatch, so no rows move between devices.
  """
  value_and_grad = lambda rows: _metrics_and_grads(model, params, rows)  # noqa: E731
  if microbatches == 1:
    return value_and_grad(batch)
  micro = batch.reshape(batch.shape[0] // microbatches, microbatches, *batch.shape[1:]).swapaxes(0, 1)

  def accumulate(total, rows):
    return jax.tree.map(jnp.add, total, value_and_grad(rows)), None

  metric_shapes = jax.eval_shape(value_and_grad, micro[0])[0]
  zeros = (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes), jax.tree.map(jnp.zeros_like, params))
  (metrics, grads), _ = jax.lax.scan(accumulate, zeros, micro)
  return jax.tree.map(lambda x: x / microbatches, (metrics, grads))


def _metrics_and_grads(model: LanguageModel, params, batch):
  (_, metrics), grads = jax.value_and_grad(model.train_loss, has_aux=True)(params, batch)
  return metrics, grads


def train_step(model: LanguageModel, optimizer: optax.GradientTransformation, state: TrainState, batch,
               microbatches: int = 1):
  """One optimizer step on the training loss of `batch` (accumulated over microbatches); metrics are
  `loss_and_grads`'s and the gradient's norm.

  With scan_layers the state holds the blocks stacked as [L, ...] leaves (`InnerLoop.to_step`), so
  the update, the norm and the step's inputs and outputs are one op and one buffer per block param
  whatever the depth: the compiled step does not grow with L.
  """
  metrics, grads = loss_and_grads(model, state.params, batch, microbatches)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  return TrainState(state.step + 1, params, opt_state), {**metrics, "grad_norm": optax.tree.norm(grads)}


@dataclasses.dataclass(frozen=True)
class InnerLoop:
  """A group's compiled steps and the shardings that tie them to its mesh.

  The state the step carries is in the step's layout: with scan_layers its params and AdamW
  moments hold the blocks stacked ([L, ...] leaves under `blocks`); everything outside the step
  (pushes, landings, checkpoints, fragments, evaluation) uses the params tree of block_i's, and
  `from_step` / `to_step` convert where the two meet. Without scan_layers both are the identity.
  """
  mesh: Mesh
  param_shardings: Any  # of the params tree (block_0 .. block_{L-1})
  state_shardings: TrainState  # of the state in the step's layout
  batch_sharding: jax.sharding.NamedSharding
  init: Any  # params tree (any placement) -> TrainState in the step's layout on this mesh
  step: Any  # (TrainState, batch) -> (TrainState, metrics); donates the state
  loss: Any  # (params tree, batch) -> scalar, for evaluation
  converters: dict = dataclasses.field(default_factory=dict)  # (direction, "state"|"params") -> jitted conversion
  fresh: Any = None  # make_params (pure, no arguments) -> compiled () -> TrainState born in state_shardings

  def init_fresh(self, make_params) -> TrainState:
    """The TrainState of `make_params()`'s params (sharded_init.params_fn), created on the mesh shard by shard.

    Why: `init` takes params that already exist somewhere whole; a learner starting from its seed
    never has them, so no device (nor the host) ever holds a whole parameter.
    """
    return self.fresh(make_params)()

  def to_step(self, tree):
    """A TrainState or params tree of block_i's in the step's layout (a new copy when stacked)."""
    return self._convert("to_step", tree)

  def from_step(self, tree):
    """A TrainState or params tree in the step's layout as block_i's (a new copy when stacked): what
    checkpoints, pushes and landings see, whatever scan_layers says."""
    return self._convert("from_step", tree)

  def _convert(self, direction: str, tree):
    if not self.converters:
      return tree
    return self.converters[direction, "state" if isinstance(tree, TrainState) else "params"](tree)

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
    """Places a host batch split over the batch axes (data × fsdp)."""
    return jax.device_put(batch, self.batch_sharding)

  def put_local_batch(self, rows):
    """Assembles the global batch from every process's own rows (this process holds only its share).

    Why: each host of a multi-host group reads only the rows its devices train on; with one
    process this is exactly `put_batch`.
    """
    if jax.process_count() == 1:
      return self.put_batch(rows)
    return jax.make_array_from_process_local_data(self.batch_sharding, rows)


def build_inner_loop(model: LanguageModel, optimizer: optax.GradientTransformation, mesh: Mesh, params_shape,
                     param_axes, microbatches: int = 1) -> InnerLoop:
  """Compiles a group's init/train/eval steps with explicit shardings on its mesh (its layout).

  The steps trace under the mesh (as an abstract mesh), so the model's activation constraints
  pin the residual stream to the batch axes instead of leaving layout to propagation.
  """
  layers = model.scanned_layers
  param_shardings = mesh_lib.param_shardings(mesh, params_shape, param_axes)
  step_param_shardings = model_lib.stack_shardings(param_shardings) if layers else param_shardings
  scalar = mesh_lib.replicated(mesh)
  batch = mesh_lib.batch_sharding(mesh)
  stack = (lambda params: model_lib.stack_blocks(params, layers)) if layers else (lambda params: params)

  def init(params):
    params = stack(params)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

  step_params_shape = jax.eval_shape(stack, params_shape)
  state_shardings = TrainState(scalar, step_param_shardings,
                               _opt_state_shardings(optimizer, step_params_shape, step_param_shardings, scalar))

  jit_init = jax.jit(init, in_shardings=(param_shardings,), out_shardings=state_shardings)

  def under_mesh(fn):

    def traced(*args):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn(*args)

    return traced

  jit_step = jax.jit(under_mesh(lambda s, b: train_step(model, optimizer, s, b, microbatches)),
                     in_shardings=(state_shardings, batch), out_shardings=(state_shardings, scalar), donate_argnums=0)
  jit_loss = jax.jit(under_mesh(model.loss), in_shardings=(param_shardings, batch), out_shardings=scalar)
  converters = {}
  if layers:
    tree_shardings = {
        "params": (param_shardings, step_param_shardings),
        "state": (TrainState(scalar, param_shardings,
                             _opt_state_shardings(optimizer, params_shape, param_shardings, scalar)), state_shardings)}
    converters = _converters(layers, params_shape, step_params_shape, tree_shardings)
  fresh = lambda make_params: sharded_init.compile_init(lambda: init(make_params()), state_shardings)  # noqa: E731
  loop = InnerLoop(mesh, param_shardings, state_shardings, batch, None, jit_step, jit_loss, converters, fresh)
  return dataclasses.replace(loop, init=lambda params: jit_init(loop.put_params(params)))


def _converters(layers: int, params_shape, step_params_shape, tree_shardings: dict) -> dict:
  """Jitted conversions between the params tree and the stacked step layout, of a TrainState or params.

  Each is compiled once per run; it holds L slices or stacks per block param (what the step no
  longer does) and runs where the tree leaves the step, not at every step.
  """
  canonical_def, stacked_def = jax.tree.structure(params_shape), jax.tree.structure(step_params_shape)

  def to_step(tree):
    return _map_params_like(lambda p: model_lib.stack_blocks(p, layers), tree, canonical_def)

  def from_step(tree):
    return _map_params_like(lambda p: model_lib.unstack_blocks(p, layers), tree, stacked_def)

  return {
      key: jax.jit(fn, out_shardings=shardings[index]) for kind, shardings in tree_shardings.items()
      for key, fn, index in ((("to_step", kind), to_step, 1), (("from_step", kind), from_step, 0))}


def abstract_inputs(loop: InnerLoop, optimizer: optax.GradientTransformation, params_shape, batch_size: int,
                    seq_len: int) -> tuple[TrainState, jax.ShapeDtypeStruct]:
  """Sharded ShapeDtypeStructs of a step's (state, batch), allocating nothing.

  Why: `loop.step.lower(*abstract_inputs(...)).compile()` compiles a group's real step for
  shapes that do not fit this machine (a 1B model on a 64-chip slice) and reads its memory.
  """
  shapes = jax.eval_shape(lambda p: TrainState(jnp.zeros((), jnp.int32), p, optimizer.init(p)), params_shape)
  shapes = jax.eval_shape(loop.to_step, shapes)
  state = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes,
                       loop.state_shardings)
  return state, jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32, sharding=loop.batch_sharding)


def _map_params_like(fn, tree, like_def, other=lambda node: node):
  """`tree` with `fn` applied to every subtree with the params' structure `like_def` (the params, an
  optimizer's moments) and `other` to every other leaf (counts).

  A moment of an optimizer that partitions the params (Muon's and its AdamW's) holds optax's empty
  `MaskedNode` where the other one owns the param: it counts as a leaf here, so that subtree is
  params-like too, and `fn` must leave those nodes be (`keep_masked`).
  """
  is_like = lambda node: jax.tree.structure(node, is_leaf=is_masked) == like_def  # noqa: E731
  return jax.tree.map(lambda node: fn(node) if is_like(node) else other(node), tree, is_leaf=is_like)


def is_masked(node) -> bool:
  """optax's placeholder for a param another optimizer of a partition owns: it holds no bytes."""
  return isinstance(node, optax.MaskedNode)


def moments(opt_state, params_shape) -> list:
  """Every params-like subtree of an optimizer state (its moments); what the plan counts per chip."""
  found = []
  _map_params_like(found.append, opt_state, jax.tree.structure(params_shape))
  return found


def keep_masked(like, tree):
  """`tree` (of the params' structure) with `like`'s `MaskedNode`s in their places: a masked moment's shardings."""
  return jax.tree.map(lambda node, value: node if is_masked(node) else value, like, tree, is_leaf=is_masked)


def _opt_state_shardings(optimizer: optax.GradientTransformation, params_shape, param_shardings, scalar):
  """Shardings for the optax state of `params_shape`: moments take their param's sharding, counts are replicated."""
  return _map_params_like(lambda moments: keep_masked(moments, param_shardings),
                          jax.eval_shape(optimizer.init, params_shape), jax.tree.structure(params_shape),
                          lambda _: scalar)

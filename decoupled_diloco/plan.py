"""What a run needs before anyone books a slice: per-chip memory, step time and the exchange's cost.

Pure arithmetic over abstract shapes (nothing large is allocated), used by `experiments.plan`:
- Memory per chip of one learner group: params, the inner optimizer's moments and gradients (laid out
  by the group's mesh layout), plus the activations the backward pass keeps. Those are counted
  from the model itself: the residuals `jax.vjp` saves (its remat policy included), split into
  what grows with the batch (taken at one chip's share of it) and weight copies (sharded like
  the params), plus, under remat, one layer's recomputed activations.
  Tensor parallelism divides the residual dimensions it shards (heads, MLP width, vocabulary).
  Attention is traced as the target chip runs it (`attention.select`): a flash kernel (splash on
  TPU; cuDNN's on GPU for bf16/fp16, whose saved tensors are splash's: q, k, v, output,
  log-sum-exp) keeps no [T, T] scores; plain XLA attention (GPU at float32) keeps them.
  XLA's CPU memory analysis, shown beside it, counts remat as the chip would, but compiles
  attention as XLA's (Pallas and cuDNN kernels do not compile for a CPU).
- Start-up: the params and AdamW state, created sharded (sharded_init), plus the random draws'
  scratch; it must fit as the step must.
- Time: a step's training FLOPs at the chip's bf16 peak and the profile's MFU.
- Communication: a fragment's push (compressed pseudo-gradient) and pull (Θ_p) over the
  group's link, against the compute that can hide it: τ steps, and H/P steps per fragment.
"""

import copy
import dataclasses
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import ml_collections

from decoupled_diloco import accumulate, compression, fragments, hardware, inner, mesh, model as model_lib, outer
from decoupled_diloco import sharded_init
from decoupled_diloco.model import attention
from decoupled_diloco.run import schedule

# Share of a chip's HBM kept free for XLA's scratch, fragmentation and the runtime (v6e: 28 of 32 GB usable).
RESERVED_HBM_FRACTION = 0.125
# Formats from most to least faithful: the first one whose exchange hides is the one to pick.
FORMATS_BY_FIDELITY = ("fp32", "bf16", "int8", "int4", "fp4", "int2")
# Scratch of the sharded init, in params-sized states per chip: every leaf's random bits and its draw before
# scaling are live at once as XLA schedules the init on CPU (tests/test_sharded_init.py measures 1.95).
INIT_SCRATCH_STATES = 2


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Bytes per chip of one learner group, by what holds them (analytic)."""
  params: int
  optimizer: int
  gradients: int
  activations: int  # Saved residuals + the recompute working set of one layer under remat.
  hbm: float  # The chip's HBM.

  @property
  def peak(self) -> int:
    """Everything alive at the end of the backward pass (a conservative peak)."""
    return self.params + self.optimizer + self.gradients + self.activations

  @property
  def startup(self) -> int:
    """The init's peak: params and AdamW state born sharded, plus the draws' scratch (INIT_SCRATCH_STATES)."""
    return self.params + self.optimizer + INIT_SCRATCH_STATES * self.params

  @property
  def usable(self) -> float:
    """HBM the run may plan to fill."""
    return self.hbm * (1 - RESERVED_HBM_FRACTION)


@dataclasses.dataclass(frozen=True)
class CommPlan:
  """One group's exchange with the syncer, per fragment, against the compute that can hide it."""
  push_bytes: int  # Largest fragment's compressed pseudo-gradient.
  pull_bytes: int  # Largest fragment's Θ_p in the downlink format.
  transfer_seconds: float  # Push + pull of that fragment, latency included.
  step_seconds: float
  inner_steps: int  # H.
  num_fragments: int  # P.
  overlap_steps: int  # τ.

  @property
  def compute_seconds(self) -> float:
    """Compute of H inner steps: one full sync period."""
    return self.inner_steps * self.step_seconds

  @property
  def hides(self) -> bool:
    """The exchange lands within τ steps, and the link carries all P fragments within H steps."""
    return (self.transfer_seconds <= self.overlap_steps * self.step_seconds and
            self.num_fragments * self.transfer_seconds <= self.compute_seconds)

  @property
  def overlap_needed(self) -> int:
    """Smallest τ that would hide one fragment's exchange (may exceed H: then no τ does)."""
    return math.ceil(self.transfer_seconds / self.step_seconds) if self.step_seconds else 0


def state_bytes(params_shape, param_axes, layout: mesh.Layout, held=None) -> int:
  """Bytes one chip holds of one params-shaped tree under `layout`: the params (float32) or `held`, a moment of
  the inner optimizer, whose leaves are sharded as their params and whose masked leaves (another optimizer's
  params) hold nothing."""
  sizes = dict(zip(mesh.MESH_AXES, layout.shape))
  held = jax.tree.leaves(params_shape if held is None else held, is_leaf=inner.is_masked)
  return sum(
      mesh.shard_bytes(p.shape, mesh.param_spec(p.shape, axes, sizes), sizes,
                       jnp.dtype(leaf.dtype).itemsize)
      for p, axes, leaf in zip(jax.tree.leaves(params_shape), _axes_leaves(param_axes), held)
      if not inner.is_masked(leaf))


def optimizer_bytes(config, params_shape, param_axes, layout: mesh.Layout) -> int:
  """Bytes one chip holds of the inner optimizer's moments: AdamW two per param, Muon one per block matrix and
  two per other leaf (its AdamW half). Counted from the optimizer's own state, so a new optimizer is counted right."""
  state = jax.eval_shape(inner.inner_optimizer(config.inner, 1).init, params_shape)
  return sum(state_bytes(params_shape, param_axes, layout, moment) for moment in inner.moments(state, params_shape))


def abstract_params(model_cfg):
  """model.abstract_params, traced once per model shape: a plan asks for it per group, fragment count and format,
  and tracing a 48-layer model takes seconds."""
  return _abstract_params_of(model_cfg.to_json(sort_keys=True))


@functools.lru_cache(maxsize=16)
def _abstract_params_of(model_json: str):
  return model_lib.abstract_params(ml_collections.ConfigDict(json.loads(model_json)))


def _axes_leaves(param_axes):
  return jax.tree.leaves(param_axes, is_leaf=model_lib.is_axes_leaf)


def _tensor_sharded_dims(model_cfg) -> set[int]:
  """Residual extents that tensor parallelism splits: head counts, MLP width, vocabulary."""
  return {model_cfg.num_heads, model_cfg.num_kv_heads or model_cfg.num_heads, model_cfg.d_ff, model_cfg.vocab_size}


def residual_bytes(model_cfg, local_batch: int, tensor: int = 1) -> int:
  """Bytes `jax.vjp` of the loss saves for `local_batch` sequences, params themselves excluded.

  Traced abstractly (once per model, batch and tensor size: groups of one shape share it). Under
  tensor parallelism each residual's first non-batch dimension that is a head count, the MLP width
  or the vocabulary (and divides by `tensor`) is split.
  """
  return _residual_bytes(model_cfg.to_json(sort_keys=True), local_batch, tensor)


@functools.lru_cache(maxsize=64)
def _residual_bytes(model_json: str, local_batch: int, tensor: int) -> int:
  model_cfg = ml_collections.ConfigDict(json.loads(model_json))
  model, params_shape, _ = abstract_params(model_cfg)
  batch = jax.ShapeDtypeStruct((local_batch, model_cfg.seq_len + 1), jnp.int32)
  split, found = _tensor_sharded_dims(model_cfg), []

  def trace(params, tokens):
    _, pullback = jax.vjp(model.loss, params, tokens)
    inputs = {id(x) for x in jax.tree.leaves((params, tokens))}
    found.extend((r.shape, r.dtype) for r in jax.tree.leaves(pullback) if id(r) not in inputs)
    return 0

  jax.eval_shape(trace, params_shape, batch)
  total = 0
  for shape, dtype in found:
    shape = list(shape)
    for dim in range(1, len(shape)):
      if tensor > 1 and shape[dim] in split and shape[dim] % tensor == 0:
        shape[dim] //= tensor
        break
    total += math.prod(shape) * jnp.dtype(dtype).itemsize
  return total


def _saved_per_chip(model_cfg, local_batch: int, layout: mesh.Layout) -> int:
  """Residual bytes on one chip: the part that grows with the batch (activations) at the chip's
  share of it, plus the part that does not (weight copies: casts, stacked layers), sharded as
  the params are. The two parts come from tracing 1 and 2 sequences."""
  one, two = (residual_bytes(model_cfg, b, layout.tensor) for b in (1, 2))
  per_sequence = two - one
  return (one - per_sequence) // layout.fsdp + local_batch * per_sequence


def activation_bytes(model_cfg, local_batch: int, layout: mesh.Layout) -> int:
  """Saved residuals at the configured remat, plus one layer's full residuals when remat recomputes them."""
  saved = _saved_per_chip(model_cfg, local_batch, layout)
  if model_cfg.remat == "none":
    return saved
  plain = copy.deepcopy(model_cfg)
  plain.remat, plain.num_layers = "none", 1
  one = _saved_per_chip(plain, local_batch, layout)
  plain.num_layers = 2
  return saved + _saved_per_chip(plain, local_batch, layout) - one


def chip_attention(model_cfg, chip: str) -> attention.Choice:
  """The attention kernel the chip will run for this model (attention.select at the model's compute dtype)."""
  return attention.select(model_cfg.attention, hardware.ACCELERATORS[chip].backend, model_cfg.dtype,
                          model_cfg.document_eod_id >= 0)


def target_model_config(model_cfg, chip: str):
  """The model config as the chip would trace it: its attention as `chip_attention` picks it, flash kernels
  (splash, cuDNN's, whose saved tensors are splash's) traced as splash in interpret mode (any backend)."""
  kernel = chip_attention(model_cfg, chip).kernel
  target = copy.deepcopy(model_cfg)
  target.attention = "splash_interpret" if kernel in ("splash", "cudnn") else kernel
  return target


def memory_plan(config, group: int) -> MemoryPlan:
  """Analytic bytes per chip of learner group `group` on its chip (learners.hardware[group])."""
  layout, chip = mesh.layouts_from_config(config.learners)[group], chip_of(config, group)
  _, params_shape, param_axes = abstract_params(config.model)
  per_state = state_bytes(params_shape, param_axes, layout)
  microbatches = config.inner.microbatches
  local_batch = config.learners.batch_size[group] // layout.batch_shards // microbatches
  gradients = per_state * (2 if microbatches > 1 else 1)  # An accumulator beside each microbatch's grads.
  return MemoryPlan(per_state, optimizer_bytes(config, params_shape, param_axes, layout), gradients,
                    activation_bytes(target_model_config(config.model, chip), max(local_batch, 1), layout),
                    hardware.ACCELERATORS[chip].hbm_bytes)


def chip_of(config, group: int) -> str:
  """The group's accelerator name; the plan needs a real chip, not a relative speed."""
  return hardware.profiles_from_config(config.learners, 1.0)[group].chip


def step_seconds(config, group: int) -> float:
  """One inner step at the profile's MFU: training FLOPs / (chips · peak · MFU)."""
  profile = hardware.profiles_from_config(config.learners, config.sim.reference_step_seconds)[group]
  return profile.mean_step_seconds(schedule.flops_per_step(config)[group])


def link(config, group: int) -> tuple[float, float]:
  """(Gbit/s, one-way latency s) of the group's link to the syncer; 0 Gbit/s = unlimited."""
  sim = config.sim
  gbps = sim.learner_link_gbps[group] if sim.learner_link_gbps else sim.link_gbps
  latency = sim.learner_link_latency_seconds[group] if sim.learner_link_latency_seconds else sim.link_latency_seconds
  return float(gbps), float(latency)


def comm_plan(config, group: int, fmt: str | None = None, num_fragments: int | None = None) -> CommPlan:
  """Group `group`'s exchange per fragment at `fmt` and P (the config's unless given)."""
  _, params_shape, _ = abstract_params(config.model)
  p = num_fragments or config.streaming.num_fragments
  assignment = fragments.partition(params_shape, p, config.streaming.strategy)
  codec = compression.Codec.from_config(config.compression)
  codec = dataclasses.replace(codec, format=fmt) if fmt else codec
  downlink = 4 if config.compression.downlink_format == "fp32" else 2
  pushes, pulls = [0] * p, [0] * p
  for fragment, leaf in zip(assignment, jax.tree.leaves(params_shape)):
    pushes[fragment] += compression.wire_bytes(codec, [leaf.shape])
    pulls[fragment] += math.prod(leaf.shape) * downlink
  largest = max(range(p), key=lambda f: pushes[f] + pulls[f])
  gbps, latency = link(config, group)
  wire = (pushes[largest] + pulls[largest]) * 8 / (gbps * 1e9) if gbps else 0.0
  return CommPlan(pushes[largest], pulls[largest], wire + 2 * latency, step_seconds(config, group), config.inner_steps,
                  p, config.streaming.overlap_steps)


def hiding_format(config, group: int) -> str | None:
  """The most faithful wire format whose exchange hides at the configured P and τ (None: none does)."""
  return next((f for f in FORMATS_BY_FIDELITY if comm_plan(config, group, fmt=f).hides), None)


def hiding_fragments(config, group: int) -> int | None:
  """The fewest fragments P (>= the configured one) that hide the exchange at the chosen format."""
  _, params_shape, _ = abstract_params(config.model)
  most = config.model.num_layers if config.streaming.strategy == "strided" else len(jax.tree.leaves(params_shape))
  return next(
      (p for p in range(config.streaming.num_fragments, most + 1) if comm_plan(config, group, num_fragments=p).hides),
      None)


def syncer_bytes(config) -> int:
  """Host bytes of the syncer at its peak, independent of the number of learners (docs/syncer-memory.md): Θ and
  the outer optimizer's state (float32), the running sums of the fragments with open pushes (at most Θ's size),
  the outer step's scratch over the largest fragment (merge_scratch_bytes) and the push being received: its
  largest tensor (the rest waits in a spool file, over the data channel or gRPC alike)."""
  _, params_shape, _ = abstract_params(config.model)
  theta = 4 * model_lib.count_params(params_shape)
  outer_state = jax.eval_shape(outer.outer_optimizer(config.outer).init, params_shape)
  state = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(outer_state))
  receive = max(4 * math.prod(x.shape) for x in jax.tree.leaves(params_shape))
  return 2 * theta + state + merge_scratch_bytes(config) + receive


def merge_scratch_bytes(config) -> int:
  """XLA's scratch for one outer step of the largest fragment (a merge runs one fragment at a time)."""
  _, params_shape, _ = abstract_params(config.model)
  streaming = config.streaming
  assignment = fragments.partition(params_shape, streaming.num_fragments, streaming.strategy)
  sizes = [0] * streaming.num_fragments
  for fragment, leaf in zip(assignment, jax.tree.leaves(params_shape)):
    sizes[fragment] += math.prod(leaf.shape)
  largest = fragments.select(params_shape, assignment, max(range(len(sizes)), key=sizes.__getitem__))
  return accumulate.outer_step_scratch_bytes(outer.outer_optimizer(config.outer), largest)


def compile_group(config, group: int) -> dict:
  """XLA's figures for `group`'s inner step, compiled abstractly on this process's virtual devices."""
  layout = mesh.layouts_from_config(config.learners)[group]
  model_cfg = copy.deepcopy(config.model)
  model_cfg.attention = chip_attention(config.model, chip_of(config, group)).kernel
  if model_cfg.attention in ("splash", "cudnn", "splash_interpret"):
    model_cfg.attention = "xla"  # Pallas and cuDNN kernels do not compile for CPU; XLA's figure holds [T, T] scores.
  model, params_shape, param_axes = model_lib.abstract_params(model_cfg)
  optimizer = inner.inner_optimizer(config.inner, config.outer_steps * config.inner_steps)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(jax.devices()[:layout.devices], layout), params_shape,
                                param_axes, config.inner.microbatches)
  state, batch = inner.abstract_inputs(loop, optimizer, params_shape, config.learners.batch_size[group],
                                       config.model.seq_len)
  begin = time.perf_counter()
  compiled = loop.step.lower(state, batch).compile()
  seconds = time.perf_counter() - begin
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  init = loop.fresh(sharded_init.params_fn(model_cfg, config.seed))  # Compiled only: the start-up's figure.
  return {
      "peak_bytes": sharded_init.peak_bytes(compiled), "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
      "flops": float(cost.get("flops", 0)), "compile_seconds": seconds,
      "init_peak_bytes": sharded_init.peak_bytes(init), "attention": model_cfg.attention}

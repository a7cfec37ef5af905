"""Learner groups on disjoint device subsets: one `Mesh` per group, each with its own layout.

Every learner group owns a slice of the devices and lays it out as a mesh `data` × `fsdp` ×
`expert` × `tensor` (`learners.layouts`): the batch is split over `data` × `fsdp` × `expert`,
parameters shard their `embed` dimension over `fsdp`, an MoE model's experts over `expert` and
their `heads`, `mlp` or `vocab` dimension over `tensor`, activations follow ACTIVATION_RULES
(docs/plan.md, docs/moe.md). Why explicit moves: arrays
never move between groups implicitly; the runtime `jax.device_put`s them onto the target
group's shardings, so pushes and pulls work between any two layouts.
"""

from collections.abc import Sequence
import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from decoupled_diloco.errors import ConfigError

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, TENSOR_AXIS)
# Mesh axes the batch dimension is split over: an expert axis carries data parallelism outside the experts.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)
# Logical parameter axes -> the mesh axis that shards them; each mesh axis takes the first matching divisible dim.
PARAM_RULES = (("embed", FSDP_AXIS), ("expert", EXPERT_AXIS), ("heads", TENSOR_AXIS), ("mlp", TENSOR_AXIS),
               ("vocab", TENSOR_AXIS))
_LAYOUT_EXAMPLE = "e.g. 'fsdp=8,tensor=2' or 'data=4,fsdp=4'"


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one group lays out its devices: sizes of the data, fsdp, expert and tensor mesh axes."""
  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1

  @property
  def devices(self) -> int:
    """Devices the layout needs: the product of its axis sizes."""
    return self.data * self.fsdp * self.expert * self.tensor

  @property
  def batch_shards(self) -> int:
    """Pieces the batch is split into (data × fsdp × expert): a group's batch size must be a multiple."""
    return self.data * self.fsdp * self.expert

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """Mesh shape in MESH_AXES order."""
    return (self.data, self.fsdp, self.expert, self.tensor)

  def __str__(self) -> str:
    """'data=2,fsdp=32,tensor=1': every axis but expert, which is named only when used (MoE layouts)."""
    return ",".join(f"{name}={size}" for name, size in zip(MESH_AXES, self.shape) if name != EXPERT_AXIS or size > 1)

  @classmethod
  def parse(cls, spec: str, devices: int, group: int) -> "Layout":
    """'fsdp=8,tensor=2' -> Layout; ConfigError naming the group and the fix on anything else."""
    sizes = {}
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
      name, _, value = entry.partition("=")
      if name.strip() not in MESH_AXES or name.strip() in sizes or not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"learners.layouts[{group}]={spec!r}: bad entry {entry!r}; write AXIS=SIZE with AXIS in "
                          f"{MESH_AXES}, each once, SIZE >= 1, {_LAYOUT_EXAMPLE}")
      sizes[name.strip()] = int(value)
    layout = cls(**sizes)
    if layout.devices != devices:
      raise ConfigError(f"learners.layouts[{group}]={spec!r} spans {layout.devices} devices but the group has "
                        f"{devices} (learners.devices[{group}]): make the axis sizes multiply to {devices}")
    return layout


def layouts_from_config(learners_cfg) -> list[Layout]:
  """One layout per group: `learners.layouts`, or today's 1-D layout from `learners.fsdp` when it is empty."""
  devices = tuple(learners_cfg.devices)
  specs = tuple(learners_cfg.layouts)
  if not specs:
    return [Layout(fsdp=n) if learners_cfg.fsdp else Layout(data=n) for n in devices]
  if learners_cfg.fsdp:
    raise ConfigError("learners.fsdp=True and learners.layouts are both set: say fsdp=N in each layout instead "
                      "(--config.learners.fsdp=False)")
  if len(specs) != len(devices):
    raise ConfigError(f"learners.layouts has {len(specs)} entries for {len(devices)} learner groups: give one "
                      f"per group, {_LAYOUT_EXAMPLE}")
  return [Layout.parse(spec, n, group) for group, (spec, n) in enumerate(zip(specs, devices))]


def partition_devices(devices: Sequence[jax.Device], counts: Sequence[int]) -> list[list[jax.Device]]:
  """Split devices into consecutive disjoint groups, so no two learners share a chip.

  `jax.make_mesh` would silently take the first N devices for every group; slicing
  the list ourselves is what makes the groups disjoint.
  """
  needed = sum(counts)
  if any(c < 1 for c in counts):
    raise ConfigError(f"learners.devices={tuple(counts)} has a group with < 1 device: give every group at least 1")
  if needed > len(devices):
    raise ConfigError(f"learners.devices={tuple(counts)} needs {needed} devices but {len(devices)} are available: "
                      "shrink learners.devices or run on more devices")
  groups, start = [], 0
  for count in counts:
    groups.append(list(devices[start:start + count]))
    start += count
  return groups


def group_mesh(devices: Sequence[jax.Device], layout: Layout | None = None) -> Mesh:
  """A data × fsdp × expert × tensor mesh over one group's devices (all on `data` without a layout).

  Axis type Auto: the train step pins shardings at its jit boundary (in/out shardings)
  and lets the compiler propagate inside, which keeps the model code sharding-agnostic.
  """
  layout = layout or Layout(data=len(devices))
  if layout.devices != len(devices):
    raise ConfigError(f"layout {layout} needs {layout.devices} devices but the group has {len(devices)}")
  return jax.make_mesh(layout.shape, MESH_AXES, devices=list(devices),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def param_spec(shape: Sequence[int], logical_axes: Sequence[str | None], mesh_shape) -> PartitionSpec:
  """Map a parameter's logical axes to mesh axes by PARAM_RULES; `mesh_shape` maps axis name -> size.

  Each mesh axis of size > 1 shards the first dimension whose logical name it serves and
  whose extent it divides; everything else is replicated.
  """
  spec: list[str | None] = [None] * len(shape)
  for mesh_axis in MESH_AXES:
    size = mesh_shape.get(mesh_axis, 1)
    if size == 1:
      continue
    served = {logical for logical, target in PARAM_RULES if target == mesh_axis}
    for dim, (extent, name) in enumerate(zip(shape, logical_axes)):
      if spec[dim] is None and name in served and extent % size == 0:
        spec[dim] = mesh_axis
        break
  return PartitionSpec(*spec)


def param_shardings(mesh: Mesh, params, param_axes):
  """Per-parameter NamedShardings from the model's logical annotations and the mesh's layout."""
  # `params` leads: its leaves sit where `param_axes` holds whole tuples, so each tuple
  # arrives intact as one argument.
  return jax.tree.map(lambda p, axes: NamedSharding(mesh, param_spec(p.shape, axes, mesh.shape)), params, param_axes)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches are split over data × fsdp × expert along their batch dimension (replicated over tensor)."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


# Logical activation axes -> mesh axes, in order of preference. Mesh axes the group's mesh lacks
# are skipped, so one table serves a 1-D data mesh and data/fsdp/tensor layouts alike. The batch
# goes over every batch-parallel axis (data, FSDP and expert shard the same sequences); an MoE block's
# tokens, dispatched to their experts, over the expert axis (XLA moves them there); heads, MLP hidden
# units and vocabulary logits over the tensor axis; the residual stream (embed) and the sequence
# (length) stay whole, so a block's matmuls never compute partial sums for the global batch.
ACTIVATION_RULES = {
    "batch": BATCH_AXES,
    "expert": (EXPERT_AXIS,),
    "length": (),
    "embed": (),
    "heads": (TENSOR_AXIS,),
    "kv": (),
    "mlp": (TENSOR_AXIS,),
    "vocab": (TENSOR_AXIS,),}


def activation_spec(shape: Sequence[int], logical_axes: Sequence[str | None], mesh_shape: dict) -> PartitionSpec:
  """PartitionSpec of an activation from its logical axes under ACTIVATION_RULES.

  A dimension takes the rule's mesh axes that exist in `mesh_shape` (axis name -> size) while
  their product divides it, so uneven shapes (4 KV heads on 8 tensor chips) fall back to fewer
  axes instead of padding; an axis already used by an earlier dimension is not reused.
  """
  used: set[str] = set()
  spec: list = []
  for extent, name in zip(shape, logical_axes):
    axes, size = [], 1
    for axis in ACTIVATION_RULES.get(name, ()) if name else ():
      if axis in mesh_shape and axis not in used and extent % (size * mesh_shape[axis]) == 0:
        axes.append(axis)
        size *= mesh_shape[axis]
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*spec)


def replicated(mesh: Mesh) -> NamedSharding:
  """Scalars and metrics live on every device of the group."""
  return NamedSharding(mesh, PartitionSpec())


def shard_bytes(shape: Sequence[int], spec: PartitionSpec, mesh_shape, itemsize: int) -> int:
  """Bytes one device holds of an array of `shape` laid out by `spec`: what the memory plan sums."""
  per_device = list(shape)
  for dim, axes in enumerate(spec):
    for axis in (axes if isinstance(axes, tuple) else (axes,)) if axes else ():
      per_device[dim] = -(-per_device[dim] // mesh_shape[axis])
  return math.prod(per_device) * itemsize

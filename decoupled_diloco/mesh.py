"""Learner groups on disjoint device subsets: one `Mesh` per group, and its shardings.

Every learner group owns a slice of the devices (a TPU slice on Cloud, a few virtual CPU
devices here). Its inner step is data-parallel over the mesh axis `data`; with FSDP the
parameters (and with them the AdamW moments) are also sharded over `data` along their
`embed` dimension. Arrays never move between groups implicitly: the runtime moves them
with `jax.device_put` to the target group's shardings.
"""

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from decoupled_diloco.errors import ConfigError

DATA_AXIS = "data"
# Logical parameter axes sharded over the data axis under FSDP (ZeRO-3 style).
FSDP_LOGICAL_AXES = ("embed",)


def partition_devices(devices: Sequence[jax.Device], counts: Sequence[int]) -> list[list[jax.Device]]:
  """Split devices into consecutive disjoint groups, so no two learners share a chip.

  `jax.make_mesh` would silently take the first N devices for every group; slicing
  the list ourselves is what makes the groups disjoint.
  """
  needed = sum(counts)
  if any(c < 1 for c in counts):
    raise ConfigError(f"learners.devices={tuple(counts)} has a group with < 1 device: give every group at least 1")
  if needed > len(devices):
    raise ConfigError(
        f"learners.devices={tuple(counts)} needs {needed} devices but {len(devices)} are available: "
        "shrink learners.devices or run on more devices")
  groups, start = [], 0
  for count in counts:
    groups.append(list(devices[start:start + count]))
    start += count
  return groups


def group_mesh(devices: Sequence[jax.Device]) -> Mesh:
  """A 1-D mesh over one group's devices.

  Axis type Auto: the train step pins shardings at its jit boundary (in/out shardings)
  and lets the compiler propagate inside, which keeps the model code sharding-agnostic.
  """
  return jax.make_mesh((len(devices),), (DATA_AXIS,), devices=list(devices),
                       axis_types=(jax.sharding.AxisType.Auto,))


def _spec_for(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mesh, fsdp: bool) -> PartitionSpec:
  """Map a parameter's logical axes to mesh axes; FSDP shards the first divisible `embed` dim."""
  if not fsdp:
    return PartitionSpec()
  size = mesh.shape[DATA_AXIS]
  spec: list[str | None] = [None] * len(shape)
  for dim, (extent, name) in enumerate(zip(shape, logical_axes)):
    if name in FSDP_LOGICAL_AXES and extent % size == 0:
      spec[dim] = DATA_AXIS
      break
  return PartitionSpec(*spec)


def param_shardings(mesh: Mesh, params, param_axes, fsdp: bool):
  """Per-parameter NamedShardings from the model's logical annotations."""
  # `params` leads: its leaves sit where `param_axes` holds whole tuples, so each tuple
  # arrives intact as one argument.
  return jax.tree.map(lambda p, axes: NamedSharding(mesh, _spec_for(p.shape, axes, mesh, fsdp)),
                      params, param_axes)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches are split over the data axis along their batch dimension."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


# Logical activation axes -> mesh axes, in order of preference. Mesh axes the group's mesh lacks
# are skipped, so one table serves a 1-D data mesh and data/fsdp/tensor layouts alike. The batch
# goes over every batch-parallel axis (data and FSDP shard the same sequences); heads, MLP hidden
# units and vocabulary logits over the tensor axis; the residual stream (embed) and the sequence
# (length) stay whole, so a block's matmuls never compute partial sums for the global batch.
ACTIVATION_RULES = {
    "batch": (DATA_AXIS, "fsdp"),
    "length": (),
    "embed": (),
    "heads": ("tensor",),
    "kv": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}


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

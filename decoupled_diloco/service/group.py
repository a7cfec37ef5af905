"""A learner group spanning several JAX processes: process 0 talks to the syncer for all of them.

On a multi-host slice every host runs the same learner program (one multi-controller JAX
program over the slice's mesh). Each host feeds the same batches and runs the same jitted
steps, so all of them must make the same decisions: how many steps to take, which Θ to
start from, when the run is over. Only process 0 holds a syncer connection; what it hears
(replies, status, a new Θ) reaches the other processes through the group's own collectives
(ICI/DCN on TPU, gloo on CPU) as one wire payload, and every process gathers θ off the
mesh to form the same pseudo-gradient. Nothing that crosses the WAN is sent twice.

  experiments.train --role=learner --learner_id=0 --group_coordinator=HOST:PORT \
      --group_processes=2 --group_process_id=K ...          (CPU, or any explicit setup)
  experiments.train --role=learner --learner_id=0 --group_coordinator=auto ...   (Cloud TPU)

A group is the unit of failure: if one of its processes dies the others cannot step
(their collectives have no partner), so launchers kill and restart the whole group, which
then rejoins like any restarted learner.
"""

import jax
from jax.experimental import multihost_utils
import numpy as np

from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import wire

AUTO = "auto"


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
  """Joins this process to its learner group's JAX runtime ('' = a one-process group).

  Must run before any JAX computation. 'auto' lets JAX discover the slice (Cloud TPU);
  otherwise the coordinator is process 0's HOST:PORT and CPU collectives go over gloo.
  """
  if not coordinator:
    if num_processes != 1:
      raise ConfigError(f"--group_processes={num_processes} needs --group_coordinator=HOST:PORT (or 'auto')")
    return
  if coordinator == AUTO:
    jax.distributed.initialize()
    return
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ConfigError(f"--group_process_id={process_id} is not in [0, {num_processes}): number the processes "
                      "of a group 0..group_processes-1")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes, process_id)


def local_device_count(group_devices: int, num_processes: int) -> int:
  """Devices each process of a group of `group_devices` contributes (they must split evenly)."""
  if num_processes < 1 or group_devices % num_processes:
    raise ConfigError(f"a learner group of {group_devices} devices cannot be split over {num_processes} "
                      "processes: use a process count that divides it")
  return group_devices // num_processes


class GroupLink:
  """What only process 0 hears from the syncer, made known to every process of the group."""

  def __init__(self):
    self.leader = jax.process_index() == 0
    self.processes = jax.process_count()

  def share(self, message):
    """`message` (leader's: dicts, lists, scalars, None and arrays) as seen by every process.

    Followers pass anything (it is ignored) and get the leader's value back; every process
    of the group must call this at the same point of its loop.
    """
    if self.processes == 1:
      return message
    data = b"".join(wire.encode(message)) if self.leader else b""
    # The length as 8 raw bytes: Θ of a 1B model is over 2**31 bytes, and int64 would
    # become int32 on the way unless JAX runs with 64-bit types.
    length_bytes = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
    length = int.from_bytes(np.asarray(multihost_utils.broadcast_one_to_all(length_bytes, is_source=self.leader),
                                       np.uint8).tobytes(), "little")
    buffer = np.frombuffer(data, np.uint8) if self.leader else np.zeros(length, np.uint8)
    received = multihost_utils.broadcast_one_to_all(buffer, is_source=self.leader)
    return message if self.leader else wire.decode(np.asarray(received, np.uint8).tobytes())

  def host_copy(self, tree):
    """Every leaf of a (possibly multi-host) tree as a full numpy array, on every process."""
    if self.processes == 1:
      return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)

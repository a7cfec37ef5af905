"""A learner group spanning several JAX processes: process 0 talks to the syncer for all of them.

On a multi-host slice every host runs the same multi-controller program, so all must make
the same decisions (how many steps, which Θ, when the run is over): only process 0 holds a
syncer connection, and what it hears reaches the others through the group's own
collectives (ICI/DCN on TPU, gloo on CPU), so nothing that crosses the WAN is sent twice.
The exchange moves one leaf per collective (`share_tree`, `gather_to_leader`), so no host or
device holds more than the largest leaf beyond what it keeps (docs/exchange.md, with the
`group_peak_bytes` / `group_host_bytes` figures). A group is the unit of failure: if one
process dies the others cannot step, so launchers restart the whole group, which rejoins
like any restarted learner.
"""

import contextlib
import threading
import tracemalloc

import jax
from jax.experimental import multihost_utils
import numpy as np

from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import wire

AUTO = "auto"
TRACED_EXCHANGES = 4  # A run's first exchanges (pushes and pulls) measure their host bytes (`group_host_bytes`).


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
    self.peak_bytes = 0  # Largest buffer one exchange collective placed on a host (and on each device) at once.
    self.host_peak_bytes = 0  # Most numpy bytes an exchange of this process held at once (`_sample_host`).
    self._tracing, self._lock = 0, threading.Lock()  # Exchanges under way (a push's and a pull's may overlap).
    self._traces_left = TRACED_EXCHANGES

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
    length = int.from_bytes(
        np.asarray(multihost_utils.broadcast_one_to_all(length_bytes, is_source=self.leader), np.uint8).tobytes(),
        "little")
    buffer = np.frombuffer(data, np.uint8) if self.leader else np.zeros(length, np.uint8)
    received = multihost_utils.broadcast_one_to_all(buffer, is_source=self.leader)
    return message if self.leader else wire.decode(np.asarray(received, np.uint8).tobytes())

  def _note(self, nbytes: int) -> None:
    self.peak_bytes = max(self.peak_bytes, nbytes)

  @contextlib.contextmanager
  def _tracing_host(self):
    """Traces the numpy buffers this process allocates during an exchange, for `_sample_host`: the host bound
    the leaf-by-leaf exchange exists for, checked by the 2-process group test. Only a run's first exchanges are
    traced: tracemalloc slows every allocation of the process while it runs."""
    with self._lock:
      traced = bool(self._tracing or self._traces_left)
      if traced:
        self._tracing += 1
        if self._tracing == 1:
          self._traces_left -= 1
          tracemalloc.start()
    try:
      yield
    finally:
      if traced:
        with self._lock:
          self._tracing -= 1
          if not self._tracing:
            tracemalloc.stop()

  def _sample_host(self) -> None:
    """Notes the numpy bytes allocated since the exchange began and alive now, as a leaf's collective returned."""
    if not tracemalloc.is_tracing():
      return
    traces = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    self.host_peak_bytes = max(self.host_peak_bytes, sum(trace.size for trace in traces.traces))

  def host_peaks(self) -> list[int]:
    """Every process's `host_peak_bytes`, in process order (a collective: every process calls it at its end)."""
    if self.processes == 1:
      return [self.host_peak_bytes]
    mine = np.frombuffer(self.host_peak_bytes.to_bytes(8, "little"), np.uint8)  # 8 raw bytes: see `share`.
    every = np.asarray(multihost_utils.process_allgather(mine), np.uint8).reshape(self.processes, 8)
    return [int.from_bytes(row.tobytes(), "little") for row in every]

  def share_tree(self, tree, like):
    """The leader's host `tree` (Θ_p) placed on the group's devices, one leaf per collective.

    Every process gets the same tree of arrays, each leaf placed as its counterpart in `like`
    (the group's arrays of those leaves: shape, dtype, sharding) with the host copy dropped
    before the next leaf comes. Every process must call this at the same point.
    """
    if self.processes == 1:
      return tree
    leaves = jax.tree.leaves(tree) if self.leader else [None] * len(jax.tree.leaves(like))
    placed = []
    with self._tracing_host():
      for leaf, counterpart in zip(leaves, jax.tree.leaves(like)):
        data = np.asarray(leaf) if self.leader else np.zeros(counterpart.shape, counterpart.dtype)
        self._note(data.nbytes)
        received = multihost_utils.broadcast_one_to_all(data, is_source=self.leader)
        self._sample_host()
        placed.append(jax.device_put(np.asarray(received), counterpart.sharding))
        del data, received  # Before the next leaf comes.
    return jax.tree.unflatten(jax.tree.structure(like), placed)

  def gather_to_leader(self, tree):
    """Every leaf of a (possibly multi-host) tree as a full numpy array on the leader, one leaf per
    collective; the others get zero-stride placeholders of the leaves' shapes (no memory)."""
    if self.processes == 1:
      return jax.device_get(tree)

    def gathered(leaf):
      full = multihost_utils.process_allgather(leaf, tiled=True)
      self._note(full.nbytes)
      self._sample_host()
      return full if self.leader else placeholder(leaf)

    with self._tracing_host():
      return jax.tree.map(gathered, tree)


def placeholder(leaf):
  """An array of `leaf`'s shape and dtype that takes no memory (every entry is one zero)."""
  return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)

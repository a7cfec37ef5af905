"""A syncer shard's process: its own workdir, ports and local disk, and the run's end agreed through shard 0.

With `service.shards = S` > 1 each shard is a syncer process of its own (`--role=syncer
--shard=s`) over the fragments it owns (`shards.ShardMap`): its write-ahead log,
checkpoints, versions, incarnations, metrics and address live in <workdir>/shards/<s>/
(and <local_dir>/shards/<s>/), and it listens on service.port + s (data_port + s) when those
are fixed. Merges need no coordination; the run's budget does: learners count their steps
only in pushes to shard 0 (which owns fragment 0), so shard 0 alone decides that the run is
done. It publishes that, and later that every learner heard it, in <workdir>/shards/run_state;
the other shards follow: done (flush their open pushes, checkpoint) once shard 0 is, and stop
once shard 0 has told every learner (docs/syncer-shards.md).
"""

import copy
import json
import os

from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError

RUN_STATE = "run_state"


def shard_workdir(workdir: str, shard: int) -> str:
  """Where shard `shard` keeps its state: the workdir itself for a run of one syncer."""
  return os.path.join(workdir, "shards", str(shard))


def for_shard(config, workdir: str, shard: int | None):
  """(config, workdir) of shard `shard`'s process: its own folders and ports; unchanged for one syncer."""
  num_shards = config.service.shards
  if num_shards == 1 and not shard:
    return config, workdir
  if shard is None or not 0 <= shard < num_shards:
    raise ConfigError(f"--shard={shard} is not in [0, {num_shards}): with service.shards={num_shards} start one "
                      "syncer per shard, --role=syncer --shard=S")
  config = copy.deepcopy(config)
  service = config.service
  service.port += shard if service.port else 0
  service.data_port += shard if service.data_port > 0 else 0
  if service.local_dir:
    service.local_dir = shard_workdir(service.local_dir, shard)
  return config, shard_workdir(workdir, shard)


class RunState:
  """The run's end as shard 0 sees it, shared with the other shards through one small file.

  Shard 0 `publish`es; others `follow`, reading the file at most every `read_every_seconds`:
  they check at every tick (0.1 s), and on a gs:// workdir each read is a GCS request, while
  the end may be seen a second or two late. With one syncer it holds no file and the syncer
  stops when its own learners all heard the end, as it always did.
  """

  def __init__(self, workdir: str, shard: int | None, num_shards: int, read_every_seconds: float = 2.0):
    self.shard, self.sharded = shard or 0, num_shards > 1
    self.path = os.path.join(os.path.dirname(workdir), RUN_STATE) if self.sharded else None
    self.read_every_seconds = read_every_seconds
    self._published = None
    self._read_at, self._state = None, {"done": False, "all_told": False}

  def _read(self, now: float) -> dict:
    if self._read_at is None or now - self._read_at >= self.read_every_seconds:
      path = storage.path(self.path)
      if path.exists():
        self._state = json.loads(path.read_text())
      self._read_at = now
    return self._state

  def sync(self, core, now: float) -> None:
    """Shard 0 writes its done / all-told state when it changes; the others finish once shard 0 is done."""
    if not self.sharded:
      return
    if self.shard == 0:
      # Ticks and gRPC threads (`may_stop`, under the core's lock) publish: under that same lock, so that no
      # thread holds a lock of this object while it waits for the core's (the order that deadlocked).
      with core.lock:
        state = {"done": core.done, "all_told": core.all_told_done()}
        if state != self._published:
          storage.replace_text(self.path, json.dumps(state))
          self._published = state
    elif self._read(now)["done"]:
      core.end(now)

  def may_stop(self, core, now: float) -> bool:
    """Whether this syncer is done serving: every learner heard the end (from shard 0, for a shard).

    Shard 0 answers what it has published: the last learner may hear the end between a tick's
    `sync` and this call, and the other shards (and their evaluators' final reads) stop only on
    the record, so shard 0 must never stop on a state it has not written.
    """
    if not self.sharded:
      return core.all_told_done()
    if self.shard == 0:
      self.sync(core, now)
      return self._published["all_told"]
    return core.done and self._read(now)["all_told"]

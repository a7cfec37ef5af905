"""The run's end shared between syncer shards: shard 0 writes it, the others read it at most every few seconds."""

import dataclasses
import os
import threading
import time

from decoupled_diloco.service import shardrun


@dataclasses.dataclass
class _Core:
  """What RunState reads of a syncer core: whether the run is done, whether every learner heard it."""
  done: bool = False
  told: bool = False
  ended_at: float | None = None
  lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)  # SyncerCore's: guards its state.

  def all_told_done(self) -> bool:
    with self.lock:
      return self.told

  def end(self, now: float) -> None:
    self.done, self.ended_at = True, now


def test_other_shards_follow_shard_0_reading_its_file_at_most_every_read_interval(tmp_path):
  workdirs = [shardrun.shard_workdir(str(tmp_path), s) for s in range(2)]
  for workdir in workdirs:
    os.makedirs(workdir)
  leader, follower = _Core(), _Core()
  published = shardrun.RunState(workdirs[0], 0, 2)
  following = shardrun.RunState(workdirs[1], 1, 2, read_every_seconds=2.0)
  published.sync(leader, 0.0)
  following.sync(follower, 0.0)  # Reads: not done.
  leader.done = True
  published.sync(leader, 0.1)
  for now in (0.1, 1.0, 1.9):  # Ticks inside the interval do not read the file again.
    following.sync(follower, now)
  assert not follower.done
  following.sync(follower, 2.0)
  assert follower.ended_at == 2.0
  leader.told = True
  published.sync(leader, 2.1)
  assert published.may_stop(leader, 2.1)
  assert not following.may_stop(follower, 2.1)  # Read at 2.0: not all told yet.
  assert following.may_stop(follower, 4.0)


def test_one_syncer_keeps_no_file_and_stops_on_its_own_learners(tmp_path):
  state, core = shardrun.RunState(str(tmp_path), None, 1), _Core(done=True)
  state.sync(core, 0.0)
  assert not (tmp_path / shardrun.RUN_STATE).exists() and not (tmp_path.parent / shardrun.RUN_STATE).exists()
  assert not state.may_stop(core, 0.0)
  core.told = True
  assert state.may_stop(core, 0.0)


def test_shard_0_stops_only_on_a_state_it_has_published(tmp_path):
  """The last learner can hear the end between shard 0's tick `sync` and its `may_stop` (a CI flake: shard 0
  stopped with all_told=false on record, so shard 1 and its evaluator waited out the linger)."""
  workdirs = [shardrun.shard_workdir(str(tmp_path), s) for s in range(2)]
  for workdir in workdirs:
    os.makedirs(workdir)
  leader, follower = _Core(done=True), _Core(done=True)
  published = shardrun.RunState(workdirs[0], 0, 2)
  following = shardrun.RunState(workdirs[1], 1, 2, read_every_seconds=0.0)
  published.sync(leader, 0.0)  # The tick: done, not every learner told.
  leader.told = True  # The last learner hears the end now.
  assert published.may_stop(leader, 0.1)
  assert following.may_stop(follower, 0.2)


def test_a_tick_and_a_call_that_holds_the_cores_lock_never_deadlock_on_publishing(tmp_path):
  """A CI hang: an evaluator's status call holds the core's lock and asks `may_stop`, which publishes, while
  the tick publishes and waits for the core's lock; with a lock of its own RunState took them in both orders."""
  os.makedirs(shardrun.shard_workdir(str(tmp_path), 0))
  core, published = _Core(done=True), shardrun.RunState(shardrun.shard_workdir(str(tmp_path), 0), 0, 2)
  holding, answered = threading.Event(), threading.Event()

  def status_call():  # Reader.status: the core's lock, then `is_final` (may_stop).
    with core.lock:
      holding.set()
      time.sleep(0.3)  # The tick starts publishing meanwhile and waits for the core's lock.
      published.may_stop(core, 0.1)
    answered.set()

  call = threading.Thread(target=status_call, daemon=True)
  call.start()
  holding.wait()
  tick = threading.Thread(target=published.sync, args=(core, 0.0), daemon=True)
  tick.start()
  assert answered.wait(10.0), "the status call and the tick deadlocked"
  tick.join(10.0)
  assert not tick.is_alive()

"""The syncer's durability under real faults (docs/service-durability.md).

Faults are real: a tiny tmpfs (ENOSPC) for the log and the checkpoints, bits flipped in log
segments and checkpoint files, crashes (SIGKILL of processes, or a core dropped without its
shutdown), a second syncer process on a held workdir, a stale learner incarnation, a push that
claims 2**62 tokens, and (slow) the chaos benchmark killing learners and the syncer.
"""

import json
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from decoupled_diloco import checkpoint as checkpoint_lib, outer
from decoupled_diloco import metrics as metrics_lib, model as model_lib, workdir_lock
from decoupled_diloco.data import sources
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import records as run_records
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import durable, syncer_main, wal
from decoupled_diloco.syncer import Settings, Syncer
from experiments.launch_local import LocalCluster
from tests import service_config
from tests.test_service_units import _core, _leaves_equal, _push, params  # pylint: disable=unused-import


@pytest.fixture
def tiny_disk(tmp_path):
  """A 2 MiB tmpfs (a real filesystem that fills up); skipped where mounting is not allowed."""
  mount = tmp_path / "disk"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
    pytest.skip("mounting a tmpfs needs root")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(directory, leave_bytes):
  """Fills the filesystem of `directory` up to `leave_bytes` free; returns the filler's path."""
  filler = os.path.join(directory, "filler")
  stat = os.statvfs(directory)
  with open(filler, "wb") as f:
    f.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave_bytes))
  return filler


def _segment_bytes(directory):
  return {s: os.path.getsize(wal.segment_path(str(directory / "wal"), s)) for s in wal.segments(str(directory / "wal"))}


def test_a_full_disk_stops_the_syncer_without_applying_or_losing_anything(params, tiny_disk):
  core = _core(params, tiny_disk, quorum=2)
  assert _push(core, params, 0, 0)["status"] == "applied"
  assert _push(core, params, 1, 0)["status"] == "applied"  # Merge: version 1.
  before, logged = jax.device_get(core.syncer.params), _segment_bytes(tiny_disk)
  filler = _fill(str(tiny_disk), 16 << 10)  # Less room than one push (~100 KB).
  with pytest.raises(core_lib.Stopped, match="No space left"):
    _push(core, params, 0, 1)
  # Not applied (validate → log → apply), the torn record rolled back, and nothing more is served.
  assert core.syncer.version == 1 and core.acked == {0: 0, 1: 0} and not core.syncer.pending
  assert _leaves_equal(before, core.syncer.params) and _segment_bytes(tiny_disk) == logged
  for call in (lambda: core.heartbeat(1, time.time()), lambda: core.tick(time.time()),
               lambda: _push(core, params, 1, 1)):
    with pytest.raises(core_lib.Stopped):
      call()
  core.store.log.close()
  core.store.checkpointer.close()
  os.remove(filler)
  again = _core(params, tiny_disk, quorum=2)  # The operator freed the disk and restarted the syncer.
  assert (again.syncer.version, again.acked) == (1, {0: 0, 1: 0})
  assert _leaves_equal(before, again.syncer.params)
  assert _push(again, params, 0, 1)["status"] == "applied"  # The learner's retry of the refused push.
  again.close()


def _log_of_four(directory):
  log = wal.Log(str(directory), 0)
  for n in range(4):
    log.append({"n": n}, bytes([n]) * 100)
  log.close()
  return wal.segment_path(str(directory), 0)


def _offsets(path):
  """Start offset of each record."""
  return [0] + [end for end, _, _, _ in wal._scan(wal._map(path), path)][:-1]  # pylint: disable=protected-access


def test_an_incomplete_last_record_is_a_torn_tail_and_recovered(tmp_path):
  path = _log_of_four(tmp_path)
  last = _offsets(path)[-1]
  os.truncate(path, last + 50)  # A crash mid-append: frame whole, body cut.
  log = wal.Log(str(tmp_path), 0)
  log.append({"n": 9})
  log.close()
  assert [r["n"] for r, _ in wal.read_segment(path)] == [0, 1, 2, 9]


@pytest.mark.parametrize("where", ["frame", "body", "last_body"])
def test_a_corrupt_record_stops_start_up_unless_the_operator_truncates(tmp_path, where):
  path = _log_of_four(tmp_path)
  offsets = _offsets(path)
  flip = {"frame": offsets[1] + 9, "body": offsets[1] + 40, "last_body": offsets[3] + 40}[where]
  with open(path, "r+b") as f:
    f.seek(flip)
    byte = f.read(1)
    f.seek(flip)
    f.write(bytes([byte[0] ^ 0x10]))  # One flipped bit.
  bad = offsets[3] if where == "last_body" else offsets[1]
  size = os.path.getsize(path)
  name = os.path.basename(path)
  with pytest.raises(wal.CorruptLog, match=rf"{name}: record.* at offset {bad}.*truncate_corrupt_log"):
    wal.Log(str(tmp_path), 0)
  with pytest.raises(wal.CorruptLog):
    wal.read_segment(path)
  assert os.path.getsize(path) == size  # Nothing was cut.
  wal.recover(str(tmp_path), truncate_corrupt=True)
  assert [r["n"] for r, _ in wal.read_segment(path)] == list(range(bad // offsets[1]))


def test_a_corrupt_log_stops_the_syncer_from_restoring(params, tmp_path):
  core = _core(params, tmp_path, quorum=2, every=100)
  for seq in range(3):
    _push(core, params, 0, seq)
    _push(core, params, 1, seq)
  core.store.log.close()
  core.store.checkpointer.close()
  path = wal.segment_path(str(tmp_path / "wal"), 0)
  with open(path, "r+b") as f:
    f.seek(200)
    f.write(b"\xff")
  with pytest.raises(wal.CorruptLog, match="offset 0"):
    _core(params, tmp_path)


def test_the_eval_schedule_skips_any_number_of_intervals_at_once(tmp_path):
  config = service_config.get_config()
  model, params, _ = model_lib.build_model(config.model, config.seed)
  corpus = sources.load_corpus(config.data, config.model.seq_len)
  with metrics_lib.MetricsWriter(str(tmp_path)) as writer:
    recorder = run_records.Recorder(writer)
    evaluator = syncer_main.build_evaluator(config, model, corpus, recorder)
    core = syncer_main.build_core(config, params, str(tmp_path), recorder, evaluator)
    core.start(time.time())
    core.tokens_done = 2**62  # As after a push claiming 2**62 tokens (bounding them is the header checks' job).
    done = threading.Event()
    threading.Thread(target=lambda: (core.on_merge(1, params, time.time()), done.set()), daemon=True).start()
    assert done.wait(10), "on_merge spins one eval interval at a time"
    evaluator.close()
    core.close()
  assert [r["tokens"] for r in metrics_lib.read_metrics(writer.path) if r["kind"] == "eval"] == [2**62]


def test_a_restart_builds_theta_as_zeros_of_its_shapes_and_a_fresh_start_from_the_seed(tmp_path):
  # Why it matters: initialising the params is most of a restarted syncer's start-up, and the
  # checkpoint replaces them anyway; a fresh run (or a resume with nothing saved yet) needs the seed's.
  config = service_config.get_config()
  seeded = model_lib.build_model(config.model, config.seed)[1]
  checkpoints = str(tmp_path / "checkpoints")
  assert syncer_main.latest_checkpoint(checkpoints) is None
  config.resume = True
  _, fresh = syncer_main.initial_params(config, checkpoints)  # Nothing saved: the seed's params.
  jax.tree.map(np.testing.assert_array_equal, fresh, seeded)
  _core(seeded, tmp_path).close()  # A fresh start saves checkpoint 0.
  assert syncer_main.latest_checkpoint(checkpoints) == 0
  _, shapes = syncer_main.initial_params(config, checkpoints)
  assert jax.tree.structure(shapes) == jax.tree.structure(seeded)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, np.zeros_like(y)), shapes, seeded)
  restored = _core(shapes, tmp_path)  # The restart: the checkpoint replaces the zeros.
  jax.tree.map(np.testing.assert_array_equal, restored.syncer.params, seeded)
  restored.close()
  config.resume = False
  jax.tree.map(np.testing.assert_array_equal, syncer_main.initial_params(config, checkpoints)[1], seeded)


def _snapshot(directory):
  """Every file under `directory` (launcher logs aside) with its size and modification time; a TensorBoard event
  file with its name only: the running syncer's writer flushes it every 30 s on its own (a new one would show)."""
  return {
      os.path.join(root, name):
          (None, None) if name.startswith("events.out.tfevents") else
          (os.stat(os.path.join(root, name)).st_size, os.stat(os.path.join(root, name)).st_mtime_ns)
      for root, _, names in os.walk(directory) if "logs" not in root for name in names}


def _refused(cluster, *args) -> str:
  """Starts a syncer that must be refused: exit 2 and one `error:` line, returned."""
  command = cluster._command("--role=syncer", "--config.resume=True", *args)  # pylint: disable=protected-access
  process = subprocess.run(command, capture_output=True, text=True, env=cluster.env, timeout=300)
  errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
  assert process.returncode == 2 and len(errors) == 1, process.stderr[-2000:]
  assert "Traceback" not in process.stderr
  return errors[0]


def test_a_held_workdir_and_a_changed_model_are_refused_in_one_line(tmp_path):
  cluster = LocalCluster("tests/service_config.py", str(tmp_path / "run"), [], 2,
                         env=dict(os.environ, DD_SYNCER_TOKEN="s" * 32))
  try:
    cluster.start_syncer(wait=True)
    before = _snapshot(cluster.workdir)
    assert f"syncer pid {cluster.processes['syncer'].pid} on host" in _refused(cluster)
    assert _snapshot(cluster.workdir) == before  # Nothing written: the log and checkpoints are the first one's.
    cluster.kill("syncer")  # SIGKILL: the kernel releases its lock.
    error = _refused(cluster, "--config.model.d_model=64")
    assert "model.d_model is 64" in error and "checkpointed with 32" in error
    before = _snapshot(cluster.workdir)  # Before: another shard count started version 0 beside the run.
    error = _refused(cluster, "--config.service.shards=2", "--shard=0", "--config.streaming.num_fragments=2",
                     "--config.streaming.strategy=balanced", "--config.service.evaluate_on=none")
    assert "service.shards is 2" in error and "checkpointed with 1" in error and _snapshot(cluster.workdir) == before
  finally:
    cluster.stop()


def test_a_held_learner_folder_refuses_a_replacement_and_is_free_once_released(tmp_path):
  first = workdir_lock.DirectoryLock(str(tmp_path), "learner.0.lock", "learner 1")
  with pytest.raises(ConfigError, match=rf"in use by learner 1 pid {os.getpid()} on host"):
    workdir_lock.DirectoryLock(str(tmp_path), "learner.0.lock", "learner 1")
  first.release()
  workdir_lock.DirectoryLock(str(tmp_path), "learner.0.lock", "learner 1").release()


def _checkpointed_core(params, directory):
  """A core with checkpoints at versions 1 and 2 and one more merge (3) plus a pending push in the log."""
  core = _core(params, directory, quorum=2, every=1)
  for seq in range(3):
    _push(core, params, 0, seq)
    _push(core, params, 1, seq, value=0.02)
    if seq < 2:
      core.tick(time.time())
  _push(core, params, 0, 3)
  assert core.store.checkpointer.all_steps() == [1, 2] and core.syncer.version == 3
  return core


def _flip_params(directory, step):
  """Flips 64 bytes in the middle of the largest file holding checkpoint `step`'s params."""
  files = [
      os.path.join(root, name) for root, _, names in os.walk(directory / "checkpoints" / str(step) / "params")
      for name in names]
  target = max(files, key=os.path.getsize)
  with open(target, "r+b") as f:
    f.seek(os.path.getsize(target) // 2)
    data = f.read(64)
    f.seek(os.path.getsize(target) // 2)
    f.write(bytes(b ^ 0xFF for b in data))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_plus_the_log(params, tmp_path):
  core = _checkpointed_core(params, tmp_path)
  before, acked, steps = jax.device_get(core.syncer.params), dict(core.acked), core.steps_done
  core.store.log.close()  # SIGKILL.
  core.store.checkpointer.close()
  _flip_params(tmp_path, 2)
  again = _core(params, tmp_path, quorum=2, every=1)
  assert (again.syncer.version, again.acked, again.steps_done) == (3, acked, steps)
  assert _leaves_equal(before, again.syncer.params) and len(again.syncer.pending) == 1
  assert again.store.checkpointer.all_steps() == [1] and os.path.isdir(tmp_path / "checkpoints" / "2.corrupt")
  again.close()


def test_no_usable_checkpoint_refuses_to_start_naming_each(params, tmp_path):
  core = _checkpointed_core(params, tmp_path)
  core.close()
  _flip_params(tmp_path, 1)
  _flip_params(tmp_path, 2)
  with pytest.raises(checkpoint_lib.CorruptCheckpoint, match=r"no usable syncer checkpoint \(step 2: .*step 1: "):
    _core(params, tmp_path)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]  # Nothing moved when nothing is usable.


def test_a_crash_between_log_rotation_and_checkpoint_save_loses_nothing(params, tmp_path):
  core = _core(params, tmp_path, quorum=2, every=1)
  _push(core, params, 0, 0)
  _push(core, params, 1, 0)  # Merge: version 1, checkpoint due.
  _push(core, params, 0, 1)  # Pending: carried into the new segment.
  carried = [(dict(r, carried=True), p) for _, r, p in core._unabsorbed]  # pylint: disable=protected-access
  core.store.log.rotate(1, carried)
  _push(core, params, 1, 1)  # Merge: version 2, logged in segment 1; then SIGKILL before checkpoint 1 is saved.
  before, acked = jax.device_get(core.syncer.params), dict(core.acked)
  core.store.log.close()
  core.store.checkpointer.close()
  again = _core(params, tmp_path, quorum=2, every=1)
  assert (again.syncer.version, again.acked) == (2, acked) and _leaves_equal(before, again.syncer.params)
  again.close()


def test_a_full_checkpoint_disk_keeps_the_syncer_serving_and_retries(params, tiny_disk):
  core = _core(params, tiny_disk, quorum=2, every=1)
  _push(core, params, 0, 0)
  _push(core, params, 1, 0)  # Version 1: a checkpoint is due.
  filler = _fill(str(tiny_disk), 150 << 10)  # Room for log records, not for a checkpoint.
  failed_at = time.time()  # The ticks' clock: the retry is due by it, not by how long the saves took.
  core.tick(failed_at)
  assert core.store.checkpointer.all_steps() == [0]  # The save failed...
  assert _push(core, params, 0, 1)["status"] == "applied"  # ...and the syncer serves on from its log.
  os.remove(filler)
  core.tick(failed_at + 1.0)
  assert core.store.checkpointer.all_steps() == [0]  # Not retried at once...
  core.tick(failed_at + durable.CHECKPOINT_RETRY_SECONDS)
  assert core.store.checkpointer.all_steps() == [0, 1]  # ...but once the retry is due.
  before, acked = jax.device_get(core.syncer.params), dict(core.acked)
  core.store.log.close()
  core.store.checkpointer.close()
  again = _core(params, tiny_disk, quorum=2, every=1)
  assert (again.syncer.version, again.acked, len(again.syncer.pending)) == (1, acked, 1)
  assert _leaves_equal(before, again.syncer.params)
  again.close()


def test_push_counters_and_refused_calls_survive_a_restart(params, tmp_path):
  core = _core(params, tmp_path, quorum=2, every=1)
  _push(core, params, 0, 0)
  _push(core, params, 1, 0)  # Merge: version 1.
  _push(core, params, 1, 0)  # Duplicate.
  with pytest.raises(core_lib.PushRejected):
    _push(core, params, 0, 1, value=float("nan"))
  core.refused["unauthenticated"] += 2  # As the server counts refused calls.
  _push(core, params, 0, 1)  # Pending: carried into the checkpoint's log segment...
  core.tick(time.time())  # ...checkpoint 1...
  _push(core, params, 0, 2, base=0)  # ...and one after it, in the log only.
  counts = dict(core.counts)
  assert counts["applied"] == 4 and counts["duplicates"] == 1 and counts["rejected"] == 1
  core.store.log.close()  # SIGKILL.
  core.store.checkpointer.close()
  again = _core(params, tmp_path, quorum=2, every=1)
  assert again.counts == counts and again.refused == {"unauthenticated": 2}
  again.close()


@pytest.mark.slow
def test_clip_norms_survive_a_restart_and_an_oversized_push_is_refused_and_counted(params, tmp_path):
  norm = 0.01 * np.sqrt(sum(x.size for x in jax.tree.leaves(params)))  # ‖_delta(params)‖.
  emitted = []

  def build():
    settings = Settings(quorum=2, merge_rule="clip", max_push_norm=float(5 * norm))
    syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), settings)
    core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(tmp_path), checkpoint_every_merges=1,
                               lease_seconds=30.0, metadata={}, emit=emitted.append)
    core.start(time.time())
    return core

  core = build()
  _push(core, params, 0, 0)
  _push(core, params, 1, 0)  # Merge: version 1.
  _push(core, params, 0, 1, value=0.04)  # 4x: over 2x the median of (1, 1, 4)·‖Δ‖: clipped by 1/2.
  with pytest.raises(core_lib.PushRejected, match="exceeds syncer.max_push_norm"):
    _push(core, params, 1, 1, value=0.1)  # 10x: over the bound, refused before the log.
  _push(core, params, 1, 1)  # Merge: version 2.
  _push(core, params, 0, 2)  # Pending: carried into the checkpoint's log segment...
  core.tick(time.time())  # ...checkpoint 2.
  pushes = [r for r in emitted if r["kind"] == "push"]
  assert [r["clipped"] for r in pushes] == [0, 0, 1, 0, 0] and core.counts["rejected"] == 1
  assert pushes[2]["clip_factor"] == pytest.approx(0.5, rel=1e-4)
  norms = core.syncer.recent_norms
  core.store.log.close()  # SIGKILL.
  core.store.checkpointer.close()
  again = build()
  assert again.syncer.recent_norms == norms and again.counts["rejected"] == 1
  again.close()


def test_a_stale_learner_incarnation_is_refused_once_a_newer_one_joined_and_after_a_restart(params, tmp_path):
  core = _core(params, tmp_path, quorum=2, every=1)
  first, _ = core.join(0, time.time())
  assert first["incarnation"] == 1
  assert _push(core, params, 0, 0, incarnation=1)["status"] == "applied"
  second, _ = core.join(0, time.time())  # A replacement process of learner 0 (its predecessor is frozen).
  assert second["incarnation"] == 2 and second["acked_seq"] == 0
  with pytest.raises(core_lib.PushRejected, match="incarnation 1, but incarnation 2 of learner 0 has joined"):
    _push(core, params, 0, 1, incarnation=1)  # The predecessor wakes up.
  assert core.acked[0] == 0 and core.counts["rejected"] == 1
  assert _push(core, params, 0, 1, incarnation=2)["status"] == "applied"
  core.store.log.close()  # SIGKILL: the incarnation is in the log.
  core.store.checkpointer.close()
  again = _core(params, tmp_path, quorum=2, every=1)
  with pytest.raises(core_lib.PushRejected, match="incarnation 1"):
    _push(again, params, 0, 2, incarnation=1)
  assert _push(again, params, 1, 0)["status"] == "applied"  # A merge...
  again.tick(time.time())  # ...and a checkpoint, whose log segment no longer holds the join.
  assert again.store.checkpointer.latest_step() == 1
  again.close()
  third = _core(params, tmp_path, quorum=2, every=1)
  assert third.status(0, tells_done=False)["incarnation"] == 2
  third.close()


@pytest.mark.slow
def test_the_chaos_benchmark_loses_nothing_when_learners_and_the_syncer_are_killed(tmp_path):
  # Kills at seeded syncer versions within the undisturbed run's first 60%, each once the previous victim is back:
  # both kills happen however loaded the host is.
  process = subprocess.run([
      sys.executable, "-m", "experiments.benchmarks.chaos", "--size=tiny", "--seeds=1", "--plan=syncer,learner",
      f"--workdir={tmp_path}"], capture_output=True, text=True, timeout=900,
                           env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert process.returncode == 0, process.stderr[-3000:]
  figures = json.loads(process.stdout.strip().splitlines()[-1])
  assert figures["kills"] == {"learner": 1, "syncer": 1}, figures  # The plan's, on any host.
  assert figures["acked_lost"] == 0 and figures["applied_twice"] == 0, figures
  assert 0 < figures["syncer_recovery_seconds"]["max"] < 300, figures
  # A learner restarted near the budget's end may find the run over: then it has no rejoin time.
  assert set(figures) == {
      "kills", "acked_lost", "applied_twice", "loss_ratio", "undisturbed_spread", "rejoin_seconds",
      "syncer_recovery_seconds"}, figures  # Exactly issue 13's keys.
  rejoin = figures["rejoin_seconds"]
  assert rejoin.get("max", 1) > 0 and rejoin["startup"].get("max", 1) > 0 and rejoin["rest"].get("p50", 0) >= 0, figures

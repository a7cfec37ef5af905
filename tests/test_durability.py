"""The syncer's durability under real faults: a full disk, torn and corrupt log records, an eval schedule
that a huge push cannot stall. Faults are real: a tiny tmpfs (ENOSPC), bytes flipped on disk."""

import os
import subprocess
import threading
import time

import jax
import pytest

from decoupled_diloco import metrics as metrics_lib, model as model_lib, workdir_lock
from decoupled_diloco.data import sources
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import syncer_main, wal
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
  core.log.close()
  core.checkpointer.close()
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
  return [0] + [end for end, _, _ in wal._scan(wal._read(path), path)][:-1]  # pylint: disable=protected-access


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
  with pytest.raises(wal.CorruptLog, match=rf"{os.path.basename(path)}: record.* at offset {bad}.*truncate_corrupt_log"):
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
  core.log.close()
  core.checkpointer.close()
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
    recorder = syncer_main.Recorder(writer)
    evaluator = syncer_main.Evaluator(config, model, corpus, recorder)
    core = syncer_main.build_core(config, params, str(tmp_path), recorder, evaluator)
    core.start(time.time())
    core.tokens_done = 2**62  # As after a push claiming 2**62 tokens (bounding them is the header checks' job).
    done = threading.Event()
    threading.Thread(target=lambda: (core.on_merge(1, params, time.time()), done.set()), daemon=True).start()
    assert done.wait(10), "on_merge spins one eval interval at a time"
    evaluator.close()
    core.close()
  assert [r["tokens"] for r in metrics_lib.read_metrics(writer.path) if r["kind"] == "eval"] == [2**62]


def _snapshot(directory):
  """Every file under `directory` (launcher logs aside) with its size and modification time."""
  return {os.path.join(root, name): (os.stat(os.path.join(root, name)).st_size,
                                     os.stat(os.path.join(root, name)).st_mtime_ns)
          for root, _, names in os.walk(directory) if "logs" not in root for name in names}


def test_a_second_syncer_on_a_held_workdir_is_refused_naming_the_holder(tmp_path):
  cluster = LocalCluster("tests/service_config.py", str(tmp_path / "run"), [], 2,
                         env=dict(os.environ, DD_SYNCER_TOKEN="s" * 32))
  try:
    cluster.start_syncer(wait=True)
    before = _snapshot(cluster.workdir)
    second = subprocess.run(cluster._command("--role=syncer", "--config.resume=True"),  # pylint: disable=protected-access
                            capture_output=True, text=True, env=cluster.env, timeout=300)
    assert second.returncode == 2
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"syncer pid {cluster.processes['syncer'].pid} on host" in errors[0]
    assert _snapshot(cluster.workdir) == before  # Nothing written: the log and checkpoints are the first one's.
  finally:
    cluster.stop()


def test_a_held_learner_folder_refuses_a_replacement_and_is_free_once_released(tmp_path):
  first = workdir_lock.DirectoryLock(str(tmp_path), "learner.0.lock", "learner 1")
  with pytest.raises(ConfigError, match=rf"in use by learner 1 pid {os.getpid()} on host"):
    workdir_lock.DirectoryLock(str(tmp_path), "learner.0.lock", "learner 1")
  first.release()
  workdir_lock.DirectoryLock(str(tmp_path), "learner.0.lock", "learner 1").release()

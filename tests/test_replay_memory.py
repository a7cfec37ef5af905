"""A syncer restart and a checkpoint's log rotation never hold a logged push whole (docs/syncer-memory.md).

At 12B parameters a float32 push is 48 GB: a restart that read its log segment whole would need 48 GB per
logged push before serving, and a rotation 48 GB per carried push. Measured in a child process (its peak RSS,
VmHWM, reset before each phase) with glibc mapping large blocks as the syncer process does.
"""

import json
import pathlib
import subprocess
import sys
import zlib

import msgpack
import pytest

from decoupled_diloco.service import wal, wire

_CHILD = """
import json, sys, time
import jax.numpy as jnp, numpy as np
from ml_collections import ConfigDict
from decoupled_diloco import outer
from decoupled_diloco.service import core as core_lib, wal, wire
from decoupled_diloco.syncer import Settings, Syncer, map_large_blocks
from experiments.benchmarks import common
from experiments.benchmarks.syncer_memory import watch_replay

map_large_blocks()  # As the syncer process does: a freed block of 1 MiB or more goes back to the OS.
directory, n, pushes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shapes = {f"w{i}": (n // 10,) for i in range(10)}


def new_core():  # A learner more than pushes: nothing merges, so every push is carried at the next checkpoint.
  params = {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
  optimizer = outer.outer_optimizer(ConfigDict({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}))
  syncer = Syncer(optimizer, params, range(pushes + 1), Settings(quorum=pushes + 1))
  return core_lib.SyncerCore(syncer, pushes + 1, budget_steps=10**9, directory=directory,
                             checkpoint_every_merges=10**6, lease_seconds=1e9, metadata={})


def growth_mb(phase):
  before = common.reset_peak_kb()
  result = phase()
  return result, (common.status_kb("VmHWM") - before) / 1024


core = new_core()
core.start(time.time())
delta = {name: np.full(shape, 1e-3, np.float32) for name, shape in shapes.items()}
for learner in range(pushes):
  payload = bytearray(b"".join(wire.encode(delta)))
  header = {"learner": learner, "seq": 0, "base_version": 0, "fragment": 0, "tokens": 64, "local_steps": 4,
            "budget_steps": 4, "budget_tokens": 64, "compute_seconds": 0.1, "payload_bytes": len(payload),
            "incarnation": 0}
  assert core.push(header, payload, time.time())["status"] == "applied"
push_mb = len(payload) / 2**20
del payload
core.store.log.close()  # A crash: no checkpoint since version 0, every push in the log.
core.store.checkpointer.close()
restarted = new_core()
first_read = watch_replay(restarted.store)  # The replay's peak: from its first read of the log on.
restarted.start(time.time())
replay = (common.status_kb("VmHWM") - first_read[0][1]) / 1024
assert restarted.acked == {**{m: 0 for m in range(pushes)}, pushes: -1}, restarted.acked
path = wal.segment_path(restarted.store.wal_dir, 0)
carried = [(dict(record, carried=True), where) for record, _, where in wal.records(path, 0) if record["type"] == "push"]
locations, rotation = growth_mb(lambda: restarted.store.rotate(1, carried))
assert [bytes(p) for r, p, _ in wal.records(wal.segment_path(restarted.store.wal_dir, 1), 1)] == [
    bytes(p) for r, p, _ in wal.records(path, 0) if r["type"] == "push"] and len(locations) == pushes
print(json.dumps({"replay_mb": replay, "rotation_mb": rotation, "push_mb": push_mb}))
restarted.close()
"""


@pytest.mark.slow
def test_a_restart_and_a_log_rotation_hold_no_logged_push_whole(tmp_path):
  """4 pushes of 8M params (32 MB each) in the log. From its first read of the log on (after the checkpoint's
  restore), the replay builds the sums (one push's size) and reads one tensor (a tenth of a push) and one 4 MB
  checksum chunk at a time: bound 1.5 pushes (measured 1.1; reading the segment whole took 5.8, the 4 pushes of
  the segment and a push copied to align it). The rotation copies in the kernel: bound half a push (measured 0;
  reading each carried push back took one)."""
  result = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), "8000000", "4"],
                          cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(result.stdout.splitlines()[-1])
  assert figures["replay_mb"] < 1.5 * figures["push_mb"] and figures["rotation_mb"] < 0.5 * figures["push_mb"], figures


def test_payloads_lie_aligned_in_a_segment_and_a_log_written_before_the_padding_still_reads(tmp_path):
  """Mapped, an aligned payload's arrays reach XLA without a copy (`push.host_view`); records of the unpadded
  layout (meta right before the payload) read as before, and a rotation carries them over aligned."""
  old = [({"n": n}, bytes([n]) * (n + 1)) for n in range(3)]
  with open(wal.segment_path(str(tmp_path), 0), "wb") as f:
    for record, payload in old:
      meta = msgpack.packb(record, use_bin_type=True)
      f.write(wal._frame(meta, len(payload), zlib.crc32(payload)) + meta + payload)  # pylint: disable=protected-access
  log = wal.Log(str(tmp_path), 0)
  log.append({"n": 3}, b"new")
  read = list(wal.records(wal.segment_path(str(tmp_path), 0), 0))
  assert [(r, bytes(p)) for r, p, _ in read] == old + [({"n": 3}, b"new")] and read[-1][2].offset % 64 == 0
  log.rotate(1, [(record, where) for record, _, where in read])
  log.close()
  moved = list(wal.records(wal.segment_path(str(tmp_path), 1), 1))
  assert [(r, bytes(p)) for r, p, _ in moved] == [(r, bytes(p)) for r, p, _ in read]
  assert all(where.offset % wire.ALIGNMENT == 0 for _, _, where in moved)

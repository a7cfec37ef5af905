"""A push streamed into a spool file beside the write-ahead log (wal.Spool, docs/syncer-memory.md): logged like
any payload, gone without a trace when the syncer is SIGKILLed mid-stream, and a full disk under it is fail-stop."""

import os
import socket
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import server as server_lib
from decoupled_diloco.service import wal, wire
from tests.helpers import wait_for
from tests.test_datachannel import _client, _ticket
from tests.test_durability import _fill, _segment_bytes, tiny_disk  # pylint: disable=unused-import
from tests.test_service_units import TOKEN, _core, _delta, _header, _leaves_equal, _push, params  # pylint: disable=unused-import


def test_a_log_of_the_format_before_streamed_pushes_is_refused_naming_what_to_do(tmp_path):
  log = wal.Log(str(tmp_path), 0)
  log.append({"n": 0}, b"payload")
  log.close()
  path = wal.segment_path(str(tmp_path), 0)
  with open(path, "r+b") as f:
    f.write((0xD1C0_0001).to_bytes(4, "little"))  # Format 1's magic, as the previous version wrote it.
  with pytest.raises(wal.CorruptLog, match="older decoupled_diloco .* start a new workdir"):
    list(wal.records(path, 0))


def test_a_spooled_payload_is_logged_and_located_like_bytes(tmp_path):
  log = wal.Log(str(tmp_path), 0)
  payloads = [b"a" * 100, os.urandom(3 << 20), b"c" * 7]
  spool = wal.Spool(str(tmp_path), len(payloads[1]))
  spool.fill(lambda view: view.cast("B").__setitem__(slice(None), payloads[1][:view.nbytes]))  # One 3 MB chunk.
  locations = [log.append({"n": 0}, payloads[0]), log.append({"n": 1}, spool), log.append({"n": 2}, payloads[2])]
  log.close()
  assert [(r, bytes(p), where) for r, p, where in wal.records(wal.segment_path(str(tmp_path), 0), 0)] == [
      ({"n": n}, payload, where) for n, (payload, where) in enumerate(zip(payloads, locations))]


def test_a_full_disk_while_a_push_streams_in_stops_the_syncer_and_leaves_the_log(params, tiny_disk):
  core = _core(params, tiny_disk, quorum=2)
  logged = _segment_bytes(tiny_disk)
  filler = _fill(str(tiny_disk), 16 << 10)
  with pytest.raises(core_lib.Stopped, match="spooling .* No space left"):  # Its spool beside the log fills the disk.
    core.store.spool(1 << 20, lambda view: None)
  assert _segment_bytes(tiny_disk) == logged and os.listdir(tiny_disk / "wal") == ["000000000000.log"]
  with pytest.raises(core_lib.Stopped):  # Fail-stop, as after a failed append.
    core.heartbeat(0, time.time())
  core.store.log.close()
  core.store.checkpointer.close()
  os.remove(filler)


def test_a_push_streamed_over_grpc_is_never_whole_in_the_syncers_memory(tmp_path):
  """The gRPC fallback (service.data_port=-1) spools a push as the data channel does: the Python heap (numpy's
  buffers and grpc's messages are traced) peaks at the spool's 4 MB chunk buffer and a few 64 KB messages, not at
  the 16 MB push a whole receive buffer would hold."""
  params = {"a": np.zeros(2 << 20, np.float32), "b": np.zeros(2 << 20, np.float32)}
  core = _core(params, tmp_path)
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16,
                                   max_payload_bytes=1 << 25)
  port = server.start()
  try:
    client, delta = _client(f"127.0.0.1:{port}", 0), _delta(params)
    tracemalloc.start()
    reply = client.push(0, delta, base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    client.close()
  finally:
    server.stop()
    core.close()
  assert reply["status"] == "applied" and core.acked[0] == 0
  assert wal.SPOOL_CHUNK_BYTES <= peak < wal.SPOOL_CHUNK_BYTES + (2 << 20), peak  # The push is 16 MB.


_SYNCER = """
import sys, time
from decoupled_diloco import model as model_lib
from decoupled_diloco.service import server as server_lib
from tests import service_config
from tests.test_service_units import TOKEN, _core
core = _core(model_lib.build_model(service_config.get_config().model, 0)[1], sys.argv[1])
server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16, max_payload_bytes=1 << 24,
                                 data_port=0)
print(server.start(), server.data.port, flush=True)
time.sleep(600)
"""


def _has_spool(pid, folder):
  """Whether process `pid` holds an unnamed file in `folder` open (O_TMPFILE: `<folder>/#<inode> (deleted)`)."""
  links = []
  for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
      links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except FileNotFoundError:  # Closed meanwhile.
      pass
  return any(link.startswith(f"{folder}/#") for link in links)


def test_a_syncer_killed_while_a_push_streams_in_loses_no_acknowledged_push(params, tmp_path):
  syncer = subprocess.Popen([sys.executable, "-c", _SYNCER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
  try:
    port, data_port = map(int, syncer.stdout.readline().split())
    address = f"127.0.0.1:{port}"
    assert _client(address, 0, data_channel=True).push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                                                       compute_seconds=0.1)["status"] == "applied"  # Acknowledged.
    data = b"".join(wire.encode(_delta(params, 0.02)))
    ticket = _ticket(address, _header(learner=1, payload_bytes=len(data)))["ticket"]
    with socket.create_connection(("127.0.0.1", data_port)) as connection:
      connection.sendall(bytes.fromhex(ticket) + data[:len(data) // 2])
      assert wait_for(lambda: _has_spool(syncer.pid, tmp_path / "wal"), 10)  # Half of it is spooled.
      syncer.kill()  # SIGKILL, halfway through the stream.
      syncer.wait()
  finally:
    syncer.kill()
  assert sorted(os.listdir(tmp_path / "wal")) == [os.path.basename(wal.segment_path("", 0))]  # The spool is gone.
  again = _core(params, tmp_path)  # Restored and replayed: the acknowledged push is held, the streamed one is not.
  assert again.acked == {0: 0, 1: -1} and [p.learner for p in again.syncer.pending] == [0]
  assert _push(again, params, 1, 0, value=0.02)["status"] == "applied" and again.syncer.version == 1
  reference = _core(params, tmp_path / "reference")
  _push(reference, params, 0, 0), _push(reference, params, 1, 0, value=0.02)
  assert _leaves_equal(again.syncer.params, reference.syncer.params)
  again.close(), reference.close()

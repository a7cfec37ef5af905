"""The push data channel: gRPC issues a ticket, the payload moves on a plain (or TLS) socket."""

import collections
import contextlib
import os
import pathlib
import secrets
import socket
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest

from decoupled_diloco import model as model_lib
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import datachannel, security, wal, wire
from decoupled_diloco.service import server as server_lib
from experiments.benchmarks import attacks
from tests import service_config
from tests.helpers import wait_for
from tests.test_service_units import TOKEN, _core, _delta, _header, _leaves_equal, _push, _self_signed

MAX_PAYLOAD = 1 << 24


@pytest.fixture(scope="module")
def params():
  return model_lib.build_model(service_config.get_config().model, 0)[1]


@contextlib.contextmanager
def _serving(core, **tls):
  """A SyncerServer with its data channel on a free port."""
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16,
                                   max_payload_bytes=MAX_PAYLOAD, data_port=0, data_timeout_seconds=5.0, **tls)
  port = server.start()
  try:
    yield server, f"127.0.0.1:{port}"
  finally:
    server.stop()


def _client(address, learner, **options):
  return client_lib.SyncerClient(address, TOKEN, learner, chunk_bytes=1 << 16, timeout_seconds=10, retry_seconds=5,
                                 **options)


def _ticket(address, header, token=TOKEN):
  """PushTicket called as a raw gRPC client would."""
  with grpc.insecure_channel(address) as channel:
    reply = channel.unary_unary(f"/{server_lib.SERVICE}/PushTicket")(wire.pack_header(header), timeout=10,
                                                                     metadata=security.call_metadata(token))
  return wire.parse_header(reply, client_lib.TICKET_SCHEMA)


def test_data_channel_pushes_apply_once_and_merge_with_streamed_ones(params, tmp_path):
  core = _core(params, tmp_path)
  with _serving(core) as (server, address):
    ticketed, streamed = _client(address, 0, data_channel=True), _client(address, 1)
    _, theta = ticketed.join()
    for _ in range(2):  # The resend of seq 0 is a duplicate, as over gRPC.
      reply = ticketed.push(0, _delta(params), base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
    assert reply["status"] == "duplicate" and reply["acked_seq"] == 0 and core.counts["duplicates"] == 1
    assert streamed.push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                         compute_seconds=0.1)["status"] == "applied"
    assert core.syncer.version == 1 and core.acked == {0: 0, 1: 0}  # Quorum 2: both pushes merged once.
    _, merged = ticketed.pull(0)
    assert not server.rejections
  reference = _core(params, tmp_path / "reference")  # The same pushes handed to a core directly.
  _push(reference, params, 0, 0), _push(reference, params, 1, 0)
  assert not _leaves_equal(merged, theta) and _leaves_equal(merged, reference.syncer.params)
  core.close(), reference.close()


def _log_bytes(core):
  """Every file in the write-ahead log's folder, byte for byte (a spool would be one more: it is unnamed)."""
  return {name: pathlib.Path(core.store.wal_dir, name).read_bytes() for name in os.listdir(core.store.wal_dir)}


def test_data_channel_refuses_forged_reused_short_and_bad_pushes_untouched(params, tmp_path):
  core = _core(params, tmp_path)
  log, theta = _log_bytes(core), core.syncer.params
  with _serving(core) as (server, address):
    data_address = ("127.0.0.1", server.data.port)
    parts = wire.encode(_delta(params))
    header = _header(payload_bytes=wire.encoded_size(parts))
    with pytest.raises(datachannel.DataRefused, match="data ticket") as forged:
      datachannel.send_push(data_address, secrets.token_hex(datachannel.TICKET_BYTES), parts, timeout=5)
    assert forged.value.code() == grpc.StatusCode.ABORTED  # Retried with a new ticket, as after a restart.

    ticket = _ticket(address, header)["ticket"]
    with socket.create_connection(data_address) as connection:  # Half the payload, then gone.
      connection.sendall(bytes.fromhex(ticket) + b"".join(parts)[:1000])
    assert wait_for(lambda: server.rejections["truncated"] == 1)
    with pytest.raises(datachannel.DataRefused) as reused:  # A ticket is good for one connection.
      datachannel.send_push(data_address, ticket, parts, timeout=5)
    assert reused.value.code() == grpc.StatusCode.ABORTED and server.rejections["unauthenticated"] == 2

    leaves, treedef = jax.tree.flatten(_delta(params))  # Streamed and checked tensor by tensor: the last is bad.
    nan = jax.tree.unflatten(treedef, leaves[:-1] + [np.full(leaves[-1].shape, np.nan, np.float32)])
    nan_parts = wire.encode(nan)
    nan_ticket = _ticket(address, _header(seq=1, payload_bytes=wire.encoded_size(nan_parts)))["ticket"]
    assert _log_bytes(core) == log
    with pytest.raises(datachannel.DataRefused, match="NaN|Inf|finite") as bad:
      datachannel.send_push(data_address, nan_ticket, nan_parts, timeout=5)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and server.rejections["rejected"] == 1
    # The refused push is not logged; learner 0 leaving the quorum for it is (a replay must merge as the syncer did).
    logged = [record for record, _, _ in wal.records(wal.segment_path(core.store.wal_dir, 0), 0)]
    assert logged[-1] == {"type": "live", "learners": [1]} and not [r for r in logged if r["type"] == "push"]
    log = _log_bytes(core)

    for fields, token, code in [({"payload_bytes": MAX_PAYLOAD + 1}, TOKEN, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                ({"learner": 7}, TOKEN, grpc.StatusCode.NOT_FOUND),
                                ({}, "w" * 32, grpc.StatusCode.UNAUTHENTICATED)]:
      with pytest.raises(grpc.RpcError) as refused:
        _ticket(address, _header(**fields), token)
      assert refused.value.code() == code
    assert core.syncer.version == 0 and core.acked == {0: -1, 1: -1} and core.counts["rejected"] == 1
    assert _log_bytes(core) == log and not core.syncer.pending and _leaves_equal(core.syncer.params, theta)
    # The learner's own client still gets through.
    assert _client(address, 0, data_channel=True).push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                                                       compute_seconds=0.1)["status"] == "applied"
  core.close()


def test_a_syncer_without_data_channel_says_how_to_push(params, tmp_path):
  core = _core(params, tmp_path)
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16,
                                   max_payload_bytes=MAX_PAYLOAD)
  port = server.start()
  try:
    with pytest.raises(grpc.RpcError) as refused:
      _ticket(f"127.0.0.1:{port}", _header())
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "data_port" in refused.value.details()
    learner = _client(f"127.0.0.1:{port}", 0, data_channel=True)  # Falls back to streaming over gRPC.
    assert learner.push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                        compute_seconds=0.1)["status"] == "applied" and not learner.data_channel
  finally:
    server.stop()
    core.close()


def test_data_channel_speaks_tls_when_grpc_does(params, tmp_path):
  cert_file, key_file = _self_signed(str(tmp_path))
  core = _core(params, tmp_path / "run")
  tls = {
      "credentials": security.server_credentials(cert_file, key_file),
      "data_tls": security.server_tls_context(cert_file, key_file)}
  with _serving(core, **tls) as (server, address):
    client = _client(address, 0, data_channel=True, credentials=security.channel_credentials(cert_file),
                     data_tls=security.client_tls_context(cert_file))
    assert client.push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                       compute_seconds=0.1)["status"] == "applied"
    with pytest.raises(datachannel.DataRefused) as plaintext:  # A plaintext peer gets nothing through.
      datachannel.send_push(("127.0.0.1", server.data.port), secrets.token_hex(16), [memoryview(b"x")], timeout=5)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: server.rejections["truncated"] == 1) and core.acked == {0: 0, 1: -1}
  with pytest.raises(ValueError, match="TLS"):
    server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16, max_payload_bytes=1,
                            credentials=tls["credentials"], data_port=0)
  core.close()


def test_a_payload_still_arriving_when_the_syncer_stops_is_refused_not_applied(params, tmp_path):
  core = _core(params, tmp_path)
  with _serving(core) as (server, address):
    parts = wire.encode(_delta(params))
    data = b"".join(parts)
    ticket = _ticket(address, _header(payload_bytes=len(data)))["ticket"]
    with socket.create_connection(("127.0.0.1", server.data.port), timeout=10) as connection:
      connection.sendall(bytes.fromhex(ticket) + data[:1000])
      # Served (its ticket taken), not just queued: stopping resets connections not yet accepted.
      assert wait_for(lambda: not server.data._tickets)  # pylint: disable=protected-access
      server.data.stop()  # As SyncerServer.stop does before the syncer's last checkpoint.
      connection.sendall(data[1000:])
      connection.shutdown(socket.SHUT_WR)
      reply = b"".join(iter(lambda: connection.recv(1 << 16), b""))
    header_bytes = datachannel._REPLY.size  # pylint: disable=protected-access
    ok, length = datachannel._REPLY.unpack_from(reply)  # pylint: disable=protected-access
    refusal = wire.parse_header(reply[header_bytes:header_bytes + length], datachannel.REFUSAL_SCHEMA)
    assert not ok and refusal["code"] == "UNAVAILABLE" and "shutting down" in refusal["details"]
    assert core.acked == {0: -1, 1: -1} and not core.syncer.pending and core.syncer.version == 0
  core.close()


def test_a_connect_and_close_flood_starts_no_thread_is_counted_and_leaves_ticketed_pushes_alone(params, tmp_path):
  core = _core(params, tmp_path, quorum=1)
  started = []  # Names of the threads started meanwhile (each records itself on its first call).

  def record(*_):
    started.append(threading.current_thread().name)
    sys.setprofile(None)

  with _serving(core) as (server, address):
    stop, floods = threading.Event(), []
    flood_threads = [
        threading.Thread(target=lambda: floods.append(attacks.reconnect_flood("127.0.0.1", server.data.port, stop)))
        for _ in range(4)]
    threading.setprofile(record)
    for thread in flood_threads:
      thread.start()
    try:
      client, version, seconds = _client(address, 0, data_channel=True), 0, []
      refused = lambda: server.rejections["truncated"] + server.rejections["evicted"]
      # From the flood's own source address, while it runs: 5 pushes, and more until 100 connections of the
      # flood were refused (a loaded machine runs the flood's threads slower).
      while len(seconds) < 5 or (refused() <= 100 and len(seconds) < 50):
        begin = time.monotonic()
        reply = client.push(len(seconds), _delta(params), base_version=version, tokens=64, local_steps=4,
                            compute_seconds=0.1)
        seconds.append(time.monotonic() - begin)
        assert reply["status"] == "applied", reply
        version = reply["version"]
    finally:
      stop.set()
      threading.setprofile(None)
      for thread in flood_threads:
        thread.join(timeout=30)
    connected = sum(flood["CONNECTED"] for flood in floods)
    assert connected > 100 and client.retries == 0 and max(seconds) < 5.0, (connected, client.retries, seconds)
    # One data-push thread per push, none per flood connection.
    assert started.count("data-push") == len(seconds), collections.Counter(started)
    # Each flood connection is refused and counted once: closed before its ticket, or evicted.
    assert wait_for(lambda: refused() == connected), (server.rejections, connected)
  core.close()

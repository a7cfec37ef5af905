r"""A ~100 MB pseudo-gradient pushed to the syncer service vs a raw TCP socket sending the same bytes.

  python -m experiments.benchmarks.transport

Service side: the real `SyncerServer` (token check, header checks, limits) in a child
process, fed by `SyncerClient.push` as a learner calls it, over loopback. The syncer's
state machine is replaced by a core that only decodes the payload and acknowledges
(`merge_throughput` measures the merge); a push streams into a spool file on its way
through the syncer's own `durable.Store.spool` (its crc32 and page-cache write are timed
here). Pushes travel as learners send them by default: a PushTicket call over gRPC, then
the payload on the data channel (datachannel.py).
TCP side: the same encoded bytes with `sendall`, received with `recv_into` into one
buffer, then a one-byte ack. All receivers live in one child process (a learner and the
syncer are separate processes; in one process sender and receiver would take turns on the
GIL), and the transports alternate (common.interleaved_medians).

Pulls: the same bytes as the syncer's encoded Θ, fetched with `SyncerClient.pull` as a learner
does (a PullTicket call, then Θ read off the data channel, decoded) against a raw TCP socket
that sends them to a reader receiving into one buffer.

The last line holds the issue's keys: `ratio` = TCP seconds / service push seconds (the push's share
of the raw socket's throughput; target >= 0.5) and `pull_ratio`: TCP download seconds / service pull
seconds (target >= 0.8). The line before it, context: `grpc_stream_ratio`: the same push streamed in chunks over gRPC
(service.data_port=-1). `bare_grpc_ratio`: grpcio's own ceiling on this machine, the same
chunks streamed to a handler that only counts them (no token, header, reassembly or
decoding): why payloads do not travel over gRPC by default.
"""

import multiprocessing
import os
import socket
import tempfile
import threading
from concurrent import futures

from absl import app
from absl import flags
import grpc
import numpy as np

from experiments.benchmarks import common

_MEGABYTES = flags.DEFINE_integer("megabytes", 100, "Size of the pseudo-gradient.")
_BLOCKS = flags.DEFINE_integer("blocks", 15, "Interleaved repetitions (median taken).")
_CHUNK = flags.DEFINE_integer("chunk_bytes", 4 << 20, "Bytes per streamed message (config.service.chunk_bytes).")

TOKEN = "benchmark-token-0123456789"


class _DecodeOnlyCore:
  """Stands in for SyncerCore: does the transport's half of a push (decode) and acknowledges, and
  serves `theta` (encoded parts, as SyncerCore caches them) to every pull. A data-channel push streams
  into a spool file through the syncer's own `durable.Store.spool` (a store in `workdir`)."""

  num_learners = 1

  def __init__(self, theta: list, workdir: str):
    from decoupled_diloco.service import durable  # pylint: disable=g-import-not-at-top
    self.theta, self.store = theta, durable.Store(workdir)
    self.store.open_fresh()  # The log's folder, where spools go.

  def check_bounds(self, header: dict) -> None:
    del header

  def push(self, header: dict, payload, now: float) -> dict:
    del now
    from decoupled_diloco.service import wire  # pylint: disable=g-import-not-at-top
    wire.decode(payload.map)  # A wal.Spool, over the data channel and gRPC alike.
    return {"status": "applied", **self._status(header["seq"], header["incarnation"])}

  def pull(self, learner: int, fragment: int, have_version: int, now: float, on_wait=None) -> tuple[dict, list]:
    del learner, fragment, have_version, now, on_wait
    return self._status(-1, 0), self.theta

  @staticmethod
  def _status(acked_seq: int, incarnation: int) -> dict:
    return {
        "version": 0, "versions": [0], "acked_seq": acked_seq, "steps_left": 1, "done": False, "max_speed": 0.0,
        "incarnation": incarnation, "syncer_incarnation": 1}


def _service(chunk_bytes: int, max_payload: int, core: _DecodeOnlyCore) -> tuple[object, int]:
  """The syncer's real server (gRPC + data channel) around the decode-only core."""
  from decoupled_diloco.service import server  # pylint: disable=g-import-not-at-top
  service = server.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=chunk_bytes,
                                max_payload_bytes=max_payload, workers=2, data_port=0, data_timeout_seconds=300)
  return service, service.start()


def _bare_grpc(chunk_bytes: int) -> tuple[grpc.Server, int]:
  """grpcio alone: a Drain method that counts the streamed chunks' bytes."""
  from decoupled_diloco.service import server  # pylint: disable=g-import-not-at-top

  def drain(messages, context):
    del context
    return str(sum(len(m) for m in messages)).encode()

  bare = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=server.message_options(chunk_bytes))
  bare.add_generic_rpc_handlers(
      (grpc.method_handlers_generic_handler("benchmark.Bare", {"Drain": grpc.stream_unary_rpc_method_handler(drain)}),))
  port = bare.add_insecure_port("127.0.0.1:0")
  bare.start()
  return bare, port


class _TcpServer:
  """The raw-socket side: a loopback port whose every connection `handle` serves, on a daemon thread."""

  def __init__(self, handle):
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.port = self.listener.getsockname()[1]
    threading.Thread(target=self._serve, args=(handle,), daemon=True).start()

  def _serve(self, handle) -> None:
    while True:
      connection, _ = self.listener.accept()
      with connection:
        handle(connection)


def _receive_into(connection, buffer, size: int) -> None:
  """Receives exactly `size` bytes into `buffer`, as one buffer (no per-message copies)."""
  view, received = memoryview(buffer), 0
  while received < size:
    received += connection.recv_into(view[received:])


def _sink(size: int):
  """A push's receiver: exactly `size` bytes per connection into one buffer, then a one-byte ack."""
  buffer = bytearray(size)

  def handle(connection) -> None:
    _receive_into(connection, buffer, size)
    connection.sendall(b"k")

  return handle


def _source(parts: list):
  """A pull's sender: `parts` to every connection."""

  def handle(connection) -> None:
    for part in parts:
      connection.sendall(part)

  return handle


def _pseudo_gradient(megabytes: int) -> dict:
  """The benchmark's payload: 8 leaves of seeded noise, `megabytes` in all (the same in both processes)."""
  leaves = 8
  per_leaf = megabytes * (1 << 20) // 4 // leaves
  rng = np.random.default_rng(0)
  return {f"layer_{i}": {"w": rng.standard_normal(per_leaf, dtype=np.float32) * 1e-3} for i in range(leaves)}


def _receivers(megabytes: int, chunk_bytes: int, connection) -> None:
  """Child process: every receiver (and the pull sources); sends their ports, then serves until told to stop."""
  from decoupled_diloco.service import wire  # pylint: disable=g-import-not-at-top
  theta = wire.encode(_pseudo_gradient(megabytes))
  size = wire.encoded_size(theta)
  with tempfile.TemporaryDirectory(prefix="transport_") as workdir:
    core = _DecodeOnlyCore(theta, workdir)
    service, port = _service(chunk_bytes, 2 * size, core)
    bare, bare_port = _bare_grpc(chunk_bytes)
    tcp, source = _TcpServer(_sink(size)), _TcpServer(_source(theta))
    connection.send((port, bare_port, tcp.port, source.port))
    connection.recv()
    service.stop(0)
    bare.stop(0)
    core.store.close()


def main(argv) -> None:
  """Times the push paths and the raw socket on the same bytes and emits the ratios."""
  del argv
  from decoupled_diloco.service import client as client_lib, server, wire  # pylint: disable=g-import-not-at-top
  delta = _pseudo_gradient(_MEGABYTES.value)
  parts = wire.encode(delta)
  size = wire.encoded_size(parts)
  parent, child = multiprocessing.get_context("spawn").Pipe()
  receivers = multiprocessing.get_context("spawn").Process(  # Daemon: never outlives a failed run.
      target=_receivers, args=(_MEGABYTES.value, _CHUNK.value, child), daemon=True)
  receivers.start()
  port, bare_port, tcp_port, source_port = parent.recv()
  clients = {
      via: client_lib.SyncerClient(f"127.0.0.1:{port}", TOKEN, 0, chunk_bytes=_CHUNK.value, timeout_seconds=300,
                                   retry_seconds=10, data_channel=via == "push") for via in ("push", "grpc_stream")}
  seq = iter(range(1 << 30))
  bare_channel = grpc.insecure_channel(f"127.0.0.1:{bare_port}", options=server.message_options(_CHUNK.value))
  bare_call = bare_channel.stream_unary("/benchmark.Bare/Drain")

  def pushing(via):

    def push():
      reply = clients[via].push(next(seq), delta, base_version=0, tokens=1, local_steps=1, compute_seconds=0.0)
      assert reply["status"] == "applied"

    return push

  def over_bare_grpc():
    assert bare_call(wire.chunks(parts, _CHUNK.value), timeout=300) == str(size).encode()

  def over_tcp():
    with socket.create_connection(("127.0.0.1", tcp_port)) as connection:
      for part in parts:
        connection.sendall(part)
      assert connection.recv(1) == b"k"

  def pulling():
    _, theta = clients["push"].pull(-1)
    assert theta["layer_0"]["w"].size == delta["layer_0"]["w"].size

  def download_over_tcp():
    with socket.create_connection(("127.0.0.1", source_port)) as connection:
      _receive_into(connection, wire.aligned_buffer(size), size)

  runners = {
      "push": pushing("push"), "grpc_stream": pushing("grpc_stream"), "bare_grpc": over_bare_grpc, "tcp": over_tcp,
      "pull": pulling, "tcp_download": download_over_tcp}
  medians = common.interleaved_medians(runners, _BLOCKS.value, warm_up=True)
  for client in clients.values():
    client.close()
  bare_channel.close()
  parent.send("stop")
  receivers.join()
  common.emit_keys(
      common.throughput_figures(
          {
              "benchmark": "transport", "chunk_bytes": _CHUNK.value, "load_average": round(os.getloadavg()[0], 1),
              **{f"{via}_ratio": round(medians["tcp"] / medians[via], 3) for via in ("grpc_stream", "bare_grpc")}, "pull_ratio":
                  round(medians["tcp_download"] / medians["pull"], 3), "pull_seconds": round(
                      medians["pull"], 4), "tcp_download_seconds": round(medians["tcp_download"], 4)}, size, medians,
          "push", "tcp"), ("ratio", "pull_ratio"))


if __name__ == "__main__":
  app.run(main)

r"""A ~100 MB pseudo-gradient over loopback gRPC vs a raw TCP socket sending the same bytes.

  python -m experiments.benchmarks.transport

gRPC side: `SyncerClient.push` (wire encoding, chunked client stream with the token) to a
server with the syncer service's message limits that reassembles and decodes the payload
with the same `wire` functions as `SyncerServer`, then acknowledges. The syncer's state
machine is left out: `merge_throughput` measures it. TCP side: the same encoded bytes with
`sendall`, received with `recv_into` into one buffer, then a one-byte ack. Both receivers
live in one child process (a learner and the syncer are separate processes; in one process
sender and receiver would take turns on the GIL), and the two transports alternate
(common.interleaved_medians). Key `ratio` = TCP seconds / gRPC seconds
(gRPC throughput as a fraction of the raw socket's; target >= 0.5). `bare_grpc_ratio` is
grpcio's own ceiling on this machine, timed in the same interleaving: the same chunks
streamed to a handler that only counts them (no token, header, reassembly or decoding).
"""

import multiprocessing
import socket
import threading
from concurrent import futures

from absl import app
from absl import flags
import grpc
import numpy as np

from experiments.benchmarks import common

_MEGABYTES = flags.DEFINE_integer("megabytes", 100, "Size of the pseudo-gradient.")
_BLOCKS = flags.DEFINE_integer("blocks", 5, "Interleaved repetitions (median taken).")
_CHUNK = flags.DEFINE_integer("chunk_bytes", 4 << 20, "Bytes per streamed message (config.service.chunk_bytes).")

TOKEN = "benchmark-token-0123456789"


def _grpc_sink(chunk_bytes: int, max_payload: int):
  """A gRPC server doing the transport half of SyncerServer's Push: assemble + decode + reply."""
  from decoupled_diloco.service import core, security, server, wire  # pylint: disable=g-import-not-at-top

  def push(messages, context):
    if not security.token_matches(context.invocation_metadata(), TOKEN):
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "token")
    header = wire.parse_header(next(messages), core.PUSH_SCHEMA)
    wire.decode(wire.assemble(messages, header["payload_bytes"], max_payload, chunk_bytes))
    return wire.pack_header({"status": "applied", "version": 0, "versions": [0], "acked_seq": header["seq"],
                             "steps_left": 1, "done": False, "max_speed": 0.0})

  def drain(messages, context):
    del context
    return str(sum(len(m) for m in messages)).encode()

  sink = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=server.message_options(chunk_bytes))
  sink.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
      server.SERVICE, {"Push": grpc.stream_unary_rpc_method_handler(push),
                       "Drain": grpc.stream_unary_rpc_method_handler(drain)}),))
  port = sink.add_insecure_port("127.0.0.1:0")
  sink.start()
  return sink, port


class _TcpSink:
  """Receives exactly `size` bytes per connection into one buffer, then acks with one byte."""

  def __init__(self, size: int):
    self.size, self.buffer = size, bytearray(size)
    self.listener = socket.create_server(("127.0.0.1", 0))
    self.port = self.listener.getsockname()[1]
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self) -> None:
    view = memoryview(self.buffer)
    while True:
      connection, _ = self.listener.accept()
      with connection:
        received = 0
        while received < self.size:
          received += connection.recv_into(view[received:])
        connection.sendall(b"k")


def _receivers(size: int, chunk_bytes: int, connection) -> None:
  """Child process: both receivers; sends their ports, then serves until told to stop."""
  sink, grpc_port = _grpc_sink(chunk_bytes, 2 * size)
  tcp = _TcpSink(size)
  connection.send((grpc_port, tcp.port))
  connection.recv()
  sink.stop(0)


def main(argv) -> None:
  """Times both transports on the same bytes and emits the ratio."""
  del argv
  from decoupled_diloco.service import client as client_lib, server, wire  # pylint: disable=g-import-not-at-top
  leaves = 8
  per_leaf = _MEGABYTES.value * (1 << 20) // 4 // leaves
  rng = np.random.default_rng(0)
  delta = {f"layer_{i}": {"w": rng.standard_normal(per_leaf, dtype=np.float32) * 1e-3} for i in range(leaves)}
  parts = wire.encode(delta)
  size = wire.encoded_size(parts)
  parent, child = multiprocessing.get_context("spawn").Pipe()
  receivers = multiprocessing.get_context("spawn").Process(target=_receivers, args=(size, _CHUNK.value, child),
                                                           daemon=True)  # Never outlives a failed run.
  receivers.start()
  port, tcp_port = parent.recv()
  client = client_lib.SyncerClient(f"127.0.0.1:{port}", TOKEN, 0, chunk_bytes=_CHUNK.value, timeout_seconds=300,
                                   retry_seconds=10)
  seq = iter(range(1 << 30))
  bare_channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=server.message_options(_CHUNK.value))
  bare_call = bare_channel.stream_unary(f"/{server.SERVICE}/Drain")

  def over_grpc():
    reply = client.push(next(seq), delta, base_version=0, tokens=1, local_steps=1, compute_seconds=0.0)
    assert reply["status"] == "applied"

  def over_bare_grpc():
    assert bare_call(wire.chunks(parts, _CHUNK.value), timeout=300) == str(size).encode()

  def over_tcp():
    with socket.create_connection(("127.0.0.1", tcp_port)) as connection:
      for part in parts:
        connection.sendall(part)
      assert connection.recv(1) == b"k"

  over_grpc(), over_bare_grpc(), over_tcp()  # Warm up every path (connections, allocator).
  medians = common.interleaved_medians({"grpc": over_grpc, "bare_grpc": over_bare_grpc, "tcp": over_tcp},
                                       _BLOCKS.value)
  client.close()
  bare_channel.close()
  parent.send("stop")
  receivers.join()
  common.emit_throughput_ratio({"benchmark": "transport", "chunk_bytes": _CHUNK.value,
                                "bare_grpc_ratio": round(medians["tcp"] / medians["bare_grpc"], 3)},
                               size, medians, "grpc", "tcp")


if __name__ == "__main__":
  app.run(main)

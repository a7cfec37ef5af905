"""Attacker loops against a syncer on loopback, shared by tests/test_hostile.py and benchmarks/hostile.py.

Each loop uses the project's own wire code and raw sockets, as an adversarial learner (one
holding its own credential) or a stranger would, runs until `stop` is set or `max_count`
attempts were made, and returns what the syncer answered, by gRPC status name ('OK' for
nothing refused, 'CLOSED' for a data connection the syncer shut).
"""

import collections
import itertools
import socket
import threading
import time

import grpc
import msgpack

from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import security, server as server_lib, wire


def _attempts(stop: threading.Event, max_count: int):
  """Attempt numbers 0, 1, ...: each taken only while `stop` is not set, at most `max_count`."""
  return itertools.takewhile(lambda _: not stop.is_set(), range(max_count))


def push_header(learner: int, payload_bytes: int, **fields) -> dict:
  """A well-formed push header (fields override)."""
  return {
      "learner": learner, "seq": 0, "base_version": 0, "fragment": 0, "tokens": 64, "local_steps": 1,
      "compute_seconds": 0.1, "payload_bytes": payload_bytes, "incarnation": 0, "budget_steps": 1, "budget_tokens": 64,
      **fields}


def ticket(address: str, header: dict, token: str) -> dict:
  """A data-channel ticket for `header`, asked as a raw gRPC client."""
  with grpc.insecure_channel(address) as channel:
    reply = channel.unary_unary(f"/{server_lib.SERVICE}/PushTicket")(wire.pack_header(header), timeout=10,
                                                                     metadata=security.call_metadata(token))
  return wire.parse_header(reply, client_lib.TICKET_SCHEMA)


def overflowing_payload() -> bytes:
  """A payload whose one array claims a shape whose element count overflows int64."""
  ref = msgpack.ExtType(1, msgpack.packb(["float32", [2**40, 2**40, 2**40], 0]))
  skeleton = msgpack.packb({"kind": "tree", "value": {"w": ref}}, use_bin_type=True)
  head = len(skeleton).to_bytes(4, "little") + skeleton
  return head.ljust(-(-len(head) // 64) * 64, b"\0") + bytes(64)


def reconnect_flood(host: str, port: int, stop: threading.Event, hold_seconds: float = 0.0, max_count: int = 100_000,
                    per_second: float = 0.0) -> collections.Counter:
  """Connects to the data port again and again sending nothing (held `hold_seconds` each), at most
  `per_second` times a second if given (else as fast as the syncer accepts)."""
  outcomes, begin = collections.Counter(), time.monotonic()
  for attempt in _attempts(stop, max_count):
    if per_second:
      stop.wait(begin + attempt / per_second - time.monotonic())
    try:
      with socket.create_connection((host, port), timeout=5) as connection:
        outcomes[_hold(connection, hold_seconds, stop) if hold_seconds else "CONNECTED"] += 1
    except OSError:
      outcomes["REFUSED"] += 1
  return outcomes


def _hold(connection: socket.socket, seconds: float, stop: threading.Event) -> str:
  """Holds an idle connection for `seconds`, or until `stop`, so that an attack ends when told to;
  'CLOSED' if the syncer dropped it first."""
  connection.settimeout(0.25)
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and not stop.is_set():
    try:
      return "CLOSED" if connection.recv(1) == b"" else "DATA"
    except TimeoutError:
      continue
  return "HELD"


def slow_sender(address: str, data_port: int, token: str, learner: int, stop: threading.Event,
                payload_bytes: int = 64 << 10, byte_seconds: float = 0.5, max_count: int = 100) -> collections.Counter:
  """Takes a valid ticket (as `learner`, with its credential) and trickles the payload one byte at a time."""
  outcomes = collections.Counter()
  host = address.rsplit(":", 1)[0]
  for _ in _attempts(stop, max_count):
    try:
      granted = ticket(address, push_header(learner, payload_bytes), token)
    except grpc.RpcError as error:
      outcomes[error.code().name] += 1
      stop.wait(0.5)
      continue
    try:
      with socket.create_connection((host, data_port), timeout=60) as connection:
        connection.sendall(bytes.fromhex(granted["ticket"]))
        while not stop.is_set():
          connection.sendall(b"\0")
          stop.wait(byte_seconds)
        outcomes["STOPPED"] += 1
    except OSError:
      outcomes["CLOSED"] += 1
  return outcomes


def stalled_push(address: str, token: str, learner: int, stop: threading.Event, payload_bytes: int = 1 << 20,
                 max_count: int = 100) -> collections.Counter:
  """Opens Push streams that send a header and then nothing, until the syncer gives up on them."""
  outcomes = collections.Counter()
  with grpc.insecure_channel(address) as channel:
    push = channel.stream_unary(f"/{server_lib.SERVICE}/Push")

    def stalled():
      yield wire.pack_header(push_header(learner, payload_bytes))
      stop.wait()

    for _ in _attempts(stop, max_count):
      try:
        push(stalled(), metadata=security.call_metadata(token), timeout=600)
        outcomes["OK"] += 1
      except grpc.RpcError as error:
        outcomes[error.code().name] += 1
        if error.code() == grpc.StatusCode.UNAVAILABLE:
          stop.wait(0.2)
  return outcomes


def poison_headers(address: str, token: str, learner: int, victim: int, stop: threading.Event, max_count: int = 100_000,
                   pause: float = 0.0) -> collections.Counter:
  """Sends headers no honest learner sends: out of bounds, impersonating `victim`, forged tokens (as
  PushTicket calls, which check a header before any payload), and a Push whose payload's shape
  overflows int64. Each is refused before anything is applied."""
  outcomes = collections.Counter()
  payload = overflowing_payload()
  cases = [
      ("PushTicket", token, push_header(learner, len(payload), tokens=2**62)),
      ("PushTicket", token, push_header(learner, len(payload), local_steps=10**12)),
      ("PushTicket", token, push_header(learner, len(payload), seq=2**62)),
      ("PushTicket", token, push_header(victim, len(payload), seq=2**20)),
      ("PushTicket", "forged-" + "x" * 32, push_header(victim, len(payload))),
      ("Push", token, push_header(learner, len(payload))),]
  with grpc.insecure_channel(address) as channel:
    calls = {
        "Push": channel.stream_unary(f"/{server_lib.SERVICE}/Push"),
        "PushTicket": channel.unary_unary(f"/{server_lib.SERVICE}/PushTicket")}
    for count in _attempts(stop, max_count):
      method, sender, header = cases[count % len(cases)]
      request = iter([wire.pack_header(header), payload]) if method == "Push" else wire.pack_header(header)
      try:
        calls[method](request, metadata=security.call_metadata(sender), timeout=30)
        outcomes["OK"] += 1
      except grpc.RpcError as error:
        outcomes[error.code().name] += 1
      if pause:
        stop.wait(pause)
  return outcomes


def run_for(seconds: float, attacks: list) -> list[collections.Counter]:
  """Runs each `attack(stop)` on its own thread for `seconds`, then stops them; returns their outcomes."""
  stop, results = threading.Event(), [None] * len(attacks)

  def run(i, attack):
    results[i] = attack(stop)

  threads = [threading.Thread(target=run, args=(i, a), daemon=True) for i, a in enumerate(attacks)]
  for thread in threads:
    thread.start()
  time.sleep(seconds)
  stop.set()
  for thread in threads:
    thread.join(timeout=60)
  return [r or collections.Counter() for r in results]

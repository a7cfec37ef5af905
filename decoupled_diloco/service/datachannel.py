"""A plain TCP data channel for pushes and pulls, opened by a one-time ticket the gRPC service issues.

Why: over loopback, grpcio moves a streamed payload at about half of what a raw socket does
(benchmarks/transport), because every chunk crosses its Python and C-core layers. So gRPC
keeps the control (token, TLS, the header's checks, the reply) and the bytes move on a
socket, straight into the aligned buffer the syncer decodes without a copy. The protocol,
tickets and pacing are in docs/exchange.md, the starvation defences (ticketless pool,
eviction, transfer deadlines) in docs/security.md. A refusal is raised on the learner as
`DataRefused`, a `grpc.RpcError` with a status code, so the client retries and reports it
exactly as it would a gRPC push.
"""

import contextlib
import secrets
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from absl import logging
import grpc
import numpy as np

from decoupled_diloco.service import link as link_lib
from decoupled_diloco.service import wal, wire

TICKET_BYTES = 16
HANDSHAKE_SECONDS = 10.0  # For TLS and the ticket, in all: a connection without one frees its slot soon.
DISCARD_BYTES = 64 << 20  # What a refused connection may still send before it is closed (reset).
LISTEN_BACKLOG = 1024  # Connections the kernel queues for accept(): a flood's burst is queued, not dropped.
ACCEPT_POLL_SECONDS = 0.25  # How often the accept thread looks for connections past HANDSHAKE_SECONDS.
CONNECT_SECONDS = 2.0  # A learner's connect: a SYN the flooded syncer dropped fails fast (then gRPC streams).
MIN_RATE_BYTES_PER_SECOND = 256 << 10  # The slowest transfer allowed (data channel and gRPC streams alike).
_REPLY = struct.Struct("<BI")
REFUSAL_SCHEMA = {"code": str, "details": str}


class DataRefused(grpc.RpcError):
  """A data-channel push that failed: refused by the syncer, or the connection broke."""

  def __init__(self, code: grpc.StatusCode, details: str):
    super().__init__(f"{code.name}: {details}")
    self._code, self._details = code, details

  def code(self) -> grpc.StatusCode:
    """The status, as a gRPC call would report it (UNAVAILABLE when the connection broke)."""
    return self._code

  def details(self) -> str:
    """Why, in one line."""
    return self._details


def transfer_seconds(nbytes: int, link: link_lib.Link = link_lib.UNSHAPED) -> float:
  """A whole transfer's deadline: HANDSHAKE_SECONDS plus `nbytes` at the minimum rate, or at the
  learner's shaped `link` rate where that is slower (its link is the config's, not the peer's word)."""
  rate = min(MIN_RATE_BYTES_PER_SECOND, link.mbps * 1e6 / 8) if link.mbps else MIN_RATE_BYTES_PER_SECOND
  return HANDSHAKE_SECONDS + link.latency_ms / 1e3 + nbytes / rate


def _time_out_at(connection: socket.socket, deadline: float) -> None:
  """The next socket operation may wait until `deadline` (monotonic), no longer."""
  connection.settimeout(max(1e-3, deadline - time.monotonic()))


def _receive_into(connection: socket.socket, view: memoryview, deadline: float | None = None) -> None:
  """Fills `view` from the connection (by `deadline`, monotonic, if given); ConnectionError if
  the peer stops early, TimeoutError if it is too slow."""
  filled = 0
  while filled < view.nbytes:
    if deadline is not None:
      _time_out_at(connection, deadline)
    received = connection.recv_into(view[filled:])
    if not received:
      raise ConnectionError(f"connection closed after {filled} of {view.nbytes} bytes")
    filled += received


def refusal_reply(code: grpc.StatusCode, details: str) -> tuple[bool, bytes]:
  """What `receive` returns to refuse a payload: the status and why, as the learner will raise them."""
  return False, wire.pack_header({"code": code.name, "details": details})


def _frame(ok: bool, body: bytes) -> bytes:
  return _REPLY.pack(ok, len(body)) + body


def _discard(connection: socket.socket) -> None:
  """Reads and drops what the peer still sends (up to DISCARD_BYTES), so that it can read the
  reply before the close; a larger payload is cut off (reset), which its sender retries."""
  scratch, dropped = memoryview(bytearray(1 << 20)), 0
  deadline = time.monotonic() + HANDSHAKE_SECONDS
  while dropped < DISCARD_BYTES and time.monotonic() < deadline:
    _time_out_at(connection, deadline)
    received = connection.recv_into(scratch)
    if not received:
      return
    dropped += received


def _receive(connection: socket.socket, nbytes: int, deadline: float | None = None) -> memoryview:
  view = memoryview(bytearray(nbytes))
  _receive_into(connection, view, deadline)
  return view


class DataListener:
  """The syncer's side: accepts ticketed connections and hands each payload to `receive`, streamed into a
  `wal.Spool` (never whole in memory).

  `receive(header, payload)` returns (ok, reply bytes): the push reply header, or a refusal
  {code, details}; it must not raise. One thread accepts connections and reads their tickets; each
  ticketed connection is served on a thread of its own. At most `max_connections` wait for their
  ticket (see docs/security.md for who is evicted).
  """

  def __init__(self, host: str, port: int, receive: Callable[[dict, wal.Spool], tuple[bool, bytes]], *, spool: Callable,
               ttl_seconds: float, max_connections: int, tls: ssl.SSLContext | None = None,
               on_refusal: Callable[[str, str], None] = lambda reason, message: None, links: tuple[link_lib.Link,
                                                                                                   ...] = ()):
    self.receive, self.ttl, self.tls, self.on_refusal = receive, ttl_seconds, tls, on_refusal
    self.spool = spool  # spool(nbytes, read): a payload streamed into a wal.Spool (durable.Store.spool).
    self.links = links  # Learner i's link paces the Θ sent to it (none given: unshaped).
    # ticket -> (push header or {"learner"} of a pull, the pull's parts or None for a push, expiry)
    self._tickets: dict[bytes, tuple[dict, list | None, float]] = {}
    self._lock = threading.Lock()
    self.max_unticketed, self.per_source = max_connections, max(1, max_connections // 2)
    # Unticketed connections in arrival order (oldest first) -> (source address, handshake deadline, the
    # ticket's bytes so far); only the accept thread touches it.
    self._unticketed: dict[socket.socket, tuple[str, float, bytearray]] = {}
    self._socket = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
    self.port = self._socket.getsockname()[1]
    self._closed = False
    self._gate = threading.Lock()  # Held while a payload goes into the syncer; stop() closes it.

  def start(self) -> int:
    """Starts accepting; returns the bound port."""
    threading.Thread(target=self._accept, name="data-accept", daemon=True).start()
    return self.port

  def stop(self) -> None:
    """Stops accepting; once it returns, no payload reaches `receive` (late ones are refused
    UNAVAILABLE, so their learners resend them to the restarted syncer)."""
    with self._gate:
      self._closed = True
    try:
      self._socket.shutdown(socket.SHUT_RDWR)  # Wakes the blocked accept() (close alone does not).
    except OSError:
      pass
    self._socket.close()

  def ticket(self, header: dict, pull: list[memoryview] | None = None) -> str:
    """A one-time ticket (hex) for `header`'s payload, or for sending `pull` (Θ_p's encoded parts)
    to learner header["learner"]; replaces that learner's previous ticket of the same direction."""
    ticket = secrets.token_bytes(TICKET_BYTES)
    now = time.monotonic()
    with self._lock:
      self._tickets = {
          t: (h, parts, expiry) for t, (h, parts, expiry) in self._tickets.items()
          if expiry > now and (h["learner"], parts is None) != (header["learner"], pull is None)}
      self._tickets[ticket] = (header, pull, now + self.ttl)
    return ticket.hex()

  def _take(self, ticket: bytes) -> tuple[dict | None, list | None]:
    with self._lock:
      header, parts, expiry = self._tickets.pop(ticket, (None, None, 0.0))
    return (header, parts) if expiry > time.monotonic() else (None, None)

  def _link(self, learner: int) -> link_lib.Link:
    return self.links[learner] if 0 <= learner < len(self.links) else link_lib.UNSHAPED

  def _accept(self) -> None:
    """The one thread that accepts connections and reads their tickets, without blocking and without a
    thread per connection, so that a flood of connect-and-close costs the syncer little CPU and GIL;
    only a connection that has sent its whole ticket gets a thread of its own (`_serve`)."""
    self._socket.setblocking(False)
    with selectors.DefaultSelector() as selector:
      selector.register(self._socket, selectors.EVENT_READ)
      while not self._closed:
        for key, _ in selector.select(timeout=ACCEPT_POLL_SECONDS):
          if key.fileobj is self._socket:
            self._accept_queued(selector)
          elif key.fileobj in self._unticketed:  # (Not evicted by an earlier event of this batch.)
            self._read_ticket(selector, key.fileobj)
        now = time.monotonic()
        for connection in [c for c, (_, deadline, _) in self._unticketed.items() if deadline <= now]:
          self._drop(selector, connection, "too_slow", f"no ticket within {HANDSHAKE_SECONDS:g} s")
      for connection in list(self._unticketed):
        self._drop(selector, connection)

  def _accept_queued(self, selector: selectors.BaseSelector) -> None:
    """Accepts every connection the kernel has queued; each one whose ticket has not arrived yet waits for
    it in the unticketed pool, evicting the oldest of its source (past the per-source limit) or of all
    (past the pool) first."""
    while not self._closed:
      try:
        raw, peer = self._socket.accept()
      except BlockingIOError:
        return
      except OSError as error:  # Closed by stop(), or out of file descriptors for a moment.
        if not self._closed:
          logging.warning("data channel accept failed (%s); retrying", error)
          time.sleep(0.1)
        return
      raw.setblocking(False)
      connection = raw if self.tls is None else self.tls.wrap_socket(raw, server_side=True,
                                                                     do_handshake_on_connect=False)
      self._unticketed[connection] = (peer[0], time.monotonic() + HANDSHAKE_SECONDS, bytearray())
      self._read_ticket(selector, connection)  # A learner sends its ticket with its connect, a flood its close.
      if connection in self._unticketed:  # Neither has arrived yet: wait for it.
        selector.register(connection, selectors.EVENT_READ)
        mine = [c for c, (source, _, _) in self._unticketed.items() if source == peer[0]]
        oldest = mine[0] if len(mine) > self.per_source else (
            next(iter(self._unticketed)) if len(self._unticketed) > self.max_unticketed else None)
        if oldest is not None:
          self._drop(selector, oldest, "evicted", "evicted: too many without a ticket")

  def _read_ticket(self, selector: selectors.BaseSelector, connection: socket.socket) -> None:
    """Reads what has arrived of a connection's ticket (after TLS's handshake, which the first read
    drives); once it is whole, the connection leaves the pool for a thread of its own."""
    ticket = self._unticketed[connection][2]
    try:
      while len(ticket) < TICKET_BYTES:
        received = connection.recv(TICKET_BYTES - len(ticket))
        if not received:
          self._drop(selector, connection, "truncated", f"closed after {len(ticket)} bytes of its ticket")
          return
        ticket += received
    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
      return  # The rest has not arrived yet.
    except OSError as error:  # Reset, or not TLS (ssl.SSLError is an OSError).
      self._drop(selector, connection, "truncated", f"failed before its ticket arrived: {error}")
      return
    self._leave_pool(selector, connection)
    try:
      threading.Thread(target=self._serve, args=(connection, bytes(ticket)), name="data-push", daemon=True).start()
    except RuntimeError:  # No thread to be had: refuse this one, keep serving.
      connection.close()

  def _drop(self, selector: selectors.BaseSelector, connection: socket.socket, reason: str | None = None,
            why: str = "") -> None:
    """Closes an unticketed connection, counting `reason` if given."""
    source = self._leave_pool(selector, connection)
    connection.close()
    if reason is not None:
      self.on_refusal(reason, f"data connection from {source} {why}")

  def _leave_pool(self, selector: selectors.BaseSelector, connection: socket.socket) -> str:
    """Takes a connection out of the unticketed pool (and the selector, where it waits there); returns its source."""
    if connection in selector.get_map():
      selector.unregister(connection)
    return self._unticketed.pop(connection)[0]

  def _serve(self, connection: socket.socket, ticket: bytes) -> None:
    """Serves a connection that has sent its ticket: its payload into the syncer, or Θ_p out."""
    replied = False  # After the reply, errors only concern the learner, which resends (same seq).
    try:
      connection.settimeout(HANDSHAKE_SECONDS)
      header, pull = self._take(ticket)
      if header is None:
        message = "unknown, used or expired data ticket: ask the syncer's PushTicket call for a new one"
        self.on_refusal("unauthenticated", message)
        replied = True
        connection.sendall(_frame(*refusal_reply(grpc.StatusCode.ABORTED, message)))
        _discard(connection)  # Closing on unread bytes would reset the connection before the reply is read.
        return
      if pull is not None:  # Θ_p to a learner: no reply to wait for; a broken connection is its to retry.
        replied = True
        connection.sendall(_frame(True, b""))
        link = self._link(header["learner"])
        send_parts(connection, pull, link, time.monotonic() + transfer_seconds(wire.encoded_size(pull), link))
        return
      deadline = time.monotonic() + transfer_seconds(header["payload_bytes"], self._link(header["learner"]))
      try:
        payload = self.spool(header["payload_bytes"], lambda view: _receive_into(connection, view, deadline))
      except RuntimeError as error:  # Its disk failed (durable.Stopped): the syncer stops, the learner resends.
        replied = True
        connection.sendall(_frame(*refusal_reply(grpc.StatusCode.UNAVAILABLE, str(error))))
        return
      try:
        with self._gate:
          ok, body = (refusal_reply(grpc.StatusCode.UNAVAILABLE, "the syncer is shutting down: resend to its restart")
                      if self._closed else self.receive(header, payload))
      finally:
        payload.close()
      replied = True
      connection.sendall(_frame(ok, body))
    except OSError as error:  # Broken or too slow (ssl.SSLError is an OSError).
      if not replied:
        self.on_refusal("too_slow" if isinstance(error, TimeoutError) else "truncated",
                        f"data connection failed before its payload arrived: {error}")
    finally:
      connection.close()


def send_parts(connection: socket.socket, parts: list[memoryview], link: link_lib.Link,
               deadline: float | None = None) -> None:
  """Sends the parts as they are (no copy), paced by `link`, all of them by `deadline` (monotonic)."""
  for piece in link.paced(parts):
    if deadline is not None:
      _time_out_at(connection, deadline)
    connection.sendall(piece)


@contextlib.contextmanager
def _ticketed_connection(address: tuple[str, int], ticket: str, timeout: float, tls: ssl.SSLContext | None,
                         server_hostname: str | None):
  """A connection to the data channel that has sent its ticket; a failure on it raises DataRefused."""
  try:
    with socket.create_connection(address, timeout=min(timeout, CONNECT_SECONDS)) as raw:
      raw.settimeout(timeout)
      with tls.wrap_socket(raw, server_hostname=server_hostname) if tls is not None else raw as connection:
        connection.sendall(bytes.fromhex(ticket))
        yield connection
  except OSError as error:  # Includes ssl.SSLError and timeouts.
    raise DataRefused(grpc.StatusCode.UNAVAILABLE, f"data channel to {address[0]}:{address[1]}: {error}") from error


def _read_reply(connection: socket.socket) -> bytes:
  """The syncer's framed answer: its body if ok, else the refusal raised as DataRefused."""
  ok, length = _REPLY.unpack(_receive(connection, _REPLY.size))
  if length > wire.MAX_HEADER_BYTES:
    raise ConnectionError(f"data channel reply of {length} bytes is over {wire.MAX_HEADER_BYTES}")
  body = bytes(_receive(connection, length))
  if ok:
    return body
  refusal = wire.parse_header(body, REFUSAL_SCHEMA)
  raise DataRefused(getattr(grpc.StatusCode, refusal["code"], grpc.StatusCode.UNKNOWN), refusal["details"])


def send_push(address: tuple[str, int], ticket: str, parts: list[memoryview], *, timeout: float,
              tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
              link: link_lib.Link = link_lib.UNSHAPED) -> bytes:
  """Sends a ticketed payload (paced by this learner's `link`); returns the push reply header, or raises
  DataRefused."""
  with _ticketed_connection(address, ticket, timeout, tls, server_hostname) as connection:
    send_parts(connection, parts, link)
    return _read_reply(connection)


def fetch_pull(address: tuple[str, int], ticket: str, payload_bytes: int, *, timeout: float,
               tls: ssl.SSLContext | None = None, server_hostname: str | None = None) -> np.ndarray:
  """Θ_p's encoded bytes for a pull ticket, received into one aligned buffer; raises DataRefused."""
  with _ticketed_connection(address, ticket, timeout, tls, server_hostname) as connection:
    _read_reply(connection)
    payload = wire.aligned_buffer(payload_bytes)
    _receive_into(connection, memoryview(payload))
    return payload

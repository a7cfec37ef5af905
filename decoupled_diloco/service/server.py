"""The syncer as a gRPC service: authentication, limits and streaming around `SyncerCore`.

The methods and their headers are listed in docs/exchange.md; what is refused, with which
gRPC status (each counted in `SyncerServer.rejections`), and the starvation defences in
docs/security.md. Why bulk slots: Join, Pull and Push move Θ or a payload, so each holds one
of `workers` slots (PER_CALLER_BULK per credential) taken without waiting, and Heartbeat and
the ticket calls always find one of CONTROL_WORKERS more threads: a stalled stream blocks
only its own learner.
"""

import collections
import ssl
import threading
import time
from concurrent import futures

from absl import logging
import grpc

from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import datachannel, fingerprint, limits, membership, reader, security, wire
from decoupled_diloco.service import link as link_lib
from decoupled_diloco.push import PushRejected

SERVICE = "decoupled_diloco.Syncer"
HEADER_SLACK = wire.MAX_HEADER_BYTES
JOIN_SCHEMA = {"learner": int, "fingerprint": dict}  # fingerprint: {config field: JSON value} (service/fingerprint.py)
PULL_SCHEMA = {"learner": int, "fragment": int, "have_version": int}
HEARTBEAT_SCHEMA = {"learner": int}
_REFUSABLE = (wire.WireError, PushRejected, core_lib.UnknownLearner, limits.OutOfBounds, core_lib.Stopped,
              fingerprint.Mismatch, membership.AtBarrier)
CONTROL_WORKERS = 4  # gRPC workers that bulk calls can never take: heartbeats and tickets never queue.
LOG_BURST = 20  # Refusals of one reason logged one by one per minute; the rest are summed up.
PER_CALLER_BULK = 2  # Bulk calls one learner credential may have open (a push and a pull, or a join).


class _Refused(Exception):
  """A call refused with `code`; carries the counter it increments."""

  def __init__(self, code: grpc.StatusCode, reason: str, message: str):
    super().__init__(message)
    self.code, self.reason = code, reason


def _refusal(error: Exception) -> _Refused:
  """The status a refused call gets: the wire's and the syncer's own errors mapped to codes."""
  if isinstance(error, _Refused):
    return error
  if isinstance(error, wire.PayloadTooLarge):
    return _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized", str(error))
  if isinstance(error, wire.WireError):
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(error))
  if isinstance(error, limits.OutOfBounds):
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, "out_of_bounds", str(error))
  if isinstance(error, fingerprint.Mismatch):  # Not retried: the learner stops with this line (learner_main).
    return _Refused(grpc.StatusCode.FAILED_PRECONDITION, "mismatch", str(error))
  if isinstance(error, membership.AtBarrier):  # Retryable: the learner asks again while the barrier waits.
    return _Refused(grpc.StatusCode.UNAVAILABLE, "at_barrier", str(error))
  if isinstance(error, core_lib.Stopped):  # Retryable: the learner waits for the restarted syncer.
    return _Refused(grpc.StatusCode.UNAVAILABLE, "stopped", str(error))
  if isinstance(error, core_lib.Fenced):  # Not retried: the replaced process stops with this line (learner_main).
    return _Refused(grpc.StatusCode.PERMISSION_DENIED, "fenced", str(error))
  if isinstance(error, PushRejected):
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, "rejected", str(error))
  return _Refused(grpc.StatusCode.NOT_FOUND, "unknown_learner", str(error))


def message_options(chunk_bytes: int) -> list[tuple[str, int]]:
  """gRPC channel/server options: no message larger than one chunk plus a header."""
  limit = chunk_bytes + HEADER_SLACK
  return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def keepalive_options(keepalive_seconds: float, timeout_seconds: float) -> list[tuple[str, int]]:
  """gRPC server options that keep connections honest (service.keepalive_seconds / keepalive_timeout_seconds).

  The server pings a connection after `keepalive_seconds` without traffic and closes it (ending
  its calls, freeing their slots) if the ping is not answered within `timeout_seconds`: a frozen
  or vanished peer holds nothing for longer than that. gRPC (1.5x+) waits for a ping's answer
  `grpc.http2.ping_timeout_ms` (default 60 s), not `keepalive_timeout_ms`: both are set, or a
  frozen peer would hold its calls a minute. A client pinging more often than every
  5 s without data is cut off after 2 strikes, and idle connections close after 5 minutes (a
  learner reconnects transparently).
  """
  return [("grpc.keepalive_time_ms", int(keepalive_seconds * 1000)),
          ("grpc.keepalive_timeout_ms", int(timeout_seconds * 1000)),
          ("grpc.http2.ping_timeout_ms", int(timeout_seconds * 1000)),
          ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000), ("grpc.http2.max_ping_strikes", 2),
          ("grpc.max_connection_idle_ms", 300_000)]


class _Deadline:
  """Cancels a call when its whole-call deadline passes (gRPC has no server-side deadline of its own)."""

  def __init__(self, context):
    self.context, self.expired, self._timer = context, False, None

  def set(self, seconds: float) -> None:
    """From now on the call has `seconds` left (replaces an earlier deadline)."""
    self.clear()
    self._timer = threading.Timer(seconds, self._expire)
    self._timer.daemon = True
    self._timer.start()

  def _expire(self) -> None:
    self.expired = True
    self.context.cancel()

  def clear(self) -> None:
    """No deadline any more (the call is done)."""
    if self._timer is not None:
      self._timer.cancel()


class SyncerServer:
  """Serves a `SyncerCore`; `start()` binds and returns the port.

  `data_port` >= 0 also opens the push data channel there (0 = a free port); -1 = pushes
  stream over gRPC only. `data_tls` must be given with `credentials`: no plaintext side door.
  `max_concurrent_rpcs`: calls in the server at once, running or queued for a thread; gRPC
  answers the ones beyond RESOURCE_EXHAUSTED at once (learners retry those), so a flood
  neither queues without bound nor takes memory. Keepalive: see `keepalive_options`.
  `links[i]` paces the Θ the data channel sends to learner i (link.py; none given: unshaped).
  `is_final()`: whether Θ can no longer move, for the evaluator (reader.Reader; none given: every learner heard
  the end).
  """

  def __init__(self, core: core_lib.SyncerCore, token: str, *, host: str, port: int, chunk_bytes: int,
               max_payload_bytes: int, credentials: grpc.ServerCredentials | None = None, workers: int = 8,
               data_port: int = -1, data_tls: ssl.SSLContext | None = None, data_timeout_seconds: float = 120.0,
               keepalive_seconds: float = 20.0, keepalive_timeout_seconds: float = 10.0, max_concurrent_rpcs: int = 256,
               links: tuple[link_lib.Link, ...] = (), is_final=None):
    if data_port >= 0 and (credentials is None) != (data_tls is None):
      raise ValueError("the data channel needs TLS exactly when gRPC has it: pass data_tls with credentials")
    self.core, self.chunk_bytes, self.max_payload_bytes = core, chunk_bytes, max_payload_bytes
    self.credentials = security.Credentials(token, core.num_learners)
    # The evaluator's read-only view (service.evaluate_on='evaluator'); `is_final`: see reader.Reader.
    self.reader = reader.Reader(core, is_final)
    self.rejections = collections.Counter()
    self._bulk_lock = threading.Lock()
    self._logged: dict[str, tuple[float, int]] = {}  # reason -> (start of its minute, refusals in it)
    self._bulk_free, self._bulk_by_caller = workers, collections.Counter()
    self.data = (datachannel.DataListener(host, data_port, self._receive_data, spool=core.store.spool,
                                          ttl_seconds=data_timeout_seconds, max_connections=workers, tls=data_tls,
                                          on_refusal=self._count, links=links) if data_port >= 0 else None)
    self._server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers + CONTROL_WORKERS), options=message_options(chunk_bytes) + [
            ("grpc.so_reuseport", 0)] + keepalive_options(keepalive_seconds, keepalive_timeout_seconds),
        maximum_concurrent_rpcs=max_concurrent_rpcs)
    handlers = {
        "Join": grpc.unary_stream_rpc_method_handler(self._guard(self._join, bulk=True)),
        "Pull": grpc.unary_stream_rpc_method_handler(self._guard(self._pull, bulk=True)),
        "Push": grpc.stream_unary_rpc_method_handler(self._guard(self._push, bulk=True)),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(self._guard(self._heartbeat)),
        "PushTicket": grpc.unary_unary_rpc_method_handler(self._guard(self._push_ticket)),
        "PullTicket": grpc.unary_unary_rpc_method_handler(self._guard(self._pull_ticket)),}
    self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = f"{host}:{port}"
    self.port = (self._server.add_secure_port(address, credentials)
                 if credentials is not None else self._server.add_insecure_port(address))
    if not self.port:
      raise OSError(f"cannot bind the syncer to {address}: is the port in use?")

  def start(self) -> int:
    """Starts serving (and the data channel, if any); returns the gRPC port."""
    if self.data is not None:
      self.data.start()
    self._server.start()
    return self.port

  def stop(self, grace: float = 1.0) -> None:
    """Stops accepting calls and lets running ones finish for `grace` seconds."""
    if self.data is not None:
      self.data.stop()
    self._server.stop(grace).wait()

  def _count(self, reason: str, message: str) -> None:
    """Counts a refusal and logs it: every one, up to LOG_BURST per reason a minute, so a flood
    cannot fill the syncer's disk with log lines (the counter keeps every one)."""
    now = time.monotonic()
    with self._bulk_lock:
      self.rejections[reason] += 1
      start, logged = self._logged.get(reason, (now, 0))
      if now - start >= 60.0:
        if logged > LOG_BURST:
          logging.warning("refused (%s) %d more times in the last minute (not logged one by one)", reason,
                          logged - LOG_BURST)
        start, logged = now, 0
      self._logged[reason] = (start, logged + 1)
    if logged < LOG_BURST:
      logging.warning("refused (%s) %s", reason, message)

  def _guard(self, method, bulk: bool = False):
    """Authenticates the call (and, for bulk calls, takes a slot), then maps the method's refusals
    onto gRPC statuses (counted). The method gets the caller: a learner id or ANY_LEARNER."""

    def handler(request, context):
      deadline = _Deadline(context)
      try:
        caller = self.credentials.caller(context.invocation_metadata())
        if caller is None:
          raise _Refused(
              grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
              "missing or wrong token: give the learner its credential (launch_local and launch_tpu do) "
              f"via ${security.TOKEN_ENV} or service.token_file")
        if bulk:
          self._take_bulk(caller, context, deadline)
        return method(request, context, caller, deadline)
      except (_Refused, *_REFUSABLE, grpc.RpcError) as error:
        # Cancelled by its deadline, the request stream breaks (RpcError) or just ends (a short payload):
        # which one is a race inside gRPC, so the deadline decides. A stream that broke otherwise: the
        # client left.
        if deadline.expired:
          refusal = _Refused(
              grpc.StatusCode.DEADLINE_EXCEEDED, "too_slow", "the call's stream was slower than "
              f"{datachannel.MIN_RATE_BYTES_PER_SECOND} bytes/s: cancelled")
        elif isinstance(error, grpc.RpcError):
          raise
        else:
          refusal = _refusal(error)
      if refusal.reason != "at_barrier":  # A join told to ask again is no refusal.
        self._count(refusal.reason, f"{method.__name__.strip('_')} call: {refusal}")
      context.abort(refusal.code, str(refusal))

    return handler

  def _take_bulk(self, caller: int, context, deadline: _Deadline) -> None:
    """A bulk slot for this call until it ends (refused UNAVAILABLE, which learners retry, if none is free)."""
    with self._bulk_lock:
      if self._bulk_free <= 0 or (caller != security.ANY_LEARNER and self._bulk_by_caller[caller] >= PER_CALLER_BULK):
        raise _Refused(grpc.StatusCode.UNAVAILABLE, "busy", f"no bulk slot free for learner {caller}: retry later")
      self._bulk_free -= 1
      self._bulk_by_caller[caller] += 1
    released = []

    def release():
      deadline.clear()
      with self._bulk_lock:
        if not released:
          released.append(True)
          self._bulk_free += 1
          self._bulk_by_caller[caller] -= 1

    if not context.add_callback(release):  # The call ended already.
      release()
    deadline.set(datachannel.transfer_seconds(0))  # Until the method sizes it from its bytes.

  @staticmethod
  def _authorize(caller: int, learner: int, read: bool = False) -> None:
    """A learner's credential acts for that learner only (the run secret for all); the evaluator's
    only reads (`read`: a Pull, PullTicket or Heartbeat), as itself."""
    if caller == security.EVALUATOR and not (read and reader.is_reader(learner)):
      raise _Refused(grpc.StatusCode.PERMISSION_DENIED, "read_only",
                     "the evaluator's credential may only read Θ (Pull, PullTicket, Heartbeat as the evaluator)")
    if caller not in (security.ANY_LEARNER, learner):
      raise _Refused(grpc.StatusCode.PERMISSION_DENIED, "impersonation",
                     f"the credential of learner {caller} cannot act as learner {learner}")

  def _reply_stream(self, status: dict, parts: list | None):
    """A status header, then Θ's chunks (if any), cut lazily as gRPC sends them."""
    yield wire.pack_header({**status, "payload_bytes": wire.encoded_size(parts) if parts else 0})
    if parts:
      yield from wire.chunks(parts, self.chunk_bytes)

  def _join(self, request: bytes, context, caller: int, deadline: _Deadline):
    del context
    header = wire.parse_header(request, JOIN_SCHEMA)
    self._authorize(caller, header["learner"])
    return self._sized(deadline, *self.core.join(header["learner"], time.time(), header["fingerprint"]))

  def _pull(self, request: bytes, context, caller: int, deadline: _Deadline):
    del context
    header = wire.parse_header(request, PULL_SCHEMA)
    self._authorize(caller, header["learner"], read=True)
    return self._sized(deadline, *self._read(header, deadline))

  def _read(self, header: dict, deadline: _Deadline | None = None) -> tuple[dict, list | None]:
    """A pull's (status, encoded Θ_fragment or None): a learner's, or the evaluator's (reader.py).
    A pull that waits for a grace window's merge (core.pull) has its call's `deadline` moved by that wait."""
    if reader.is_reader(header["learner"]):
      return self.reader.pull(header["fragment"], header["have_version"])
    on_wait = (lambda seconds: deadline.set(datachannel.transfer_seconds(0) + seconds)) if deadline else None
    return self.core.pull(header["learner"], header["fragment"], header["have_version"], time.time(), on_wait)

  def _sized(self, deadline: _Deadline, status: dict, parts: list | None):
    """The reply stream, with the call's deadline sized from the bytes it sends."""
    deadline.set(datachannel.transfer_seconds(wire.encoded_size(parts) if parts else 0))
    return self._reply_stream(status, parts)

  def _heartbeat(self, request: bytes, context, caller: int, deadline: _Deadline) -> bytes:
    del context, deadline
    header = wire.parse_header(request, HEARTBEAT_SCHEMA)
    self._authorize(caller, header["learner"], read=True)
    if reader.is_reader(header["learner"]):
      return wire.pack_header(self.reader.status())
    return wire.pack_header(self.core.heartbeat(header["learner"], time.time()))

  def _push(self, messages, context, caller: int, deadline: _Deadline) -> bytes:
    del context
    first = next(messages, None)
    if first is None:  # Sent empty, or cut by gRPC for an oversized first message.
      raise _Refused(
          grpc.StatusCode.INVALID_ARGUMENT, "empty",
          f"push stream is empty: send the push header first, every message <= chunk_bytes + "
          f"{HEADER_SLACK} bytes")
    header = self._push_header(first, caller)
    deadline.set(datachannel.transfer_seconds(header["payload_bytes"]))
    payload = self.core.store.spool(header["payload_bytes"],
                                    wire.reader(messages, header["payload_bytes"], self.chunk_bytes))
    try:  # Streamed into a spool file as on the data channel: never whole in memory.
      return wire.pack_header(self.core.push(header, payload, time.time()))
    finally:
      payload.close()

  def _push_header(self, data: bytes, caller: int) -> dict:
    """A push header checked as far as it can be before its payload: schema, caller, bounds, size."""
    header = wire.parse_header(data, core_lib.PUSH_SCHEMA)
    self._authorize(caller, header["learner"])
    self.core.check_bounds(header)
    wire.check_payload_size(header["payload_bytes"], self.max_payload_bytes)
    return header

  def _push_ticket(self, request: bytes, context, caller: int, deadline: _Deadline) -> bytes:
    """Checks a push header as Push would before its payload, then issues a data-channel ticket."""
    del context, deadline
    header = self._push_header(request, caller)
    self._require_data_channel("stream the payload with Push")
    return wire.pack_header({"ticket": self.data.ticket(header), "port": self.data.port})

  def _require_data_channel(self, instead: str) -> None:
    if self.data is None:
      raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "no_data_channel",
                     f"this syncer has no data channel (service.data_port=-1): {instead}")

  def _pull_ticket(self, request: bytes, context, caller: int, deadline: _Deadline) -> bytes:
    """A pull's status and, when Θ_fragment moved since `have_version`, a ticket to fetch its encoded
    parts (the core's one copy per version) on the data channel."""
    del context, deadline
    header = wire.parse_header(request, PULL_SCHEMA)
    self._authorize(caller, header["learner"], read=True)
    self._require_data_channel("pull Θ with Pull")
    status, parts = self._read(header)
    # A learner told 'done' stops and needs no Θ; and the syncer may exit once every learner heard it, before a
    # ticket for it could be used (a gRPC Pull carries both at once). The evaluator needs the final Θ: the syncer
    # waits for it (reader.Reader.has_final).
    parts = None if status["done"] and not reader.is_reader(header["learner"]) else parts
    ticket = self.data.ticket({"learner": header["learner"]}, pull=parts) if parts else ""
    return wire.pack_header(
        {**status, "payload_bytes": wire.encoded_size(parts) if parts else 0, "ticket": ticket, "port": self.data.port})

  def _receive_data(self, header: dict, payload) -> tuple[bool, bytes]:
    """A data-channel payload into the core: (True, push reply) or (False, the counted refusal).

    Whatever else fails is INTERNAL, as an uncaught error in a gRPC handler would be.
    """
    try:
      return True, wire.pack_header(self.core.push(header, payload, time.time()))
    except _REFUSABLE as error:
      refusal = _refusal(error)
    except Exception as error:  # pylint: disable=broad-except
      logging.exception("data-channel push failed inside the syncer")
      refusal = _Refused(grpc.StatusCode.INTERNAL, "internal", f"the syncer failed on this push: {error!r}")
    self._count(refusal.reason, f"data-channel push: {refusal}")
    return datachannel.refusal_reply(refusal.code, str(refusal))

"""The syncer as a gRPC service: authentication, limits and streaming around `SyncerCore`.

Methods of service `decoupled_diloco.Syncer` (bytes in, bytes out; see wire.py):
  Join      unary -> stream   {learner}                    -> status header, Θ chunks
  Pull      unary -> stream   {learner, fragment, have_version} -> status header, Θ_fragment chunks
                                                              (none if have_version is current)
  Push      stream -> unary   push header, payload chunks  -> {status, ...status header}
  PushTicket unary -> unary   push header                  -> {ticket, port}: send the payload on the
                                                              data channel instead (datachannel.py)
  Heartbeat unary -> unary    {learner}                    -> status header
A status header is {version, versions, acked_seq, steps_left, done, max_speed, incarnation, payload_bytes}; a push
reply's `status` is 'applied', 'dropped' (over-stale), 'duplicate' (already acked) or
'late' (after the run ended). Every refusal is a gRPC status with a message saying why,
and is counted in `SyncerServer.rejections`:
  UNAUTHENTICATED   missing or wrong token
  INVALID_ARGUMENT  malformed header or payload, NaN/Inf, wrong shapes or dtypes, bad versions
  RESOURCE_EXHAUSTED  payload or chunk over the limits
  NOT_FOUND         unknown learner id
Messages larger than chunk_bytes + 64 KiB are refused by gRPC itself (RESOURCE_EXHAUSTED
from gRPC), so no single message can exhaust memory. Those are counted (as 'empty') only
when gRPC had already started the push handler, whose stream then ends before its header.
Data-channel pushes are refused the same way, with the same codes and counters, plus
'truncated' (the connection ended before its payload did).
"""

import collections
import ssl
import time
from concurrent import futures

from absl import logging
import grpc

from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import datachannel, security, wire
from decoupled_diloco.syncer import PushRejected

SERVICE = "decoupled_diloco.Syncer"
HEADER_SLACK = wire.MAX_HEADER_BYTES
JOIN_SCHEMA = {"learner": int}
PULL_SCHEMA = {"learner": int, "fragment": int, "have_version": int}
HEARTBEAT_SCHEMA = {"learner": int}
_REFUSABLE = (wire.WireError, PushRejected, core_lib.UnknownLearner, core_lib.Stopped)


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
  if isinstance(error, core_lib.Stopped):  # Retryable: the learner waits for the restarted syncer.
    return _Refused(grpc.StatusCode.UNAVAILABLE, "stopped", str(error))
  if isinstance(error, PushRejected):
    return _Refused(grpc.StatusCode.INVALID_ARGUMENT, "rejected", str(error))
  return _Refused(grpc.StatusCode.NOT_FOUND, "unknown_learner", str(error))


def message_options(chunk_bytes: int) -> list[tuple[str, int]]:
  """gRPC channel/server options: no message larger than one chunk plus a header."""
  limit = chunk_bytes + HEADER_SLACK
  return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


class SyncerServer:
  """Serves a `SyncerCore`; `start()` binds and returns the port.

  `data_port` >= 0 also opens the push data channel there (0 = a free port); -1 = pushes
  stream over gRPC only. `data_tls` must be given with `credentials`: no plaintext side door.
  """

  def __init__(self, core: core_lib.SyncerCore, token: str, *, host: str, port: int, chunk_bytes: int,
               max_payload_bytes: int, credentials: grpc.ServerCredentials | None = None, workers: int = 8,
               data_port: int = -1, data_tls: ssl.SSLContext | None = None, data_timeout_seconds: float = 120.0):
    if data_port >= 0 and (credentials is None) != (data_tls is None):
      raise ValueError("the data channel needs TLS exactly when gRPC has it: pass data_tls with credentials")
    self.core, self.token, self.chunk_bytes, self.max_payload_bytes = core, token, chunk_bytes, max_payload_bytes
    self.rejections = collections.Counter()
    self.data = (datachannel.DataListener(host, data_port, self._receive_data, ttl_seconds=data_timeout_seconds,
                                          max_connections=workers, tls=data_tls, on_refusal=self._count)
                 if data_port >= 0 else None)
    self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                               options=message_options(chunk_bytes) + [("grpc.so_reuseport", 0)])
    handlers = {
        "Join": grpc.unary_stream_rpc_method_handler(self._guard(self._join)),
        "Pull": grpc.unary_stream_rpc_method_handler(self._guard(self._pull)),
        "Push": grpc.stream_unary_rpc_method_handler(self._guard(self._push)),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(self._guard(self._heartbeat)),
        "PushTicket": grpc.unary_unary_rpc_method_handler(self._guard(self._push_ticket)),
    }
    self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = f"{host}:{port}"
    self.port = (self._server.add_secure_port(address, credentials) if credentials is not None
                 else self._server.add_insecure_port(address))
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
    self.rejections[reason] += 1
    logging.warning("refused %s", message)

  def _guard(self, method):
    """Authenticates the call, then maps the method's refusals onto gRPC statuses (counted)."""

    def handler(request, context):
      try:
        if not security.token_matches(context.invocation_metadata(), self.token):
          raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                         "missing or wrong token: give the learner the syncer's token via "
                         f"${security.TOKEN_ENV} or service.token_file")
        return method(request, context)
      except (_Refused, *_REFUSABLE) as error:
        refusal = _refusal(error)
      self._count(refusal.reason, f"{method.__name__.strip('_')} call: {refusal}")
      context.abort(refusal.code, str(refusal))

    return handler

  def _reply_stream(self, status: dict, parts: list | None):
    """A status header, then Θ's chunks (if any), cut lazily as gRPC sends them."""
    yield wire.pack_header({**status, "payload_bytes": wire.encoded_size(parts) if parts else 0})
    if parts:
      yield from wire.chunks(parts, self.chunk_bytes)

  def _join(self, request: bytes, context):
    del context
    header = wire.parse_header(request, JOIN_SCHEMA)
    return self._reply_stream(*self.core.join(header["learner"], time.time()))

  def _pull(self, request: bytes, context):
    del context
    header = wire.parse_header(request, PULL_SCHEMA)
    return self._reply_stream(*self.core.pull(header["learner"], header["fragment"], header["have_version"],
                                              time.time()))

  def _heartbeat(self, request: bytes, context) -> bytes:
    del context
    header = wire.parse_header(request, HEARTBEAT_SCHEMA)
    return wire.pack_header(self.core.heartbeat(header["learner"], time.time()))

  def _push(self, messages, context) -> bytes:
    del context
    first = next(messages, None)
    if first is None:  # Sent empty, or cut by gRPC for an oversized first message.
      raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty",
                     f"push stream is empty: send the push header first, every message <= chunk_bytes + "
                     f"{HEADER_SLACK} bytes")
    header = wire.parse_header(first, core_lib.PUSH_SCHEMA)
    payload = wire.assemble(messages, header["payload_bytes"], self.max_payload_bytes, self.chunk_bytes)
    return wire.pack_header(self.core.push(header, payload, time.time()))

  def _push_ticket(self, request: bytes, context) -> bytes:
    """Checks a push header as Push would before its payload, then issues a data-channel ticket."""
    del context
    header = wire.parse_header(request, core_lib.PUSH_SCHEMA)
    self.core.require_known(header["learner"])
    wire.check_payload_size(header["payload_bytes"], self.max_payload_bytes)
    if self.data is None:
      raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "no_data_channel",
                     "this syncer has no data channel (service.data_port=-1): stream the payload with Push")
    return wire.pack_header({"ticket": self.data.ticket(header), "port": self.data.port})

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

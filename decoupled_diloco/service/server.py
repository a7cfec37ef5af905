"""The syncer as a gRPC service: authentication, limits and streaming around `SyncerCore`.

Methods of service `decoupled_diloco.Syncer` (bytes in, bytes out; see wire.py):
  Join      unary -> stream   {learner}                    -> status header, Θ chunks
  Pull      unary -> stream   {learner, have_version}      -> status header, Θ chunks (none if current)
  Push      stream -> unary   push header, payload chunks  -> {status, ...status header}
  Heartbeat unary -> unary    {learner}                    -> status header
A status header is {version, versions, acked_seq, steps_left, done, max_speed, payload_bytes}; a push
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
"""

import collections
import time
from concurrent import futures

from absl import logging
import grpc

from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import security, wire
from decoupled_diloco.syncer import PushRejected

SERVICE = "decoupled_diloco.Syncer"
HEADER_SLACK = wire.MAX_HEADER_BYTES
JOIN_SCHEMA = {"learner": int}
PULL_SCHEMA = {"learner": int, "have_version": int}
HEARTBEAT_SCHEMA = {"learner": int}


class _Refused(Exception):
  """A call refused with `code`; carries the counter it increments."""

  def __init__(self, code: grpc.StatusCode, reason: str, message: str):
    super().__init__(message)
    self.code, self.reason = code, reason


def message_options(chunk_bytes: int) -> list[tuple[str, int]]:
  """gRPC channel/server options: no message larger than one chunk plus a header."""
  limit = chunk_bytes + HEADER_SLACK
  return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


class SyncerServer:
  """Serves a `SyncerCore`; `start()` binds and returns the port."""

  def __init__(self, core: core_lib.SyncerCore, token: str, *, host: str, port: int, chunk_bytes: int,
               max_payload_bytes: int, credentials: grpc.ServerCredentials | None = None, workers: int = 8):
    self.core, self.token, self.chunk_bytes, self.max_payload_bytes = core, token, chunk_bytes, max_payload_bytes
    self.rejections = collections.Counter()
    self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                               options=message_options(chunk_bytes) + [("grpc.so_reuseport", 0)])
    handlers = {
        "Join": grpc.unary_stream_rpc_method_handler(self._guard(self._join)),
        "Pull": grpc.unary_stream_rpc_method_handler(self._guard(self._pull)),
        "Push": grpc.stream_unary_rpc_method_handler(self._guard(self._push)),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(self._guard(self._heartbeat)),
    }
    self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    address = f"{host}:{port}"
    self.port = (self._server.add_secure_port(address, credentials) if credentials is not None
                 else self._server.add_insecure_port(address))
    if not self.port:
      raise OSError(f"cannot bind the syncer to {address}: is the port in use?")

  def start(self) -> int:
    """Starts serving; returns the bound port."""
    self._server.start()
    return self.port

  def stop(self, grace: float = 1.0) -> None:
    """Stops accepting calls and lets running ones finish for `grace` seconds."""
    self._server.stop(grace).wait()

  def _guard(self, method):
    """Authenticates the call, then maps the method's refusals onto gRPC statuses (counted)."""

    def handler(request, context):
      try:
        if not security.token_matches(context.invocation_metadata(), self.token):
          raise _Refused(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                         "missing or wrong token: give the learner the syncer's token via "
                         f"${security.TOKEN_ENV} or service.token_file")
        return method(request, context)
      except _Refused as refusal:
        error = refusal
      except wire.PayloadTooLarge as too_large:
        error = _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized", str(too_large))
      except wire.WireError as malformed:
        error = _Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(malformed))
      except PushRejected as rejected:
        error = _Refused(grpc.StatusCode.INVALID_ARGUMENT, "rejected", str(rejected))
      except core_lib.UnknownLearner as unknown:
        error = _Refused(grpc.StatusCode.NOT_FOUND, "unknown_learner", str(unknown))
      self.rejections[error.reason] += 1
      logging.warning("refused %s call: %s", method.__name__.strip("_"), error)
      context.abort(error.code, str(error))

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
    return self._reply_stream(*self.core.pull(header["learner"], header["have_version"], time.time()))

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

"""A learner's side of the syncer service: calls with the token, chunked streams, retries.

Why retries are safe: a retried push is the same (learner, seq), so the syncer applies it
once even if the first attempt's ack was lost; so every call is retried with jittered
exponential backoff while the syncer is unreachable, for up to `retry_seconds`, and
refusals are not retried. Transfers go on the data channel when the syncer has one, falling
back to gRPC streams; replies from a replaced (older) syncer incarnation are never acted on.
Details: docs/exchange.md.
"""

import random
import ssl
import threading
import time

from absl import logging
import grpc
import jax
import ml_dtypes
import numpy as np

from decoupled_diloco.service import datachannel, membership, reader, security, server, wire
from decoupled_diloco.service import link as link_lib

# CANCELLED: what calls in flight get from a syncer that is shutting down (it restarts).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
             grpc.StatusCode.CANCELLED)
STATUS_SCHEMA = {
    "version": int, "versions": list, "acked_seq": int, "steps_left": int, "done": bool, "max_speed": float,
    "payload_bytes": int, "incarnation": int, "syncer_incarnation": int}
PUSH_REPLY_SCHEMA = {**{k: v for k, v in STATUS_SCHEMA.items() if k != "payload_bytes"}, "status": str}
TICKET_SCHEMA = {"ticket": str, "port": int}
# What gRPC answers a call beyond the server's maximum_concurrent_rpcs (service.max_concurrent_rpcs): retried.
CONCURRENCY_CAP_DETAILS = "Concurrent RPC limit exceeded"
# gRPC's own reconnect backoff grows to 120 s while the syncer is down, and a call fails at once
# until the channel's next attempt: a restarted syncer would wait minutes for its learners. This
# client retries with its own backoff (`backoff_delays`), so the channel's is kept as short.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 2_000)]
DATA_FAILURES_BEFORE_STREAMING = 2
DATA_CHANNEL_PAUSE_SECONDS = 30.0


class SyncerUnreachable(ConnectionError):
  """The syncer did not answer for longer than the retry budget."""


class LearnerStopped(ConnectionError):
  """The syncer will not take this learner process's pushes: it was replaced, or refused too often in a row."""


class StaleSyncer(ConnectionError):
  """A reply came from an older syncer incarnation than one this learner heard from: a replaced process."""


def backoff_delays(initial: float = 0.1, factor: float = 2.0, cap: float = 5.0, seed: int | None = None):
  """Endless delays initial·factor^k (capped), each jittered to [0.5, 1]×: learners do not retry in step."""
  rng = random.Random(seed)
  delay = initial
  while True:
    yield delay * rng.uniform(0.5, 1.0)
    delay = min(cap, delay * factor)


def widen(tree):
  """Θ as the model holds it: bfloat16 leaves (compression.downlink_format='bf16') back to float32.

  Why here: the syncer halves Θ's bytes on the wire, the learner's params stay float32, as
  the simulator's downlink does (round to bf16, then compute in fp32).
  """
  return jax.tree.map(lambda x: x.astype(np.float32) if x.dtype == ml_dtypes.bfloat16 else x, tree)


def _retryable(error: grpc.RpcError) -> bool:
  """A failure the syncer may not repeat: unreachable, restarting, or its call cap full (not a refusal)."""
  return error.code() in RETRYABLE or (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and
                                       CONCURRENCY_CAP_DETAILS in (error.details() or ""))


class SyncerClient:
  """Calls the syncer service at `target` ('host:port') as learner `learner` (or as the evaluator,
  security.EVALUATOR: pulls and heartbeats only, whose status headers add reader.EXTRA_FIELDS)."""

  def __init__(self, target: str, token: str, learner: int, *, chunk_bytes: int, timeout_seconds: float,
               retry_seconds: float, credentials: grpc.ChannelCredentials | None = None,
               max_payload_bytes: int = 1 << 40, data_channel: bool = False, data_tls: ssl.SSLContext | None = None,
               link: link_lib.Link = link_lib.UNSHAPED):
    if data_channel and (credentials is None) != (data_tls is None):
      raise ValueError("the data channel needs TLS exactly when gRPC has it: pass data_tls with credentials")
    options = server.message_options(chunk_bytes) + RECONNECT_OPTIONS
    self._channel = (grpc.secure_channel(target, credentials, options=options)
                     if credentials is not None else grpc.insecure_channel(target, options=options))
    self.learner, self.chunk_bytes, self.max_payload_bytes = learner, chunk_bytes, max_payload_bytes
    self.timeout, self.retry_seconds = timeout_seconds, retry_seconds
    self.data_channel, self.data_tls, self.link = data_channel, data_tls, link  # link paces this learner's pushes.
    self._data_channel_paused_until = 0.0  # time.monotonic() before which pushes stream (see the module doc).
    self.host = target.rsplit(":", 1)[0].strip("[]")  # The data channel is on the syncer's host.
    self._metadata = security.call_metadata(token)
    self.incarnation = 0  # This process's incarnation of the learner, from its Join: every push carries it.
    self._status_schema = {**STATUS_SCHEMA, **(reader.EXTRA_FIELDS if reader.is_reader(learner) else {})}
    method = f"/{server.SERVICE}/"
    self._join = self._channel.unary_stream(method + "Join")
    self._pull = self._channel.unary_stream(method + "Pull")
    self._push = self._channel.stream_unary(method + "Push")
    self._heartbeat = self._channel.unary_unary(method + "Heartbeat")
    self._push_ticket = self._channel.unary_unary(method + "PushTicket")
    self._pull_ticket = self._channel.unary_unary(method + "PullTicket")
    self.retries = 0  # Attempts that failed and were retried (a metric of the learner).
    self.syncer_incarnation = 0  # The newest syncer incarnation a reply came from (0: none yet).
    self.syncer_restarts = 0  # Times a reply came from a newer syncer incarnation than the one before.
    self._abandoned = threading.Event()
    self.pulled_bytes = 0  # Θ bytes received by pulls (as encoded on the wire, in the downlink format).

  def _retrying(self, call):
    """`call()` until it succeeds, is refused, or the syncer stays unreachable too long.

    A join the syncer holds at its start barrier (membership.AtBarrier) asks again as long as the barrier
    waits: each such answer restarts the retry budget (the barrier's own timeout bounds the wait), and the first
    is logged, so that a learner started long before its peers says why it waits and never gives up first.
    """
    give_up = time.monotonic() + self.retry_seconds
    told = False
    for delay in backoff_delays():
      try:
        return call()
      except (grpc.RpcError, StaleSyncer) as error:
        details = str(error) if isinstance(error, StaleSyncer) else error.details()
        if isinstance(error, grpc.RpcError) and not _retryable(error):
          raise
        if (details or "").startswith(membership.AT_BARRIER):
          if not told:
            logging.warning("learner %d is %s", self.learner, details)
          told, give_up = True, time.monotonic() + self.retry_seconds
        if time.monotonic() + delay > give_up:
          raise SyncerUnreachable(f"syncer unreachable for {self.retry_seconds:.0f}s: {details}") from error
        self.retries += 1
        if self._abandoned.wait(delay):
          raise SyncerUnreachable(f"abandoned after the run ended: {details}") from error

  def abandon(self) -> None:
    """Stops retrying: a call still retrying gives up (SyncerUnreachable) at its next attempt.

    Why: once the syncer said the run is done it may exit as soon as every learner heard it,
    and an exchange still in flight then (a streaming learner's other fragments) would
    otherwise retry for retry_seconds before the learner process can end.
    """
    self._abandoned.set()

  def _observe(self, status: dict) -> dict:
    """Checks and notes the syncer incarnation a reply came from (see the module doc); returns `status`."""
    incarnation = status["syncer_incarnation"]
    if incarnation < self.syncer_incarnation:
      raise StaleSyncer(f"a reply from syncer incarnation {incarnation}, older than incarnation "
                        f"{self.syncer_incarnation} this learner heard from: a replaced syncer still answers")
    if self.syncer_incarnation and incarnation > self.syncer_incarnation:
      self.syncer_restarts += 1
      logging.warning("the syncer restarted (incarnation %d -> %d): carrying on from its log", self.syncer_incarnation,
                      incarnation)
    self.syncer_incarnation = incarnation
    return status

  def _read_stream(self, replies) -> tuple[dict, object]:
    """(status, decoded Θ or None) from a Join/Pull reply stream."""
    status = self._observe(wire.parse_header(next(replies), self._status_schema))
    if not status["payload_bytes"]:
      return status, None
    data = wire.assemble(replies, status["payload_bytes"], self.max_payload_bytes, self.chunk_bytes)
    return status, self._theta(data)

  def _theta(self, data: np.ndarray):
    """Θ as the model holds it, from the bytes a pull received (counted)."""
    self.pulled_bytes += data.nbytes
    return widen(wire.decode(data))

  def _data_or_grpc(self, ticketed, streamed, failures: list[int], what: str):
    """One attempt of a transfer: `ticketed()` on the data channel, or `streamed()` over gRPC when the
    syncer has none or the data channel is paused (see the module doc)."""
    if not self.data_channel or time.monotonic() < self._data_channel_paused_until:
      return streamed()
    try:
      return ticketed()
    except datachannel.DataRefused as error:
      if error.code() in RETRYABLE:
        failures[0] += 1
        if failures[0] >= DATA_FAILURES_BEFORE_STREAMING and self.link is link_lib.UNSHAPED:
          self._data_channel_paused_until = time.monotonic() + DATA_CHANNEL_PAUSE_SECONDS
          logging.warning("%s: the data channel failed %d times (%s); streaming it over gRPC", what, failures[0],
                          error.details())
      raise
    except grpc.RpcError as error:  # From the ticket call.
      if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        raise
      self.data_channel = False  # This syncer has none (service.data_port=-1): stream from now on.
      return streamed()

  def join(self, fingerprint: dict | None = None) -> tuple[dict, object]:
    """(status, Θ): the current global params, version and this learner's last acked seq.

    `fingerprint`: this learner's config as service/fingerprint.py takes it (None: not compared); one the
    syncer's differs from is refused FAILED_PRECONDITION, not retried.
    """
    request = wire.pack_header({"learner": self.learner, "fingerprint": fingerprint or {}})
    status, theta = self._retrying(
        lambda: self._read_stream(self._join(request, timeout=self.timeout, metadata=self._metadata)))
    self.incarnation = status["incarnation"]
    return status, theta

  def pull(self, have_version: int, fragment: int = 0) -> tuple[dict, object]:
    """(status, Θ_fragment), or (status, None) when `have_version` of it is still current."""
    request = wire.pack_header({"learner": self.learner, "fragment": fragment, "have_version": have_version})

    def ticketed():
      reply = wire.parse_header(self._pull_ticket(request, timeout=self.timeout, metadata=self._metadata),
                                {**self._status_schema, **TICKET_SCHEMA})
      status = self._observe({k: reply[k] for k in self._status_schema})
      if not reply["payload_bytes"]:
        return status, None
      wire.check_payload_size(reply["payload_bytes"], self.max_payload_bytes)
      return status, self._theta(
          datachannel.fetch_pull((self.host, reply["port"]), reply["ticket"], reply["payload_bytes"],
                                 timeout=self.timeout, tls=self.data_tls, server_hostname=self.host))

    def streamed():
      return self._read_stream(self._pull(request, timeout=self.timeout, metadata=self._metadata))

    failures = [0]
    return self._retrying(lambda: self._data_or_grpc(ticketed, streamed, failures, f"pull of fragment {fragment}"))

  def heartbeat(self, retry: bool = True) -> dict:
    """Renews this learner's lease; returns the run's status (one attempt only if not `retry`)."""
    request = wire.pack_header({"learner": self.learner})
    call = lambda: self._observe(
        wire.parse_header(  # noqa: E731
            self._heartbeat(request, timeout=self.timeout, metadata=self._metadata), {
                k: v for k, v in self._status_schema.items() if k != "payload_bytes"}))
    return self._retrying(call) if retry else call()

  def push(self, seq: int, delta, *, base_version: int, tokens: int, local_steps: int, compute_seconds: float,
           fragment: int = 0, budget_steps: int | None = None, budget_tokens: int | None = None) -> dict:
    """Sends one push (resent as the same seq until acknowledged); returns the syncer's reply.

    budget_steps / budget_tokens: what the run's budget counts of it (admission.budget_share); by
    default its local_steps / tokens, right for a learner that counts every push from the last.
    """
    parts = wire.encode(delta)
    header = wire.pack_header({
        "learner": self.learner, "seq": seq, "base_version": base_version, "fragment": fragment, "tokens": tokens,
        "local_steps": local_steps, "compute_seconds": float(compute_seconds),
        "payload_bytes": wire.encoded_size(parts), "incarnation": self.incarnation,
        "budget_steps": local_steps if budget_steps is None else budget_steps,
        "budget_tokens": tokens if budget_tokens is None else budget_tokens})

    def messages():
      yield header
      yield from wire.chunks(parts, self.chunk_bytes)

    def streamed():
      return self._push(messages(), timeout=self.timeout, metadata=self._metadata)

    def ticketed():
      ticket = wire.parse_header(self._push_ticket(header, timeout=self.timeout, metadata=self._metadata),
                                 TICKET_SCHEMA)
      return datachannel.send_push((self.host, ticket["port"]), ticket["ticket"], parts, timeout=self.timeout,
                                   tls=self.data_tls, server_hostname=self.host, link=self.link)

    failures = [0]
    return self._retrying(lambda: self._observe(
        wire.parse_header(self._data_or_grpc(ticketed, streamed, failures, f"push {seq}"), PUSH_REPLY_SCHEMA)))

  def close(self) -> None:
    """Closes the channel."""
    self._channel.close()


def refusals_in_a_row(learner: int, reply: dict, before: int, most: int) -> int:
  """The syncer's refusals of this process's pushes in a row after `reply` (`before`: up to the last one).

  Raises client.LearnerStopped (the process exits 1 with its line) once the syncer will not take this process's
  pushes: at once when it was replaced (fenced), else at `most` (service.max_refusals_in_a_row). Why: a learner
  whose every push is refused only burns its hardware (the syncer counts it out of the quorum meanwhile), and a
  replaced one pushed on for good before (216 refused pushes in 30 s).
  """
  if reply["status"] == "fenced":
    raise LearnerStopped(f"learner {learner} stops: {reply['details']}")
  count = before + 1 if reply["status"] == "refused" else 0
  if count >= most:
    raise LearnerStopped(f"learner {learner} stops: the syncer refused its last {count} pushes in a row "
                         f"(service.max_refusals_in_a_row); the last: {reply['details']}")
  return count

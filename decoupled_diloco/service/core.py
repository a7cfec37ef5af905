"""The syncer service's state, transport-free: exactly-once pushes, durability, leases, budget.

`SyncerCore` wraps the same `Syncer` state machine the simulator drives and adds what a
networked syncer needs, behind one lock (gRPC handlers run on a thread pool):
  * exactly-once pushes: each carries (learner, seq); a seq at or below the learner's
    acknowledged one is answered 'duplicate' and not applied again;
  * durability: validate → log (fsync) → apply → ack, and every `checkpoint_every_merges`
    merges a verified orbax checkpoint (Θ, outer state, versions, acked seqs, incarnations,
    budget, counters) starts a new log segment; a restart restores the newest usable
    checkpoint and replays the log, so nothing acked is lost and versions never go back.
    The log already makes an ack durable, so checkpoints (periodic and the final one) are
    taken by `tick`, never on the way to a learner's reply; a failed checkpoint is retried,
    a failed log append stops the service (fail-stop: `Stopped`);
  * fencing: each Join starts a new incarnation of its learner, and pushes of older ones
    are refused;
  * leases: a learner silent for `lease_seconds` leaves the quorum (so the others are not
    held up by the dead) and rejoins with its next call;
  * the run's budget: outer_steps × inner_steps × M inner steps, counted from pushes (each
    step once, in the first push after it: see `budget_share`);
  * streaming: pushes and pulls name their fragment; Θ_p is sent alone, encoded once per
    version of that fragment;
  * measured speeds: an EMA of each learner's steps per compute-second, from its pushes;
    every reply carries the fastest other learner's (`max_speed`), DyLU's reference for
    sizing rounds (a learner knows its own speed better than its pushes tell).

Replay is exact except for the grace window's duration estimates (not checkpointed): merges
(and lease changes) are logged too, so the same pushes are applied, in the same order.
"""

import collections
import dataclasses
import os
import threading
import time

from absl import logging
import jax
import numpy as np

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import compression
from decoupled_diloco import policy as policy_lib
from decoupled_diloco.service import limits as limits_lib
from decoupled_diloco.service import wal, wire
from decoupled_diloco.syncer import MergeReport, Push, PushRejected, Syncer, SyncerState

CHECKPOINT_RETRY_SECONDS = 10.0  # Between attempts after a checkpoint save failed (e.g. a full disk).
PUSH_SCHEMA = {"learner": int, "seq": int, "base_version": int, "fragment": int, "tokens": int, "local_steps": int,
               "compute_seconds": float, "payload_bytes": int, "budget_steps": int, "budget_tokens": int,
               "incarnation": int}


def budget_share(header: dict) -> tuple[int, int]:
  """(steps, tokens) a push adds to the run's count: its `budget_steps` / `budget_tokens`.

  Why not local_steps / tokens: those count from the receipt of Θ_p (the weight of the Δ),
  so the τ steps before a landing are in no push, and with P fragments each other step is in
  P pushes. A learner instead counts every step it took once, in the first push after it
  (of any fragment; its last pushes leave nothing uncounted).
  """
  return header["budget_steps"], header["budget_tokens"]


class UnknownLearner(LookupError):
  """A call names a learner id outside the run's range."""


class Stopped(RuntimeError):
  """The syncer can no longer make new state durable (its log failed): it serves nothing more."""


def _check_float32(delta, learner: int) -> None:
  """An uncompressed pseudo-gradient must arrive as float32, checked on the wire arrays.

  Why here: the syncer moves pushes onto its device first, and with 64-bit types off that
  move silently turns float64 into float32, so the syncer's own dtype check cannot see it.
  """
  if isinstance(delta, compression.Compressed):
    return  # Its payload arrays are checked against the format by compression.decode.
  for path, leaf in jax.tree_util.tree_leaves_with_path(delta):
    dtype = getattr(leaf, "dtype", type(leaf).__name__)
    if dtype != np.float32:
      raise PushRejected(f"push from learner {learner} rejected: {jax.tree_util.keystr(path)} arrived as {dtype}; "
                         "uncompressed pseudo-gradients travel as float32")


class SyncerCore:
  """Thread-safe service state around a `Syncer`; every public method takes the lock."""

  def __init__(self, syncer: Syncer, num_learners: int, budget_steps: int, directory: str, *,
               checkpoint_every_merges: int, lease_seconds: float, metadata: dict, emit=None, on_merge=None,
               limits: limits_lib.PushLimits | None = None, downlink_format: str = "fp32",
               truncate_corrupt_log: bool = False, min_learners_to_start: int = 1,
               start_timeout_seconds: float = 600.0, wal_dir: str | None = None):
    self.syncer, self.num_learners, self.budget_steps = syncer, num_learners, budget_steps
    # Start barrier: joins wait until this many learners joined (1 = none), or the timeout since start().
    self.min_learners_to_start = min_learners_to_start
    self.start_timeout_seconds = start_timeout_seconds
    self.joined: set[int] = set()
    self.started = False  # Barrier passed (or timed out), or a push arrived (a restarted syncer's learners).
    self.checkpoint_every, self.lease_seconds = checkpoint_every_merges, lease_seconds
    self.metadata = metadata  # Static facts saved with every checkpoint (e.g. the config).
    self.limits = limits  # Bounds on push headers (None: only the syncer's own checks).
    self.downlink_dtype = np.float32 if downlink_format == "fp32" else jax.numpy.bfloat16  # Θ on the wire.
    self.emit = emit or (lambda record: None)  # Metric records (push, outer).
    self.on_merge = on_merge or (lambda version, params, now: None)
    self.lock = threading.RLock()
    self._start_condition = threading.Condition(self.lock)
    self.quorum_setting = syncer.settings.quorum
    self.acked = {m: -1 for m in range(num_learners)}
    # Each Join starts a new incarnation of that learner; pushes from older ones are refused.
    self.incarnations = {m: 0 for m in range(num_learners)}
    self.steps_done = self.tokens_done = 0
    self.done = False
    self.start_time: float | None = None
    self.last_seen: dict[int, float] = {}
    self.told_done: set[int] = set()
    self.speeds = policy_lib.SpeedTracker([0.0] * num_learners)  # Steps per second (0 = no push yet).
    self.counts = {"applied": 0, "dropped": 0, "duplicates": 0, "late": 0, "rejected": 0, "excluded": 0}
    self.refused = collections.Counter()  # Refused calls by reason: the server counts into it.
    # (fragment, log record, payload) of pushes since their fragment's last merge (pending or
    # dropped): what a checkpoint carries over into the next log segment.
    self._unabsorbed: list[tuple[int, dict, bytes]] = []
    self._merges_since_checkpoint = 0
    self._checkpoint_due = False  # A checkpoint for the next tick (periodic, or the run's end).
    self._checkpoint_retry_at = 0.0  # After a failed save, not before this time.
    self._fragment_cache: dict[int, tuple[int, list]] = {}  # fragment -> (its version, encoded Θ_p)
    self.checkpointer = checkpoint_lib.Checkpointer(os.path.join(directory, "checkpoints"), max_to_keep=2)
    self.wal_dir = wal_dir or os.path.join(directory, "wal")  # Local disk (fsync): service.local_dir for gs://.
    self.log: wal.Log | None = None
    self.truncate_corrupt_log = truncate_corrupt_log  # The operator gives up records after a corrupt one.
    self.failed: Stopped | None = None  # Set once the log failed: fail-stop, the process must exit.

  # Start, restore, checkpoint.
  def start(self, now: float) -> int | None:
    """Restores the latest checkpoint and replays the log (or checkpoints a fresh run at 0).

    Returns the restored checkpoint step, None for a fresh run.
    """
    with self.lock:
      step = self.checkpointer.latest_step()
      self.last_seen = {m: now for m in range(self.num_learners)}
      if step is None:
        self.start_time = now
        self.log = wal.Log(self.wal_dir, 0)
        self._checkpoint(now)
        return None
      step, state, meta = self._restore_usable()
      self.syncer.restore(SyncerState(state["params"], state["opt_state"], tuple(meta["versions"])))
      self.acked = {m: meta["acked"].get(str(m), -1) for m in range(self.num_learners)}
      self.incarnations.update({int(m): n for m, n in meta.get("incarnations", {}).items()})
      self.steps_done, self.tokens_done, self.done = meta["steps_done"], meta["tokens_done"], meta["done"]
      self.start_time = meta["start_time"]
      self.counts.update(meta.get("counts", {}))  # Replay adds the pushes applied after the checkpoint.
      self.refused.update(meta.get("refused", {}))
      self.syncer.restore_estimates(meta["estimates"])  # Before the replay, which goes on updating them.
      wal.recover(self.wal_dir, self.truncate_corrupt_log)
      self._replay(meta["segment"], step)
      self.log = wal.Log(self.wal_dir, max(wal.segments(self.wal_dir), default=meta["segment"]))
      if self.steps_done >= self.budget_steps and not self.done:  # Crashed between the last push and the end.
        self._finish(now)
      logging.info("syncer restored checkpoint %d and replayed its log: version %d, %d of %d steps done", step,
                   self.syncer.version, self.steps_done, self.budget_steps)
      return step

  def _restore_usable(self) -> tuple[int, dict, dict]:
    """(step, state, metadata) of the newest checkpoint that restores, matches its digests and has its log.

    An unusable newer one is moved aside (`<step>.corrupt`): the one before it plus the log
    (kept back to the oldest checkpoint) reach the same state. None usable: CorruptCheckpoint.
    """
    abstract = checkpoint_lib.abstract_like(self._state_trees())
    problems = {}
    for step in reversed(self.checkpointer.all_steps()):
      try:
        state, meta = self.checkpointer.restore(step, abstract)
        if meta["segment"] not in wal.segments(self.wal_dir):
          raise checkpoint_lib.CorruptCheckpoint(f"its log segment {meta['segment']} is missing from {self.wal_dir}")
      except Exception as error:  # pylint: disable=broad-except  # Damaged files fail orbax in many ways.
        problems[step] = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        logging.error("syncer checkpoint %d is not usable (%s); trying the one before it plus the log", step,
                      problems[step])
        continue
      for bad in problems:  # Moved only now: an older one restored, so the layout is not what failed.
        logging.error("syncer checkpoint %d moved to %s", bad, self.checkpointer.quarantine(bad))
      return step, state, meta
    raise checkpoint_lib.CorruptCheckpoint("no usable syncer checkpoint (" + "; ".join(
        f"step {step}: {problem}" for step, problem in problems.items()) + f"): restore {self.checkpointer.directory} "
                                           "from a backup, or start a new --workdir")

  def _state_trees(self) -> dict:
    state = self.syncer.state
    return {"params": state.params, "opt_state": state.opt_state}

  def _checkpoint(self, now: float) -> None:
    """Rotates the log onto the pushes Θ does not hold yet, then saves the checkpoint that points there."""
    version = self.syncer.version
    if self.checkpointer.latest_step() == version:
      return  # The log already holds everything since that checkpoint.
    carried = [(dict(record, carried=True), payload) for _, record, payload in self._unabsorbed]
    self._durably(self.log.rotate, version, carried)
    pending_steps = sum(budget_share(r["header"])[0] for r, _ in carried)
    pending_tokens = sum(budget_share(r["header"])[1] for r, _ in carried)
    meta = {**self.metadata, "versions": list(self.syncer.versions), "segment": version, "done": self.done,
            "acked": {str(m): s for m, s in self.acked.items()}, "start_time": self.start_time,
            "steps_done": self.steps_done - pending_steps, "tokens_done": self.tokens_done - pending_tokens,
            "counts": self.counts, "refused": dict(self.refused), "estimates": self.syncer.estimates,
            "incarnations": {str(m): n for m, n in self.incarnations.items()}}
    try:
      self.checkpointer.save(version, self._state_trees(), meta)
    except (OSError, ValueError) as error:  # A full disk (orbax reports tensorstore's I/O errors as ValueError):
      # the log holds everything, so serve on and retry.
      self._checkpoint_retry_at = now + CHECKPOINT_RETRY_SECONDS
      logging.error("syncer checkpoint at version %d failed (%s): serving on from the log, retrying in %.0fs",
                    version, error, CHECKPOINT_RETRY_SECONDS)
      return
    self.log.drop_before(min(self.checkpointer.all_steps()))  # Each kept checkpoint can be replayed from.
    self._merges_since_checkpoint, self._checkpoint_due = 0, False
    logging.info("syncer checkpoint at version %d (%d pushes carried in the log)", version, len(carried))

  def checkpoint(self, now: float) -> None:
    """A checkpoint now (SIGTERM, end of run), unless the latest one already is this version."""
    with self.lock:
      self._checkpoint(now)

  def _replay(self, first_segment: int, step: int) -> None:
    """Re-applies logged pushes, merges and lease changes after checkpoint `step`, each once.

    Metric records after `step` were dropped at the restart; replayed pushes write theirs
    again (a carried push only if its record was one of those dropped).
    """
    applied = set()
    for segment in wal.segments(self.wal_dir):
      if segment < first_segment:
        continue
      for record, payload in wal.read_segment(wal.segment_path(self.wal_dir, segment)):
        if record["type"] == "push":
          header = record["header"]
          key = (header["learner"], header["seq"])
          if key in applied or not (record.get("carried") or header["seq"] > self.acked[header["learner"]]):
            continue
          applied.add(key)
          self._apply(header, wire.decode(payload), payload, record["now"], replay=True,
                      record_it=not record.get("carried") or record["outer_step"] > step,
                      count_it=not record.get("carried"))
        elif record["type"] == "merge":
          self._after_merges([self.syncer.merge(record["now"], record["fragment"])], record["now"], replay=True)
        elif record["type"] == "live":
          self._set_live(record["learners"])
        elif record["type"] == "done":
          self.done = True
        elif record["type"] == "told":
          self.told_done.add(record["learner"])
        elif record["type"] == "join":
          self.incarnations[record["learner"]] = record["incarnation"]

  def _durably(self, write, *args) -> None:
    """Runs a log write; if it fails, the syncer stops serving (fail-stop) rather than run ahead of its log.

    Nothing the failed write was about has been applied or acknowledged (validate → log →
    apply → ack), so a restart from the log holds every acknowledged push.
    """
    try:
      write(*args)
    except wal.LogWriteError as error:
      self.failed = Stopped(f"the syncer stopped serving: {error}; free the disk, then restart it with "
                            "--config.resume=True (nothing acknowledged is lost)")
      logging.error("%s", self.failed)
      raise self.failed from error

  def _serving(self) -> None:
    """Raises Stopped once the log has failed: no call may see state the log does not hold."""
    if self.failed is not None:
      raise self.failed

  # Calls.
  def require_known(self, learner: int) -> None:
    """Raises UnknownLearner for an id outside the run (no state read beyond the run's size)."""
    if not 0 <= learner < self.num_learners:
      raise UnknownLearner(f"unknown learner {learner}: this run has learners 0..{self.num_learners - 1}")

  def _check_learner(self, learner: int, now: float) -> None:
    """Unknown ids are refused; a known one renews its lease (and rejoins if it was excluded)."""
    self.require_known(learner)
    self.last_seen[learner] = now
    self._readmit(learner)

  def _readmit(self, learner: int) -> list[int] | None:
    """A lease-excluded learner back in the quorum (logged); returns the live set before, None if it was in."""
    if learner in self.syncer.learners:
      return None
    before = sorted(self.syncer.learners)
    logging.info("learner %d rejoins the quorum", learner)
    self._log_live(sorted(self.syncer.learners | {learner}))
    return before

  def check_bounds(self, header: dict) -> None:
    """Raises UnknownLearner or limits.OutOfBounds for a push header no honest learner sends (PushTicket
    checks it too, before any payload byte moves)."""
    with self.lock:
      self.require_known(header["learner"])
      if self.limits is not None:
        limits_lib.check_push(self.limits, header, self.acked[header["learner"]],
                              max(0, self.budget_steps - self.steps_done))

  def status(self, learner: int, tells_done: bool = True) -> dict:
    """Reply fields every call returns: where the run is and how much work is left.

    `tells_done`: whether the learner acts on this reply. A heartbeat's reply is read by a
    side thread, so the syncer keeps serving until the learner's own loop heard it.
    """
    if self.done and tells_done and learner not in self.told_done:
      self.told_done.add(learner)
      self._durably(self.log.append, {"type": "told", "learner": learner})  # A restarted syncer need not wait for it.
    others = [speed for m, speed in enumerate(self.speeds.speeds) if m != learner]
    return {"version": self.syncer.version, "versions": list(self.syncer.versions),
            "acked_seq": self.acked[learner], "steps_left": max(0, self.budget_steps - self.steps_done),
            "done": self.done, "max_speed": max(others, default=0.0), "incarnation": self.incarnations[learner]}

  def join(self, learner: int, now: float) -> tuple[dict, list]:
    """(status, encoded Θ): what a (re)starting learner needs, its last acked seq and new incarnation included.

    Before the run starts a join waits at the start barrier (a learner that compiles slowly
    would otherwise find a short budget spent by the others): until min_learners_to_start
    learners joined, or start_timeout_seconds after the syncer started, which is reported
    (a warning and a 'start' record naming who had joined). The lease of a waiting learner
    is kept alive. The incarnation is logged before the reply: from then on, pushes of the
    learner's earlier processes (a frozen predecessor that wakes up) are refused.
    """
    with self.lock:
      self._serving()
      self._check_learner(learner, now)
      self.joined.add(learner)
      while not self.started:
        left = self.start_time + self.start_timeout_seconds - time.time()
        if len(self.joined) >= self.min_learners_to_start or left <= 0:
          self._start(timed_out=len(self.joined) < self.min_learners_to_start)
          break
        self._start_condition.wait(min(left, 1.0))
        self.last_seen[learner] = time.time()
      self._serving()
      incarnation = self.incarnations[learner] + 1
      self._durably(self.log.append, {"type": "join", "learner": learner, "incarnation": incarnation})
      self.incarnations[learner] = incarnation
      return self.status(learner), wire.encode(self._downlink(self.syncer.params))

  def _start(self, timed_out: bool) -> None:
    """The barrier opens: every waiting join returns."""
    self.started = True
    self._start_condition.notify_all()
    if timed_out:
      logging.warning("start barrier timed out after %.0fs with learners %s of the %d required: starting without "
                      "the others", self.start_timeout_seconds, sorted(self.joined), self.min_learners_to_start)
    self.emit({"kind": "start", "outer_step": self.syncer.version, "learners": sorted(self.joined),
               "required": self.min_learners_to_start, "timed_out": int(timed_out),
               "wall_time": time.time() - self.start_time})

  def pull(self, learner: int, fragment: int, have_version: int, now: float) -> tuple[dict, list | None]:
    """(status, encoded Θ_fragment, or None when the learner already has its version)."""
    with self.lock:
      self._serving()
      self._check_learner(learner, now)
      versions = self.syncer.versions
      if not 0 <= fragment < len(versions):
        raise wire.WireError(f"fragment {fragment} is not in [0, {len(versions)}): this run syncs "
                             f"{len(versions)} fragments")
      parts = None if have_version == versions[fragment] else self._fragment_parts(fragment)
      return self.status(learner), parts

  def heartbeat(self, learner: int, now: float) -> dict:
    """Renews the lease of a learner that is busy computing."""
    with self.lock:
      self._serving()
      self._check_learner(learner, now)
      return self.status(learner, tells_done=False)

  def _fragment_parts(self, fragment: int) -> list:
    """Θ_p encoded once per version of p, however many learners pull it."""
    version = self.syncer.versions[fragment]
    cached_version, parts = self._fragment_cache.get(fragment, (None, None))
    if cached_version != version:
      parts = wire.encode(self._downlink(self.syncer.fragment_params(fragment)))
      self._fragment_cache[fragment] = (version, parts)
    return parts

  def _downlink(self, tree):
    """Θ as compression.downlink_format sends it (bf16 halves the bytes; learners widen it back to fp32)."""
    if self.downlink_dtype == np.float32:
      return tree
    return jax.tree.map(lambda x: np.asarray(x).astype(self.downlink_dtype), tree)

  def push(self, header: dict, payload: bytes, now: float) -> dict:
    """Applies one push at most once; returns the reply (status + `status()` fields).

    Raises UnknownLearner, limits.OutOfBounds, wire.WireError or PushRejected (counted, state
    untouched; a refused push neither renews its learner's lease nor brings it back into the quorum),
    or Stopped. The payload is decoded before the lock is taken: other calls need not wait for it.
    """
    try:
      self.require_known(header["learner"])
      delta = wire.decode(payload)
      _check_float32(delta, header["learner"])
    except (UnknownLearner, wire.WireError, PushRejected):
      with self.lock:
        self.counts["rejected"] += 1
      raise
    with self.lock:
      self._serving()
      try:
        learner, seq = header["learner"], header["seq"]
        self.check_bounds(header)
        if header["incarnation"] != self.incarnations[learner]:
          raise PushRejected(f"push from learner {learner} rejected: it comes from incarnation "
                             f"{header['incarnation']}, but incarnation {self.incarnations[learner]} of learner "
                             f"{learner} has joined since (a replaced process: stop it)")
        if seq <= self.acked[learner] or (self.done and header["budget_steps"] > 0):
          self._check_learner(learner, now)
          if seq <= self.acked[learner]:
            self.counts["duplicates"] += 1
            return {"status": "duplicate", **self.status(learner)}
          self.counts["late"] += 1  # Steps the budget did not count (see budget_share).
          self.acked[learner] = seq
          return {"status": "late", **self.status(learner)}
        excluded_live = self._readmit(learner)  # Receive needs it in the quorum; undone if refused.
        try:
          accepted = self._apply(header, delta, payload, now, replay=False)
        except PushRejected:
          if excluded_live is not None:
            self._log_live(excluded_live)
          raise
        self.last_seen[learner] = now
        if self.done:  # After the end: the progress on its fragment of steps the budget counted already.
          self._after_merges(self.syncer.flush(now), now, replay=False, log=True)
          self._checkpoint_due = True
      except (UnknownLearner, limits_lib.OutOfBounds, wire.WireError, PushRejected):
        self.counts["rejected"] += 1
        raise
      return {"status": "applied" if accepted else "dropped", **self.status(learner)}

  def _apply(self, header: dict, delta, payload, now: float, replay: bool, record_it: bool = True,
             count_it: bool = True) -> bool:
    """validate → log (fsync) → receive() → bookkeeping → merges; the ack may follow once this returns.

    A push that fails validation is never logged; one that is logged is applied (replay
    validated it the first time, so it does not check it again).

    The push's metric record carries outer_step = version + 1 before it arrived: the first
    merge that can hold it, so a restart from checkpoint v keeps exactly the records of
    pushes that checkpoint holds.
    """
    syncer = self.syncer
    self.started = True  # Learners that push have started (e.g. a restarted syncer's).
    outer_step = syncer.version + 1
    fragment_version = syncer.versions[header["fragment"]] if 0 <= header["fragment"] < len(syncer.versions) else 0
    push = Push(header["learner"], delta, header["base_version"], header["tokens"], header["local_steps"],
                header["compute_seconds"], header["fragment"], header["payload_bytes"])
    record = {"type": "push", "header": header, "now": now, "outer_step": outer_step}
    if not replay:
      push = syncer.check(push)
      self._durably(self.log.append, record, payload)
    accepted, report = syncer.receive(push, now, checked=not replay)
    self.acked[header["learner"]] = max(self.acked[header["learner"]], header["seq"])
    steps, tokens = budget_share(header)
    self.steps_done, self.tokens_done = self.steps_done + steps, self.tokens_done + tokens
    if header["local_steps"] > 0 and header["compute_seconds"] > 0:
      self.speeds.observe(header["learner"], header["compute_seconds"] / header["local_steps"])
    if count_it:  # A carried push is in the checkpoint's counts already.
      self.counts["applied" if accepted else "dropped"] += 1
    self._unabsorbed.append((header["fragment"], record, payload))  # Dropped ones too: their records.
    if record_it:
      self.emit({"kind": "push", "outer_step": outer_step, "learner": header["learner"], "seq": header["seq"],
               "fragment": header["fragment"], "local_steps": header["local_steps"], "tokens": header["tokens"],
               "staleness": fragment_version - header["base_version"], "accepted": int(accepted),
               "wire_bytes": header["payload_bytes"], "wall_time": now - self.start_time, "replayed": int(replay)})
    self._after_merges([report], now, replay)
    if self.steps_done >= self.budget_steps and not self.done and not replay:
      self._finish(now)
    return accepted

  def _after_merges(self, reports: list[MergeReport | None], now: float, replay: bool, log: bool = False) -> None:
    """Bookkeeping of merges: absorbed pushes, records, evals, periodic checkpoints."""
    for report in reports:
      if report is None:
        continue
      if log and not replay:
        self._durably(self.log.append, {"type": "merge", "fragment": report.fragment, "now": now})
      self._unabsorbed = [entry for entry in self._unabsorbed if entry[0] != report.fragment]
      self._merges_since_checkpoint += 1
      self.emit({"kind": "outer", "outer_step": report.version, "fragment": report.fragment,
                 "learners": list(report.learners), "staleness": list(report.staleness),
                 "weights": list(report.weights), "tokens": self.tokens_done, "wall_time": now - self.start_time,
                 "replayed": int(replay)})
      if not replay:
        self.on_merge(report.version, self.syncer.params, now)
    if not replay and self._merges_since_checkpoint >= self.checkpoint_every:
      self._checkpoint_due = True

  def _finish(self, now: float) -> None:
    """Budget spent: merge what is pending, mark the run done (in the log) and checkpoint it at the next tick."""
    self._after_merges(self.syncer.flush(now), now, replay=False, log=True)
    self.done = True
    # Logged: the flag survives a crash before the next tick's checkpoint (or if this version has one already).
    self._durably(self.log.append, {"type": "done", "now": now})
    self._checkpoint_due = True
    logging.info("token budget spent at version %d: the run is done", self.syncer.version)

  # Time-driven work.
  def tick(self, now: float) -> None:
    """Closes due grace windows, excludes learners whose lease ran out, takes a due checkpoint."""
    with self.lock:
      self._serving()
      if not self.done:
        self._expire(now)
      if self._checkpoint_due and now >= self._checkpoint_retry_at:
        self._checkpoint(now)

  def _expire(self, now: float) -> None:
    """Time-driven merges: grace windows that closed, and quorums lowered by expired leases."""
    self._after_merges(self.syncer.on_deadline(now), now, replay=False, log=True)
    live = sorted(m for m in self.syncer.learners if now - self.last_seen.get(m, now) <= self.lease_seconds)
    if live and len(live) < len(self.syncer.learners):
      for m in sorted(set(self.syncer.learners) - set(live)):
        logging.warning("learner %d silent for over %.1fs: excluded from the quorum until it calls again", m,
                        self.lease_seconds)
        self.counts["excluded"] += 1
      self._log_live(live)
      self._after_merges(self._merge_if_quorum(now), now, replay=False, log=True)

  def _log_live(self, learners: list[int]) -> None:
    self._durably(self.log.append, {"type": "live", "learners": learners})
    self._set_live(learners)

  def _set_live(self, learners: list[int]) -> None:
    """Only live learners count towards the quorum (a quorum larger than them is lowered to them)."""
    self.syncer.learners = frozenset(learners)
    quorum = min(self.quorum_setting, len(learners)) if self.quorum_setting else 0
    self.syncer.settings = dataclasses.replace(self.syncer.settings, quorum=quorum)

  def _merge_if_quorum(self, now: float) -> list[MergeReport]:
    """Merges fragments whose pending pushes meet the (just lowered) quorum."""
    return [self.syncer.merge(now, p) for p, f in enumerate(self.syncer.fragments)
            if f.pending and len({push.learner for push in f.pending}) >= self.syncer.quorum]

  def all_told_done(self) -> bool:
    """Every learner has heard that the run is over (the service may stop)."""
    with self.lock:
      return self.done and len(self.told_done) == self.num_learners

  def close(self) -> None:
    """Closes the log and the checkpointer."""
    with self.lock:
      if self.log is not None:
        self.log.close()
      self.checkpointer.close()

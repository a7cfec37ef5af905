"""The syncer service's state, transport-free: exactly-once pushes, durability, leases, budget.

`SyncerCore` wraps the same `Syncer` state machine the simulator drives and adds what a
networked syncer needs, behind one lock (gRPC handlers run on a thread pool):
  * exactly-once pushes: each carries (learner, seq); a seq at or below the learner's
    acknowledged one is answered 'duplicate' and not applied again;
  * durability: an applied push is in the write-ahead log (fsync'ed) before it is acked,
    and every `checkpoint_every_merges` merges an orbax checkpoint (Θ, outer state,
    versions, acked seqs, budget) starts a new log segment; a restart restores the latest
    checkpoint and replays the log, so nothing acked is lost and versions never go back.
    The log already makes an ack durable, so checkpoints (periodic and the final one) are
    taken by `tick`, never on the way to a learner's reply;
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
from decoupled_diloco.service import wal, wire
from decoupled_diloco.syncer import MergeReport, Push, PushRejected, Syncer, SyncerState

PUSH_SCHEMA = {"learner": int, "seq": int, "base_version": int, "fragment": int, "tokens": int, "local_steps": int,
               "compute_seconds": float, "payload_bytes": int, "budget_steps": int, "budget_tokens": int}


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
               min_learners_to_start: int = 1, start_timeout_seconds: float = 600.0):
    self.syncer, self.num_learners, self.budget_steps = syncer, num_learners, budget_steps
    # Start barrier: joins wait until this many learners joined (1 = none), or the timeout since start().
    self.min_learners_to_start = min_learners_to_start
    self.start_timeout_seconds = start_timeout_seconds
    self.joined: set[int] = set()
    self.started = False  # Barrier passed (or timed out), or a push arrived (a restarted syncer's learners).
    self.checkpoint_every, self.lease_seconds = checkpoint_every_merges, lease_seconds
    self.metadata = metadata  # Static facts saved with every checkpoint (e.g. the config).
    self.emit = emit or (lambda record: None)  # Metric records (push, outer).
    self.on_merge = on_merge or (lambda version, params, now: None)
    self.lock = threading.RLock()
    self._start_condition = threading.Condition(self.lock)
    self.quorum_setting = syncer.settings.quorum
    self.acked = {m: -1 for m in range(num_learners)}
    self.steps_done = self.tokens_done = 0
    self.done = False
    self.start_time: float | None = None
    self.last_seen: dict[int, float] = {}
    self.told_done: set[int] = set()
    self.speeds = policy_lib.SpeedTracker([0.0] * num_learners)  # Steps per second (0 = no push yet).
    self.counts = {"applied": 0, "dropped": 0, "duplicates": 0, "late": 0, "rejected": 0, "excluded": 0}
    # (fragment, log record, payload) of pushes since their fragment's last merge (pending or
    # dropped): what a checkpoint carries over into the next log segment.
    self._unabsorbed: list[tuple[int, dict, bytes]] = []
    self._merges_since_checkpoint = 0
    self._checkpoint_due = False  # A checkpoint for the next tick (periodic, or the run's end).
    self._fragment_cache: dict[int, tuple[int, list]] = {}  # fragment -> (its version, encoded Θ_p)
    self.checkpointer = checkpoint_lib.Checkpointer(os.path.join(directory, "checkpoints"), max_to_keep=2)
    self.wal_dir = os.path.join(directory, "wal")
    self.log: wal.Log | None = None

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
      abstract = checkpoint_lib.abstract_like(self._state_trees())
      state, meta = self.checkpointer.restore(step, abstract)
      self.syncer.restore(SyncerState(state["params"], state["opt_state"], tuple(meta["versions"])))
      self.acked = {m: meta["acked"].get(str(m), -1) for m in range(self.num_learners)}
      self.steps_done, self.tokens_done, self.done = meta["steps_done"], meta["tokens_done"], meta["done"]
      self.start_time = meta["start_time"]
      self.syncer.restore_estimates(meta["estimates"])  # Before the replay, which goes on updating them.
      self._replay(meta["segment"], step)
      self.log = wal.Log(self.wal_dir, max(wal.segments(self.wal_dir), default=meta["segment"]))
      if self.steps_done >= self.budget_steps and not self.done:  # Crashed between the last push and the end.
        self._finish(now)
      logging.info("syncer restored checkpoint %d and replayed its log: version %d, %d of %d steps done", step,
                   self.syncer.version, self.steps_done, self.budget_steps)
      return step

  def _state_trees(self) -> dict:
    state = self.syncer.state
    return {"params": state.params, "opt_state": state.opt_state}

  def _checkpoint(self, now: float) -> None:
    """Rotates the log onto the pushes Θ does not hold yet, then saves the checkpoint that points there."""
    version = self.syncer.version
    if self.checkpointer.latest_step() == version:
      return  # The log already holds everything since that checkpoint.
    carried = [(dict(record, carried=True), payload) for _, record, payload in self._unabsorbed]
    self.log.rotate(version, carried)
    pending_steps = sum(budget_share(r["header"])[0] for r, _ in carried)
    pending_tokens = sum(budget_share(r["header"])[1] for r, _ in carried)
    meta = {**self.metadata, "versions": list(self.syncer.versions), "segment": version, "done": self.done,
            "acked": {str(m): s for m, s in self.acked.items()}, "start_time": self.start_time,
            "estimates": self.syncer.estimates,
            "steps_done": self.steps_done - pending_steps, "tokens_done": self.tokens_done - pending_tokens}
    self.checkpointer.save(version, self._state_trees(), meta)
    self.log.drop_before(version)
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
                      record_it=not record.get("carried") or record["outer_step"] > step)
        elif record["type"] == "merge":
          self._after_merges([self.syncer.merge(record["now"], record["fragment"])], record["now"], replay=True)
        elif record["type"] == "live":
          self._set_live(record["learners"])
        elif record["type"] == "done":
          self.done = True
        elif record["type"] == "told":
          self.told_done.add(record["learner"])

  # Calls.
  def require_known(self, learner: int) -> None:
    """Raises UnknownLearner for an id outside the run (no state read beyond the run's size)."""
    if not 0 <= learner < self.num_learners:
      raise UnknownLearner(f"unknown learner {learner}: this run has learners 0..{self.num_learners - 1}")

  def _check_learner(self, learner: int, now: float) -> None:
    """Unknown ids are refused; a known one renews its lease (and rejoins if it was excluded)."""
    self.require_known(learner)
    self.last_seen[learner] = now
    if learner not in self.syncer.learners:
      logging.info("learner %d rejoins the quorum", learner)
      self._log_live(sorted(self.syncer.learners | {learner}))

  def status(self, learner: int, tells_done: bool = True) -> dict:
    """Reply fields every call returns: where the run is and how much work is left.

    `tells_done`: whether the learner acts on this reply. A heartbeat's reply is read by a
    side thread, so the syncer keeps serving until the learner's own loop heard it.
    """
    if self.done and tells_done and learner not in self.told_done:
      self.told_done.add(learner)
      self.log.append({"type": "told", "learner": learner})  # A restarted syncer need not wait for it.
    others = [speed for m, speed in enumerate(self.speeds.speeds) if m != learner]
    return {"version": self.syncer.version, "versions": list(self.syncer.versions),
            "acked_seq": self.acked[learner], "steps_left": max(0, self.budget_steps - self.steps_done),
            "done": self.done, "max_speed": max(others, default=0.0)}

  def join(self, learner: int, now: float) -> tuple[dict, list]:
    """(status, encoded Θ): what a (re)starting learner needs, its last acked seq included.

    Before the run starts a join waits at the start barrier (a learner that compiles slowly
    would otherwise find a short budget spent by the others): until min_learners_to_start
    learners joined, or start_timeout_seconds after the syncer started, which is reported
    (a warning and a 'start' record naming who had joined). The lease of a waiting learner
    is kept alive.
    """
    with self.lock:
      self._check_learner(learner, now)
      self.joined.add(learner)
      while not self.started:
        left = self.start_time + self.start_timeout_seconds - time.time()
        if len(self.joined) >= self.min_learners_to_start or left <= 0:
          self._start(timed_out=len(self.joined) < self.min_learners_to_start)
          break
        self._start_condition.wait(min(left, 1.0))
        self.last_seen[learner] = time.time()
      return self.status(learner), wire.encode(self.syncer.params)

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
      self._check_learner(learner, now)
      return self.status(learner, tells_done=False)

  def _fragment_parts(self, fragment: int) -> list:
    """Θ_p encoded once per version of p, however many learners pull it."""
    version = self.syncer.versions[fragment]
    cached_version, parts = self._fragment_cache.get(fragment, (None, None))
    if cached_version != version:
      parts = wire.encode(self.syncer.fragment_params(fragment))
      self._fragment_cache[fragment] = (version, parts)
    return parts

  def push(self, header: dict, payload: bytes, now: float) -> dict:
    """Applies one push at most once; returns the reply (status + `status()` fields).

    Raises UnknownLearner, wire.WireError or PushRejected (counted, state untouched).
    """
    with self.lock:
      try:
        self._check_learner(header["learner"], now)
        learner, seq = header["learner"], header["seq"]
        if seq <= self.acked[learner]:
          self.counts["duplicates"] += 1
          return {"status": "duplicate", **self.status(learner)}
        if self.done and header["budget_steps"] > 0:  # Steps the budget did not count (see budget_share).
          self.counts["late"] += 1
          self.acked[learner] = seq
          return {"status": "late", **self.status(learner)}
        delta = wire.decode(payload)
        _check_float32(delta, learner)
        accepted = self._apply(header, delta, payload, now, replay=False)
        if self.done:  # After the end: the progress on its fragment of steps the budget counted already.
          self._after_merges(self.syncer.flush(now), now, replay=False, log=True)
          self._checkpoint_due = True
      except (UnknownLearner, wire.WireError, PushRejected):
        self.counts["rejected"] += 1
        raise
      return {"status": "applied" if accepted else "dropped", **self.status(learner)}

  def _apply(self, header: dict, delta, payload, now: float, replay: bool, record_it: bool = True) -> bool:
    """receive() → log (fsync) → bookkeeping → merges; the ack may follow once this returns.

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
    accepted, report = syncer.receive(push, now)
    record = {"type": "push", "header": header, "now": now, "outer_step": outer_step}
    if not replay:
      self.log.append(record, payload)
    self.acked[header["learner"]] = max(self.acked[header["learner"]], header["seq"])
    steps, tokens = budget_share(header)
    self.steps_done, self.tokens_done = self.steps_done + steps, self.tokens_done + tokens
    if header["local_steps"] > 0 and header["compute_seconds"] > 0:
      self.speeds.observe(header["learner"], header["compute_seconds"] / header["local_steps"])
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
        self.log.append({"type": "merge", "fragment": report.fragment, "now": now})
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
    self.log.append({"type": "done", "now": now})
    self._checkpoint_due = True
    logging.info("token budget spent at version %d: the run is done", self.syncer.version)

  # Time-driven work.
  def tick(self, now: float) -> None:
    """Closes due grace windows, excludes learners whose lease ran out, takes a due checkpoint."""
    with self.lock:
      if not self.done:
        self._expire(now)
      if self._checkpoint_due:
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
    self.log.append({"type": "live", "learners": learners})
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

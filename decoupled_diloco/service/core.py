"""The syncer service's state machine, transport-free: exactly-once pushes, merges, leases, budget.

`SyncerCore` wraps the same `Syncer` state machine the simulator drives and adds what a
networked syncer needs, behind one lock (gRPC handlers run on a thread pool):
  * exactly-once pushes: each carries (learner, seq); a seq at or below the learner's
    acknowledged one is answered 'duplicate' and not applied again;
  * durability (`durable.Store`): validate → log (fsync) → apply → ack; every
    `checkpoint_every_merges` merges, at the next `tick` (never on the way to a reply), a
    checkpoint of Θ, outer state, versions, acked seqs, incarnations, budget and counters
    starts a new log segment; a restart restores it and replays the log, so nothing acked is
    lost and versions never go back. A failed log append stops the service (`Stopped`);
  * admission (`admission`, `limits`): known learners, bounded headers, and fencing: each Join
    starts a new incarnation of its learner, and pushes of older ones are refused (`admission.Fenced`);
  * membership: start barrier, leases (silent `lease_seconds`: out of the quorum till it calls), grace waits;
    a learner whose push is refused leaves the quorum until a push of it is applied (or it joins again), so
    a learner refused for good never holds a synchronous round up; a refused push's seq moves the learner's
    seq window on (`_refused`), so refusals never lock out its later valid pushes;
  * the run's budget: outer_steps × inner_steps × M inner steps, each counted once (`admission.budget_share`);
  * streaming: pushes and pulls name their fragment (`pullcache`: Θ_p encoded once per version);
  * measured speeds (`pace`): the median of each learner's recent steps per compute-second; every reply carries
    the fastest other learner's (`max_speed`), DyLU's reference (a learner knows its own better);
  * incarnations: every reply names this start of the syncer (`durable.Store.next_incarnation`).

Replay is exact: merges and lease changes are logged too, and the grace window's estimates checkpointed.
"""

import collections
import math
import threading
import time

from absl import logging

from decoupled_diloco.service import admission, durable, membership, pace, pullcache, recovery, wal, wire
from decoupled_diloco.service import fingerprint as fingerprint_lib
from decoupled_diloco.service import limits as limits_lib
from decoupled_diloco.push import Push, PushRejected
from decoupled_diloco.syncer import MergeReport, Syncer

# Re-exported: the server, syncer_main and tests name them as the core's.
PUSH_SCHEMA, Stopped, UnknownLearner, Fenced = (admission.PUSH_SCHEMA, durable.Stopped, admission.UnknownLearner,
                                                admission.Fenced)


class SyncerCore(recovery.Recovery):
  """Thread-safe service state around a `Syncer`; every public method takes the lock.

  Restore, replay and checkpoint (`start`, `checkpoint`) are `recovery.Recovery`'s.
  """

  def __init__(self, syncer: Syncer, num_learners: int, budget_steps: int, directory: str, *,
               checkpoint_every_merges: int, lease_seconds: float, metadata: dict, emit=None, on_merge=None,
               limits: limits_lib.PushLimits | None = None, downlink_format: str = "fp32",
               truncate_corrupt_log: bool = False, min_learners_to_start: int = 1, start_timeout_seconds: float = 600.0,
               local_dir: str | None = None, merge_wait_seconds: float = 0.0, barrier_call_seconds: float = math.inf):
    self.syncer, self.num_learners, self.budget_steps = syncer, num_learners, budget_steps
    self.checkpoint_every, self.lease_seconds = checkpoint_every_merges, lease_seconds
    self.metadata = metadata  # Static facts saved with every checkpoint (e.g. the config).
    # What a joining learner's config must agree on (None: no config to compare with).
    self.fingerprint = fingerprint_lib.of(metadata["config"]) if "config" in metadata else None
    self.limits = limits  # Bounds on push headers (None: only the syncer's own checks).
    self.pulls = pullcache.PullCache(downlink_format)
    self.emit = emit or (lambda record: None)  # Metric records (push, outer).
    self.on_merge = on_merge or (lambda version, params, now: None)
    self.lock = threading.RLock()
    self.grace = membership.GraceWaits(self.lock, merge_wait_seconds=merge_wait_seconds)  # > 0: synchronous.
    self.barrier = membership.StartBarrier(self.lock, min_learners_to_start, start_timeout_seconds,
                                           barrier_call_seconds)
    self.quorum_setting = syncer.settings.quorum
    self.acked = {m: -1 for m in range(num_learners)}
    # Per learner, the highest seq of a refused push within its window: the window starts at max(acked, this).
    self.refused_seq = {m: -1 for m in range(num_learners)}
    self.benched: set[int] = set()  # Out of the quorum since a refused push: calls alone do not bring them back.
    # Learners whose seqs and incarnation the syncer lost with its log (`recovery`): their next push resets both.
    self.resync: set[int] = set()
    self.incarnations = {m: 0 for m in range(num_learners)}  # Each Join starts a new one (admission).
    self.steps_done = self.tokens_done = 0
    self.done = False
    self.start_time: float | None = None
    self.last_seen: dict[int, float] = {}
    self.told_done: set[int] = set()
    self.pace = pace.Pace(limits.declared_speeds if limits and limits.declared_speeds else (1.0,) * num_learners)
    self.counts = {"applied": 0, "dropped": 0, "duplicates": 0, "late": 0, "rejected": 0, "excluded": 0}
    self.refused = collections.Counter()  # Refused calls by reason: the server counts into it.
    # (fragment, log record, where its payload lies in the log) of pushes since their fragment's last merge:
    # a checkpoint carries them. Their bytes are not kept: a merge's pushes are folded and released.
    self._unabsorbed: list[tuple[int, dict, wal.Location]] = []
    self._merges_since_checkpoint = 0
    self._checkpoint_due = False  # A checkpoint for the next tick (periodic, or the run's end).
    self.store = durable.Store(directory, truncate_corrupt_log, local_dir)
    self.syncer_incarnation = 0  # This process's start on the workdir (start() takes the next one).
    self.restored_at: float | None = None  # When start() had restored a checkpoint, before the replay (time.time()).

  # Calls.
  def _check_learner(self, learner: int, now: float) -> None:
    """Unknown ids are refused; a known one renews its lease (and rejoins if its lease had excluded it)."""
    admission.require_known(learner, self.num_learners)
    self.last_seen[learner] = now
    if learner not in self.benched:
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
    """Raises UnknownLearner or limits.OutOfBounds for a push header no honest learner sends: the one bounds check
    of a push, run by the server on its header before any payload byte moves (Push and PushTicket alike), so `push`
    does not repeat it. A resent push the syncer holds already (a duplicate) changes nothing: its pace is not checked
    again (the learner's pace moved on since)."""
    with self.lock:
      learner, now, limits = header["learner"], time.time(), self.limits
      admission.require_known(learner, self.num_learners)
      if limits is None:
        return
      most = limits.round_steps
      if limits.time_budget:
        most = self.pace.most_steps(learner, header["fragment"], now, most, max(most, self.budget_steps))
      # After a lost log the learner's seqs ran on past what the syncer restored: its next push re-bases them.
      base = header["seq"] if learner in self.resync else max(self.acked[learner], self.refused_seq[learner])
      try:
        limits_lib.check_push(limits, header, base, most)
        if header["seq"] > self.acked[learner]:
          self.pace.check(header, now, self.start_time)
      except limits_lib.OutOfBounds:
        self._refused(header, now)
        raise

  def _fence(self, header: dict) -> None:
    """Raises admission.Fenced for a push of a replaced process of its learner. After a lost log (`resync`) a
    newer incarnation than the restored one joined after that checkpoint: it is taken (logged as its join)."""
    learner, incarnation = header["learner"], header["incarnation"]
    if learner in self.resync and incarnation > self.incarnations[learner]:
      self.store.append({"type": "join", "learner": learner, "incarnation": incarnation})
      self.incarnations[learner] = incarnation
    admission.check_incarnation(header, self.incarnations[learner])

  def _refused(self, header: dict, now: float) -> None:
    """Bookkeeping of a refused push of the learner's current process (another incarnation's changes nothing): its
    seq moves the learner's seq window on (a seq beyond the window does not), and the learner leaves the quorum
    until a push of it is applied.

    Why: the learner spent that seq, so without the first, 64 refusals in a row refused every later push; and in
    synchronous DiLoCo a learner whose pushes are refused held every round up while its heartbeats kept it in.
    """
    learner = header["learner"]
    if header["incarnation"] != self.incarnations[learner]:
      return
    base = max(self.acked[learner], self.refused_seq[learner])
    if header["seq"] <= base + (self.limits.seq_window if self.limits else limits_lib.SEQ_WINDOW):
      self.refused_seq[learner] = max(self.refused_seq[learner], header["seq"])
    if learner in self.benched:
      return
    self.benched.add(learner)
    if learner in self.syncer.learners and len(self.syncer.learners) > 1:
      logging.warning("learner %d's push was refused: out of the quorum until a push of it is applied", learner)
      self._log_live(sorted(self.syncer.learners - {learner}))
      self._after_merges(membership.quorum_merges(self.syncer, now), now, replay=False, log=True)

  def status(self, learner: int, tells_done: bool = True) -> dict:
    """Reply fields every call returns: where the run is and how much work is left.

    `tells_done`: whether the learner is done with the syncer after this reply: a pull's (sent once its final
    pushes landed: learner_main._goodbye), not a heartbeat's (a side thread reads it) nor a push's.
    """
    if self.done and tells_done and learner not in self.told_done:
      self.told_done.add(learner)
      self.store.append({"type": "told", "learner": learner})  # A restarted syncer need not wait for it.
    others = [speed for m, speed in enumerate(self.pace.speeds) if m != learner]
    return {
        "version": self.syncer.version, "versions": list(self.syncer.versions), "acked_seq": self.acked[learner],
        "steps_left": max(0, self.budget_steps - self.steps_done), "done": self.done,
        "max_speed": max(others, default=0.0), "incarnation": self.incarnations[learner],
        "syncer_incarnation": self.syncer_incarnation}

  def join(self, learner: int, now: float, fingerprint: dict | None = None) -> tuple[dict, list]:
    """(status, encoded Θ): what a (re)starting learner needs, its last acked seq and new incarnation included.

    A learner whose config `fingerprint` differs from the syncer's is refused first (fingerprint.Mismatch),
    nothing changed. Before the run starts a join waits at the start barrier (`membership.StartBarrier`), its
    lease kept alive, up to `barrier_call_seconds` a call (then membership.AtBarrier: the learner asks again).
    The incarnation is logged before the reply: from then on, pushes of the learner's earlier processes (a
    frozen predecessor that wakes up) are refused.
    """
    admission.require_known(learner, self.num_learners)
    fingerprint_lib.check(self.fingerprint, fingerprint or {}, learner)
    with self.lock:
      self.store.serving()
      self.benched.discard(learner)  # A new process: it may well push what the last one could not.
      self._check_learner(learner, now)
      opened = self.barrier.join(learner, self.start_time, self.syncer.version,
                                 keep_alive=lambda: self.last_seen.__setitem__(learner, time.time()))
      if opened is not None:
        self.emit(opened)
      self.store.serving()
      incarnation = self.incarnations[learner] + 1
      self.store.append({"type": "join", "learner": learner, "incarnation": incarnation})
      self.incarnations[learner] = incarnation
      self.pace.joined(learner, time.time())  # After the barrier: the process starts training now.
      return self.status(learner), self.pulls.whole(self.syncer.params)

  def pull(self, learner: int, fragment: int, have_version: int, now: float, on_wait=None) -> tuple[dict, list | None]:
    """(status, encoded Θ_fragment, or None when the learner already has its version). A learner whose push
    waits in the fragment's grace window gets that window's merge (`membership.GraceWaits`; `on_wait` there)."""
    with self.lock:
      self.store.serving()
      self._check_learner(learner, now)
      self.grace.wait(self.syncer, learner, fragment, now, on_wait)
      return self.status(learner), self.pulls.fragment(self.syncer, fragment, have_version)

  def heartbeat(self, learner: int, now: float) -> dict:
    """Renews the lease of a learner that is busy computing."""
    with self.lock:
      self.store.serving()
      self._check_learner(learner, now)
      return self.status(learner, tells_done=False)

  def push(self, header: dict, payload, now: float) -> dict:
    """Applies one push at most once; returns the reply (status + `status()` fields).

    `payload`: its bytes, or a `wal.Spool` they were streamed into (the data channel's: checked and folded
    tensor by tensor from there, appended to the log by the kernel, so the push is never whole in memory).

    Raises UnknownLearner, wire.WireError or PushRejected (counted, state untouched; a refused
    push neither renews its learner's lease nor brings it back into the quorum), or Stopped. The
    header's bounds were checked once, before its payload moved (`check_bounds`). The payload is
    decoded before the lock is taken: other calls need not wait for it.
    """
    try:
      admission.require_known(header["learner"], self.num_learners)
      data = payload.map if isinstance(payload, wal.Spool) else payload
      delta = wire.decode(data)
      admission.check_float32(delta, header["learner"])
    except (UnknownLearner, wire.WireError, PushRejected) as error:
      with self.lock:
        self.counts["rejected"] += 1
        if not isinstance(error, UnknownLearner):
          self._refused(header, now)
      raise
    with self.lock:
      self.store.serving()
      try:
        learner, seq = header["learner"], header["seq"]
        self._fence(header)
        if seq <= self.acked[learner] or (self.done and header["budget_steps"] > 0):
          self._check_learner(learner, now)
          if seq <= self.acked[learner]:
            self.counts["duplicates"] += 1
            return {"status": "duplicate", **self.status(learner, tells_done=False)}
          self.counts["late"] += 1  # Steps the budget did not count (see admission.budget_share).
          self.acked[learner] = seq
          return {"status": "late", **self.status(learner, tells_done=False)}
        excluded_live = self._readmit(learner)  # Receive needs it in the quorum; undone if refused.
        try:
          accepted = self._apply(header, delta, payload, now, replay=False, drop_pages=wal.page_dropper(data))
        except PushRejected:
          if excluded_live is not None:
            self._log_live(excluded_live)
          raise
        self.last_seen[learner] = now
        self.benched.discard(learner)
        self.resync.discard(learner)
        if self.done:  # After the end: the progress on its fragment of steps the budget counted already.
          self._after_merges(self.syncer.flush(now), now, replay=False, log=True)
          self._checkpoint_due = True
      except (wire.WireError, PushRejected):
        self.counts["rejected"] += 1
        self._refused(header, now)  # (Nothing for a fenced push: it is not the learner's current process's.)
        raise
      return {"status": "applied" if accepted else "dropped", **self.status(learner, tells_done=False)}

  def _apply(self, header: dict, delta, payload, now: float, replay: bool, record_it: bool = True,
             count_it: bool = True, drop_pages=None) -> bool:
    """validate → log (fsync) → receive() → bookkeeping → merges; the ack may follow once this returns.

    `payload`: the push's bytes as received, or on replay where the log holds them (wal.Location);
    `drop_pages` lets go of the pages of a push mapped from disk (spooled or logged) as it is read.

    A push that fails validation is never logged; one that is logged is applied (replay
    validated it the first time, so it does not check it again).

    The push's metric record carries outer_step = version + 1 before it arrived: the first
    merge that can hold it, so a restart from checkpoint v keeps exactly the records of
    pushes that checkpoint holds.
    """
    syncer = self.syncer
    self.barrier.started = True  # Learners that push have started (e.g. a restarted syncer's).
    outer_step = syncer.version + 1
    fragment_version = syncer.versions[header["fragment"]] if 0 <= header["fragment"] < len(syncer.versions) else 0
    push = Push(header["learner"], delta, header["base_version"], header["tokens"], header["local_steps"],
                header["compute_seconds"], header["fragment"], header["payload_bytes"], drop_pages=drop_pages)
    record = {"type": "push", "header": header, "now": now, "outer_step": outer_step}
    if not replay:
      push = syncer.check(push)
      payload = self.store.append(record, payload)  # From here on, only where the log holds it.
    accepted, report = syncer.receive(push, now, checked=not replay)
    self.acked[header["learner"]] = max(self.acked[header["learner"]], header["seq"])
    steps, tokens = admission.budget_share(header)
    self.steps_done, self.tokens_done = self.steps_done + steps, self.tokens_done + tokens
    self.pace.observe(header["learner"], header["fragment"], header["local_steps"], header["compute_seconds"], now)
    if count_it:  # A carried push is in the checkpoint's counts already.
      self.counts["applied" if accepted else "dropped"] += 1
    self._unabsorbed.append((header["fragment"], record, payload))  # Dropped ones too: their records.
    if record_it:
      self.emit({
          "kind": "push", "outer_step": outer_step, "learner": header["learner"], "seq": header["seq"],
          "fragment": header["fragment"], "local_steps": header["local_steps"], "tokens": header["tokens"],
          "staleness": fragment_version - header["base_version"], "accepted": int(accepted),
          "wire_bytes": header["payload_bytes"], "wall_time": now - self.start_time, "replayed": int(replay),
          **syncer.verdict.fields()})
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
        self.store.append({"type": "merge", "fragment": report.fragment, "now": now})
      self.pulls.forget(report.fragment)
      self._unabsorbed = [entry for entry in self._unabsorbed if entry[0] != report.fragment]
      self._merges_since_checkpoint += 1
      self.emit({
          "kind": "outer", "outer_step": report.version, "fragment": report.fragment, "learners": list(report.learners),
          "staleness": list(report.staleness), "weights": list(report.weights), "tokens": self.tokens_done,
          "wall_time": now - self.start_time, "replayed": int(replay)})
      if not replay:
        self.on_merge(report.version, self.syncer.params, now)
        self.grace.merged()
    if not replay and self._merges_since_checkpoint >= self.checkpoint_every:
      self._checkpoint_due = True

  def _finish(self, now: float) -> None:
    """Budget spent: merge what is pending, mark the run done (in the log) and checkpoint it at the next tick."""
    self._after_merges(self.syncer.flush(now), now, replay=False, log=True)
    self.done = True
    # Logged: the flag survives a crash before the next tick's checkpoint (or if this version has one already).
    self.store.append({"type": "done", "now": now})
    self._checkpoint_due = True
    logging.info("token budget spent at version %d: the run is done", self.syncer.version)

  def end(self, now: float) -> None:
    """The run is over by another syncer's count (shard 0's: service/shardrun.py): ends it here as its own would."""
    with self.lock:
      if not self.done:
        self._finish(now)

  # Time-driven work.
  def tick(self, now: float) -> None:
    """Closes due grace windows, excludes learners whose lease ran out, takes a due checkpoint."""
    with self.lock:
      self.store.serving()
      if not self.done:
        self._expire(now)
      if self._checkpoint_due and now >= self.store.retry_at:
        self._checkpoint(now)

  def _expire(self, now: float) -> None:
    """Time-driven merges: grace windows that closed, and quorums lowered by expired leases."""
    self._after_merges(self.syncer.on_deadline(now), now, replay=False, log=True)
    live = membership.live_learners(self.syncer.learners, self.last_seen, now, self.lease_seconds)
    if live and len(live) < len(self.syncer.learners):
      for m in sorted(set(self.syncer.learners) - set(live)):
        logging.warning("learner %d silent for over %.1fs: excluded from the quorum until it calls again", m,
                        self.lease_seconds)
        self.counts["excluded"] += 1
      self._log_live(live)
      self._after_merges(membership.quorum_merges(self.syncer, now), now, replay=False, log=True)

  def _log_live(self, learners: list[int]) -> None:
    self.store.append({"type": "live", "learners": learners})
    membership.set_live(self.syncer, learners, self.quorum_setting)

  def all_told_done(self) -> bool:
    """Every learner has heard that the run is over (the service may stop)."""
    with self.lock:
      return self.done and len(self.told_done) == self.num_learners

  def close(self) -> None:
    """Closes the log and the checkpointer."""
    with self.lock:
      self.store.close()

"""The syncer service's recovery: restore a checkpoint and replay the write-ahead log, and checkpoint.

A mixin of `core.SyncerCore`, kept apart so that the core's calls and its durability each read as one
concept: `start` restores the latest checkpoint of Θ, outer state, versions, acked seqs, incarnations,
budget and counters, then re-applies each logged push, merge and lease change after it exactly once;
`checkpoint` rotates the log onto the pushes Θ does not hold yet and saves the checkpoint that points
there. The methods use the core's state (`store`, `syncer`, `acked`, ...) and take its lock as it does.
"""

import time

from absl import logging

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco.service import admission, membership, wal, wire
from decoupled_diloco.syncer import SyncerState


class Recovery:
  """Restore, replay and checkpoint of a `SyncerCore` (whose `__init__` sets the state they use)."""

  def start(self, now: float) -> int | None:
    """Restores the latest checkpoint and replays the log (or checkpoints a fresh run at 0).

    Returns the restored checkpoint step, None for a fresh run.
    """
    with self.lock:
      self.last_seen = {m: now for m in range(self.num_learners)}
      if self.store.latest_step() is None:
        self.syncer_incarnation = self.store.next_incarnation(0)
        self.start_time = now
        self.store.open_fresh()
        self._checkpoint(now)
        return None
      abstract = checkpoint_lib.abstract_like(self._state_trees())
      self.syncer.drop_state()  # The restore's copies replace Θ and the outer state; never both at once.
      step, state, meta = self.store.restore_usable(abstract)
      # Past the checkpoint's too: a lost local dir (and its incarnation file) never makes it go back.
      self.syncer_incarnation = self.store.next_incarnation(meta.get("syncer_incarnation", 0))
      if self.store.log_lost:
        self.resync = set(range(self.num_learners))
        logging.warning(
            "the syncer's local dir %s holds no log: resuming from checkpoint %d on the workdir with a new log; "
            "pushes acknowledged after that checkpoint (and those it had not merged yet) are lost",
            self.store.local_dir, step)
      self.syncer.restore(SyncerState(state["params"], state["opt_state"], tuple(meta["versions"])))
      self.acked = {m: meta["acked"].get(str(m), -1) for m in range(self.num_learners)}
      self.refused_seq.update({int(m): s for m, s in meta.get("refused_seq", {}).items()})
      self.incarnations.update({int(m): n for m, n in meta.get("incarnations", {}).items()})
      self.steps_done, self.tokens_done, self.done = meta["steps_done"], meta["tokens_done"], meta["done"]
      self.start_time = meta["start_time"]
      self.counts.update(meta.get("counts", {}))  # Replay adds the pushes applied after the checkpoint.
      self.refused.update(meta.get("refused", {}))
      self.syncer.restore_estimates(meta["estimates"])  # Before the replay, which goes on updating them.
      if "recent_norms" in meta:  # Checkpoints from before robust merges have none: clipping starts afresh.
        self.syncer.restore_recent_norms(meta["recent_norms"])
      self.restored_at = time.time()
      self._replay(meta["segment"], step)
      self.store.open_after_replay(meta["segment"])
      if self.steps_done >= self.budget_steps and not self.done:  # Crashed between the last push and the end.
        self._finish(now)
      logging.info(
          "syncer incarnation %d restored checkpoint %d and replayed its log: version %d, %d of %d steps "
          "done", self.syncer_incarnation, step, self.syncer.version, self.steps_done, self.budget_steps)
      return step

  def _state_trees(self) -> dict:
    state = self.syncer.state
    return {"params": state.params, "opt_state": state.opt_state}

  def _checkpoint(self, now: float) -> None:
    """Rotates the log onto the pushes Θ does not hold yet, then saves the checkpoint that points there."""
    version = self.syncer.version
    if self.store.latest_step() == version:
      return  # The log already holds everything since that checkpoint.
    carried = [(dict(record, carried=True), location) for _, record, location in self._unabsorbed]
    pending_steps = sum(admission.budget_share(r["header"])[0] for r, _ in carried)
    pending_tokens = sum(admission.budget_share(r["header"])[1] for r, _ in carried)
    meta = {
        **self.metadata, "versions": list(self.syncer.versions), "segment": version, "done": self.done,
        "start_time": self.start_time, "steps_done": self.steps_done - pending_steps,
        "tokens_done": self.tokens_done - pending_tokens, "counts": self.counts, "refused": dict(self.refused),
        "estimates": self.syncer.estimates, "recent_norms": self.syncer.recent_norms,
        "syncer_incarnation": self.syncer_incarnation}
    per_learner = {"acked": self.acked, "incarnations": self.incarnations, "refused_seq": self.refused_seq}
    meta.update({name: {str(m): value for m, value in values.items()} for name, values in per_learner.items()})
    locations = self.store.rotate(version, carried)
    self._unabsorbed = [(f, record, location) for (f, record, _), location in zip(self._unabsorbed, locations)]
    if not self.store.save(version, self._state_trees(), meta, now):
      return  # Retried by a later tick; the log holds everything meanwhile.
    self._merges_since_checkpoint, self._checkpoint_due = 0, False
    logging.info("syncer checkpoint at version %d (%d pushes carried in the log)", version, len(carried))

  def checkpoint(self, now: float) -> None:
    """A checkpoint now (SIGTERM, end of run), unless the latest one already is this version."""
    with self.lock:
      self._checkpoint(now)

  def _replay(self, first_segment: int, step: int) -> None:
    """Re-applies logged pushes, merges and lease changes after checkpoint `step`, each once.

    Metric records after `step` were dropped at the restart; replayed pushes write theirs
    again (a carried push only if its record was one of those dropped). A push is read from the mapped
    segment and folded tensor by tensor, each tensor's pages let go of before the next (`wal.page_dropper`):
    a restart holds no logged push whole.
    """
    applied = set()
    for record, payload, location in self.store.records_from(first_segment):
      if record["type"] == "push":
        header = record["header"]
        key = (header["learner"], header["seq"])
        if key in applied or not (record.get("carried") or header["seq"] > self.acked[header["learner"]]):
          continue
        applied.add(key)
        self._apply(header, wire.decode(payload), location, record["now"], replay=True,
                    record_it=not record.get("carried") or record["outer_step"] > step,
                    count_it=not record.get("carried"), drop_pages=wal.page_dropper(payload))
      elif record["type"] == "merge":
        self._after_merges([self.syncer.merge(record["now"], record["fragment"])], record["now"], replay=True)
      elif record["type"] == "live":
        membership.set_live(self.syncer, record["learners"], self.quorum_setting)
      elif record["type"] == "done":
        self.done = True
      elif record["type"] == "told":
        self.told_done.add(record["learner"])
      elif record["type"] == "join":
        self.incarnations[record["learner"]] = record["incarnation"]
        self.pace.joined(record["learner"])

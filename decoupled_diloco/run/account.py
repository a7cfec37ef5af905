"""One learner's account: where its time went and what became of its pushes, in any runtime.

The virtual clock, the threads runtime and a learner process fill the same fields (each in
its own seconds: virtual or wall-clock); what a runtime cannot measure stays at its zero
and its learner_summary record says null for it (records.learner_summary).
"""

import collections
import dataclasses

from absl import logging

from decoupled_diloco.push import PushRejected


@dataclasses.dataclass(kw_only=True)
class Account:
  """Time and traffic of one learner group."""
  steps: int = 0  # Inner steps finished (runtimes that count them here).
  busy: float = 0.0  # Computing inner steps (slowdown included).
  useful: float = 0.0  # Busy time whose push was accepted (goodput's numerator).
  idle: float = 0.0  # Stalled for a fragment (or the run's last merge) that has not landed.
  idle_since: float | None = None
  blocked: float = 0.0  # Waiting for a lock, a merge or an exchange not back in time.
  stalls: int = 0  # Times it stopped for a fragment still in flight.
  done_at: float | None = None  # When the budget left this learner nothing to do.
  pushes: int = 0
  dropped: int = 0  # Over-stale: counted by the syncer, not merged.
  rejected: int = 0  # Malformed: refused by the syncer.
  clipped: int = 0  # Accepted pushes the clip rule scaled down (syncer.merge_rule='clip').
  trimmed: float = 0.0  # Σ over its merged pushes of the share of coordinates trimmed (merge_rule='trimmed_mean').
  trimmed_pushes: int = 0  # Its pushes merged by a trimmed mean: `trimmed`'s denominator.
  bytes_sent: int = 0
  bytes_received: int = 0
  staleness: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def count_push(self, staleness: int, accepted: bool, compute_seconds: float, wire_bytes: int) -> None:
    """A push the syncer took: its staleness, and its compute as useful time if it was merged."""
    self.pushes += 1
    self.bytes_sent += wire_bytes
    self.staleness[staleness] += 1
    if accepted:
      self.useful += compute_seconds
    else:
      self.dropped += 1

  def fields(self) -> dict:
    """The learner_summary fields every runtime fills from its account."""
    return {
        "busy_seconds": self.busy, "idle_seconds": self.idle, "blocked_seconds": self.blocked, "stalls": self.stalls,
        "pushes": self.pushes, "dropped": self.dropped, "rejected": self.rejected, "bytes_sent": self.bytes_sent,
        "bytes_received": self.bytes_received, "clipped": self.clipped,
        "trimmed_share": self.trimmed / self.trimmed_pushes if self.trimmed_pushes else None,
        "staleness_histogram": {str(s): n for s, n in sorted(self.staleness.items())}}


def hand_over(syncer, account: Account, push, now: float, useful_seconds: float, wire_bytes: int):
  """Gives `push` to the in-process syncer at `now` and accounts it: (accepted, merge report or None,
  staleness), or None when the syncer refused it as malformed (logged, counted as rejected)."""
  staleness = syncer.fragments[push.fragment].version - push.base_version
  try:
    accepted, report = syncer.receive(push, now)
  except PushRejected as error:
    logging.warning("%s", error)
    account.rejected += 1
    return None
  account.count_push(staleness, accepted, useful_seconds, wire_bytes)
  account.clipped += int(accepted and syncer.verdict.clip_factor < 1)
  return accepted, report, staleness


def count_trimmed(accounts, report) -> None:
  """Adds a merge's trimmed shares (syncer.MergeReport.trimmed; none unless trimmed_mean) to its learners' accounts."""
  for learner, share in zip(report.learners, report.trimmed):
    accounts[learner].trimmed += share
    accounts[learner].trimmed_pushes += 1

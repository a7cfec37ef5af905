"""The evaluator's read-only view of the syncer (service.evaluate_on='evaluator', issue 16).

Why a separate view: the evaluator process reads Θ like a learner (Pull / PullTicket, the same
cache of Θ_p encoded once per version, the same data channel), but it is no learner: it never
joins, holds no lease, counts in no quorum and can never push (its credential is refused
for that, security.EVALUATOR). What it needs besides Θ is where the run is, so that its
records name the Θ version and the tokens at it, and whether Θ is final: the budget is spent
and every learner heard so, so no push can move Θ again (for a syncer shard: shard 0 says every
learner heard it, and this shard is done: `shardrun.RunState.may_stop`). The syncer waits (up to
service.linger_seconds) until the evaluator has read every fragment while Θ was final, so
the final Θ is always evaluated.
"""

import threading
import time

from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import security

# A reader's status: a learner's status fields (so the client parses both alike), plus the run's clock as the
# syncer's own eval records had it (mean inner steps per learner, tokens, seconds since the run began).
EXTRA_FIELDS = {"inner_step": int, "tokens": int, "wall_time": float, "final": bool}


class Reader:
  """Read-only calls on a `SyncerCore`: status and fragment pulls, and whether the final Θ was read."""

  def __init__(self, core: core_lib.SyncerCore, is_final=None):
    self.core = core
    self.is_final = is_final or (lambda: core.all_told_done())  # Whether Θ can no longer move (the module doc).
    self._final_reads: set[int] = set()  # Fragments the evaluator read while Θ was final.
    self._lock = threading.Lock()

  def status(self) -> dict:
    """The reader's status header: the run's versions, budget and tokens; `final` once Θ cannot move."""
    core = self.core
    with core.lock:
      return {
          "version": core.syncer.version, "versions": list(core.syncer.versions), "acked_seq": -1,
          "steps_left": max(0,
                            core.budget_steps - core.steps_done), "done": core.done, "max_speed": 0.0, "incarnation": 0,
          "syncer_incarnation": core.syncer_incarnation, "inner_step": core.steps_done // core.num_learners,
          "tokens": core.tokens_done, "wall_time": time.time() - core.start_time, "final": self.is_final()}

  def pull(self, fragment: int, have_version: int) -> tuple[dict, list | None]:
    """(status, encoded Θ_fragment, or None when `have_version` is current), from the learners' pull cache."""
    core = self.core
    with core.lock:
      core.store.serving()
      parts = core.pulls.fragment(core.syncer, fragment, have_version)
      status = self.status()
    if status["final"]:
      with self._lock:
        self._final_reads.add(fragment)
    return status, parts

  def has_final(self) -> bool:
    """Whether the evaluator holds the final Θ: it read every fragment after Θ became final."""
    with self._lock:
      return len(self._final_reads) == len(self.core.syncer.versions)


def is_reader(learner: int) -> bool:
  """Whether a call names the evaluator (security.EVALUATOR) rather than a learner."""
  return learner == security.EVALUATOR

"""Who takes part in the syncer's rounds: the start barrier, and the quorum that leases shrink and calls restore.

Why separate from the core's state machine: these decide *who* a merge waits for, not what
it merges. A learner that compiles slowly must not find the budget spent by the others
(the barrier), and a dead learner must not hold the living up (leases lower the quorum to
the learners still calling; a call brings an excluded one back).
"""

import dataclasses
import math
import threading
import time

from absl import logging

from decoupled_diloco.syncer import MergeReport, Syncer

AT_BARRIER = "waiting at the start barrier"  # How an AtBarrier refusal's details begin (the client looks for it).


class AtBarrier(RuntimeError):
  """A join that waited its `call_seconds` at the start barrier, which is still closed: the learner asks again."""


class StartBarrier:
  """Joins wait until `required` learners joined, or `timeout_seconds` after the syncer started.

  `required` = 1 means no wait. The barrier also counts as passed once a push arrives (the
  learners of a restarted syncer have started long ago). One join call waits `call_seconds` at most,
  then is answered AtBarrier, saying how long the barrier may still take: why, a call that waited longer
  than its deadline was cancelled and the learner's retries ran out (300 s) while the barrier waited 600 s.
  Callers hold `lock`.
  """

  def __init__(self, lock: threading.RLock, required: int, timeout_seconds: float, call_seconds: float = math.inf):
    self.required, self.timeout_seconds, self.call_seconds = required, timeout_seconds, call_seconds
    self.joined: set[int] = set()
    self.started = False  # Barrier passed (or timed out), or a push arrived (a restarted syncer's learners).
    self._condition = threading.Condition(lock)

  def join(self, learner: int, start_time: float, version: int, keep_alive) -> dict | None:
    """Waits (the lock released meanwhile) until the barrier is open; `keep_alive()` after each wait.

    Returns the 'start' metric record if this join opened the barrier (naming who had joined,
    with a warning if it timed out), else None: the start is reported once. Raises AtBarrier after
    `call_seconds` of waiting.
    """
    self.joined.add(learner)
    give_up = time.time() + self.call_seconds
    while not self.started:
      left = start_time + self.timeout_seconds - time.time()
      if len(self.joined) >= self.required or left <= 0:
        self.started = True
        self._condition.notify_all()
        return self._opened(timed_out=len(self.joined) < self.required, version=version, start_time=start_time)
      if time.time() >= give_up:
        raise AtBarrier(f"{AT_BARRIER}: {len(self.joined)} of the {self.required} learners it waits for have joined; "
                        f"it opens when all have, or in {left:.0f}s at the latest")
      self._condition.wait(min(left, 1.0, max(give_up - time.time(), 0.0)))
      keep_alive()
    return None

  def _opened(self, timed_out: bool, version: int, start_time: float) -> dict:
    if timed_out:
      logging.warning(
          "start barrier timed out after %.0fs with learners %s of the %d required: starting without "
          "the others", self.timeout_seconds, sorted(self.joined), self.required)
    return {
        "kind": "start", "outer_step": version, "learners": sorted(self.joined), "required": self.required,
        "timed_out": int(timed_out), "wall_time": time.time() - start_time}


class GraceWaits:
  """Pulls that wait for the merge of the grace window their learner's push is in (docs/syncer.md).

  On the virtual clock such a learner receives that window's merge; here its pull (sent right after
  the push) waits for it, the core's `lock` released meanwhile, so the three runtimes agree.
  Callers hold `lock`; the core calls `merged()` after every merge.
  """

  def __init__(self, lock: threading.RLock, slack_seconds: float = 5.0, merge_wait_seconds: float = 0.0):
    self.slack_seconds = slack_seconds  # How late past its deadline a window's merge is still waited for.
    # Synchronous DiLoCo (mode='diloco'): every pull after a push waits this long at most for the merge that holds
    # the push (the learner asks again until it has it), as the in-process runtimes' learners wait; 0 = never.
    self.merge_wait_seconds = merge_wait_seconds
    self._condition = threading.Condition(lock)

  def wait(self, syncer: Syncer, learner: int, fragment: int, now: float, on_wait=None) -> None:
    """Returns once the learner's push in `fragment`'s open window is merged (at once if it is in none),
    or `slack_seconds` after the deadline (ticks close windows); `on_wait(seconds)` hears that bound first.
    In synchronous DiLoCo every unmerged push waits so, up to `merge_wait_seconds`."""
    if not 0 <= fragment < len(syncer.fragments):
      return  # (A fragment the run does not have is refused by the pull itself.)
    if self.merge_wait_seconds and syncer.holds(learner, fragment):
      if on_wait is not None:
        on_wait(self.merge_wait_seconds)
      self._condition.wait_for(lambda: not syncer.holds(learner, fragment), self.merge_wait_seconds)
      return
    if not syncer.in_window(learner, fragment):
      return
    limit = max(syncer.fragments[fragment].deadline - now, 0.0) + self.slack_seconds
    if on_wait is not None:
      on_wait(limit)
    if not self._condition.wait_for(lambda: not syncer.holds(learner, fragment), limit):
      logging.warning("grace window of fragment %d not merged %.1fs after its deadline: sending the Θ there is",
                      fragment, self.slack_seconds)

  def merged(self) -> None:
    """A merge happened: waiting pulls look again."""
    self._condition.notify_all()


def live_learners(learners, last_seen: dict[int, float], now: float, lease_seconds: float) -> list[int]:
  """The learners heard from within their lease (one never heard from counts as just seen)."""
  return sorted(m for m in learners if now - last_seen.get(m, now) <= lease_seconds)


def set_live(syncer: Syncer, learners: list[int], quorum_setting: int) -> None:
  """Only live learners count towards the quorum (a quorum larger than them is lowered to them)."""
  syncer.learners = frozenset(learners)
  quorum = min(quorum_setting, len(learners)) if quorum_setting else 0
  syncer.settings = dataclasses.replace(syncer.settings, quorum=quorum)


def quorum_merges(syncer: Syncer, now: float) -> list[MergeReport]:
  """Merges fragments whose pending pushes meet the (just lowered) quorum."""
  return [
      syncer.merge(now, p) for p, f in enumerate(syncer.fragments)
      if f.pending and len({push.learner for push in f.pending}) >= syncer.quorum]

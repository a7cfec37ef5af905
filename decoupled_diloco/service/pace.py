"""Each learner's pace as its pushes report it, robust to a report that lies.

Why: the syncer learns each learner's speed from its pushes' own `compute_seconds /
local_steps`, and DyLU sizes every other learner's rounds by the fastest of them (the
`max_speed` of every reply). Taken one report at a time (an EMA, as before), one push claiming
1e-6 s per step made DyLU shrink every other learner's rounds to one step for the rest of the
run. So:
  * a learner's speed is 1 / the median of its last WINDOW applied step times, and counts only
    once it has MIN_REPORTS of them: a lie among them is outvoted. A fragment's first push after a
    join holds the learner's compilation (its own speed tracker skips that period too): it is not
    one. The speed DyLU hears is at most BAND× what its hardware's predicts (below), so reports
    taken before the others had a median cannot make a learner the fastest by more than that;
  * a push whose step time is over BAND× faster than its learner's own median (of its last WINDOW
    claims, refused ones included: a learner whose pace really changed that much is refused a
    few times, then followed, never locked out) or than its hardware's (the other learners'
    medians, scaled by their hardware's declared speed over its own) is refused before anything
    of it is applied; so is a compute_seconds longer than the wall time since the learner joined
    (CLOCK_SLACK_SECONDS aside). Slower is not banded: an honest round holds checkpoint saves and
    the host's stalls (18x its median in tests/test_hostile.py's run), and a slow claim lowers
    only its own learner's speed;
  * a time-budget push, whose length no config fixes, carries at most TIME_SLACK × the steps its
    learner's fastest reported step time fits in the wall time since that fragment's last push.
A join starts the learner's reports afresh: a restarted process compiles again. The bands are
generous on purpose: a loaded host's step times move severalfold, and DyLU's one-step rounds
carry a push's encoding in their step time. Within them a learner can still overstate its speed
by up to BAND×, which no longer moves the median once others report.
"""

import collections
import math
import statistics

from decoupled_diloco.service.limits import OutOfBounds

WINDOW = 5
MIN_REPORTS = 3
BAND = 16.0
TIME_SLACK = 4.0
CLOCK_SLACK_SECONDS = 1.0


class Pace:
  """Per learner: its recent step times, and when it joined and last pushed each fragment (this process's clock).

  `declared_speeds[m]`: steps per second learner m's hardware promises; only their ratios are used.
  """

  def __init__(self, declared_speeds):
    self.declared = tuple(declared_speeds)
    self.recent = [collections.deque(maxlen=WINDOW) for _ in self.declared]  # Applied pushes' step times.
    self.claims = [collections.deque(maxlen=WINDOW) for _ in self.declared]  # The same and the band's refusals.
    self.joined_at: dict[int, float] = {}
    self.pushed_at: dict[tuple[int, int], float] = {}  # (learner, fragment) -> when its last push was applied.

  def joined(self, learner: int, now: float | None = None) -> None:
    """A new process of `learner` (`now`: when, None on a replay): its reports start afresh."""
    self.recent[learner].clear()
    self.claims[learner].clear()
    self.pushed_at = {key: at for key, at in self.pushed_at.items() if key[0] != learner}
    if now is not None:
      self.joined_at[learner] = now

  def observe(self, learner: int, fragment: int, local_steps: int, compute_seconds: float, now: float) -> None:
    """An applied push: its step time joins the window, unless it is the fragment's first since a join."""
    first = (learner, fragment) not in self.pushed_at
    self.pushed_at[(learner, fragment)] = now
    if not first and local_steps > 0 and compute_seconds > 0:
      self.recent[learner].append(compute_seconds / local_steps)
      self.claims[learner].append(compute_seconds / local_steps)

  def median(self, learner: int) -> float | None:
    """The learner's median step time, None until it has MIN_REPORTS reports."""
    return _median(self.recent[learner])

  def speed(self, learner: int) -> float:
    """Steps per second (0 = not known yet), at most BAND× its hardware's: the others' DyLU reference."""
    median, hardware = self.median(learner), self.hardware_step(learner)
    return 1.0 / max(median, hardware / BAND if hardware else 0.0) if median else 0.0

  @property
  def speeds(self) -> list[float]:
    """Every learner's `speed`."""
    return [self.speed(m) for m in range(len(self.declared))]

  def hardware_step(self, learner: int) -> float | None:
    """The step time the other learners' medians predict for `learner`'s hardware (their median); None if none."""
    predicted = [
        median * self.declared[n] / self.declared[learner] for n in range(len(self.declared))
        if n != learner and (median := self.median(n))]
    return statistics.median(predicted) if predicted else None

  def check(self, header: dict, now: float, run_start: float) -> None:
    """Raises OutOfBounds for a compute_seconds no honest learner reports (see the module doc)."""
    learner, steps, seconds = header["learner"], header["local_steps"], header["compute_seconds"]
    since = self.joined_at.get(learner, run_start)
    if not 0 < seconds <= now - since + CLOCK_SLACK_SECONDS:
      raise OutOfBounds(f"push from learner {learner} refused: compute_seconds={seconds} is not in (0, "
                        f"{now - since:.1f}], the seconds since it joined")
    if steps < 1:
      return  # No step time: the syncer's own check refuses it (push.validate).
    step, hardware = seconds / steps, self.hardware_step(learner)
    if hardware and step < hardware / BAND:
      raise OutOfBounds(f"push from learner {learner} refused: {step:.3g} s per step is over {BAND:g}x faster than "
                        f"its hardware's {hardware:.3g} s (the other learners' medians, scaled by declared speeds)")
    own = _median(self.claims[learner])
    if (learner, header["fragment"]) in self.pushed_at and own and step < own / BAND:
      self.claims[learner].append(step)  # Counted: a pace that really changed is followed after a few refusals.
      raise OutOfBounds(f"push from learner {learner} refused: {step:.3g} s per step (compute_seconds / local_steps) "
                        f"is over {BAND:g}x faster than its own median of {own:.3g} s")

  def most_steps(self, learner: int, fragment: int, now: float, floor: int, ceiling: int) -> int:
    """Steps a time-budget push may carry: `floor` (a round of H) until the learner has reported a step time
    since it joined this process, `ceiling` (the budget) when it joined an earlier one (its pace is not known)."""
    if learner not in self.joined_at:
      return ceiling
    if not self.recent[learner]:
      return floor  # Its first rounds are H steps (policy.measured_round_steps: not measured yet).
    since = self.pushed_at.get((learner, fragment), self.joined_at[learner])
    return max(floor, math.ceil(TIME_SLACK * (now - since) / min(self.recent[learner])))


def _median(values) -> float | None:
  """The median of `values`, None when there are fewer than MIN_REPORTS."""
  return statistics.median(values) if len(values) >= MIN_REPORTS else None

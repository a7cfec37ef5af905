"""Each learner's pace as the syncer sees it (service/pace.py): a median of recent reports, not one report."""

import pytest

from decoupled_diloco.service import limits, pace


def _header(learner=0, local_steps=4, compute_seconds=0.1):
  return {"learner": learner, "fragment": 0, "local_steps": local_steps, "compute_seconds": compute_seconds}


def test_a_speed_counts_from_the_median_of_reports_after_each_fragments_compiling_push():
  tracker = pace.Pace((1.0, 1.0))
  tracker.joined(0, 0.0)
  for fragment in range(2):
    tracker.observe(0, fragment, 4, 40.0, 1.0)  # Each fragment's first push holds compilation: no report.
  assert list(tracker.recent[0]) == [] and tracker.speed(0) == 0.0
  for now in (2.0, 3.0):
    tracker.observe(0, 0, 4, 0.1, now)
  assert tracker.speed(0) == 0.0  # Two reports: not enough for a median.
  tracker.observe(0, 1, 4, 0.1, 4.0)
  assert tracker.speeds == [pytest.approx(40.0), 0.0]
  tracker.joined(0, 5.0)  # A new process compiles again: its reports start afresh.
  assert tracker.speed(0) == 0.0 and (0, 0) not in tracker.pushed_at


def test_one_report_in_the_band_does_not_move_the_speed_dylu_hears():
  tracker = pace.Pace((1.0, 1.0))
  for now in range(4):
    tracker.observe(1, 0, 4, 0.1, float(now))
  tracker.check(_header(1, compute_seconds=0.1 / 15), now=10.0, run_start=0.0)  # 15x faster: within the band.
  tracker.observe(1, 0, 4, 0.1 / 15, 10.0)
  assert tracker.speed(1) == pytest.approx(40.0)  # The median of [0.025] * 3 + [0.0017].


@pytest.mark.parametrize("seconds, text", [(0.1 / 17, "faster than its own median"), (0.0, "is not in (0, "),
                                           (30.0, "the seconds since it joined")])
def test_a_step_time_far_faster_than_the_learners_own_median_or_longer_than_its_life_is_refused(seconds, text):
  tracker = pace.Pace((1.0, 1.0))
  for now in range(4):
    tracker.observe(0, 0, 4, 0.1, float(now))
  tracker.check(_header(compute_seconds=0.1 / 16), now=10.0, run_start=0.0)  # At the band's edge.
  tracker.check(_header(compute_seconds=0.1 * 50), now=10.0, run_start=0.0)  # A round with a checkpoint save in it.
  with pytest.raises(limits.OutOfBounds, match=text.replace("(", r"\(")):
    tracker.check(_header(compute_seconds=seconds), now=10.0, run_start=0.0)


def test_the_hardwares_step_time_comes_from_the_others_medians_scaled_by_declared_speeds():
  tracker = pace.Pace((1.0, 4.0, 1.0))  # Learner 1's hardware is declared 4x faster.
  for learner in (0, 2):
    for now in range(4):
      tracker.observe(learner, 0, 4, 0.4, float(now))  # 0.1 s per step.
  assert tracker.hardware_step(1) == pytest.approx(0.025) and tracker.hardware_step(0) == pytest.approx(0.1)
  tracker.check(_header(1, compute_seconds=4 * 0.025 / 16), now=10.0, run_start=0.0)  # Exactly at the band's edge.
  with pytest.raises(limits.OutOfBounds, match="faster than its hardware's"):
    tracker.check(_header(1, compute_seconds=4 * 0.025 / 17), now=10.0, run_start=0.0)
  tracker.check(_header(1, compute_seconds=4.0), now=10.0, run_start=0.0)  # Slower than its peers: its own business.


def test_a_learner_whose_pace_really_changed_is_refused_a_few_times_then_followed():
  """The own band's median holds the refused claims too: a host that got 20x faster is not locked out."""
  tracker = pace.Pace((1.0, 1.0))
  for now in range(4):
    tracker.observe(0, 0, 4, 0.1, float(now))
  faster = _header(compute_seconds=0.1 / 20)
  for _ in range(3):
    with pytest.raises(limits.OutOfBounds, match="faster than its own median"):
      tracker.check(faster, now=10.0, run_start=0.0)
  tracker.check(faster, now=10.0, run_start=0.0)
  assert tracker.speed(0) == pytest.approx(40.0)  # Refused claims never reach the speed DyLU hears.


def test_the_speed_dylu_hears_is_at_most_band_times_its_hardwares():
  """Reports taken before the others had a median (none to compare with) cannot make a learner the fastest by more
  than BAND."""
  tracker = pace.Pace((1.0, 1.0))
  for now in range(4):
    tracker.observe(0, 0, 4, 4e-6, float(now))  # Learner 0 claimed 1e-6 s per step before anyone else reported.
    tracker.observe(1, 0, 4, 0.1, float(now))
  assert tracker.speed(0) == pytest.approx(pace.BAND / 0.025) and tracker.speed(1) == pytest.approx(40.0)

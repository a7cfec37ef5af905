"""The run monitor: one progress line per eval, and divergence (non-finite, or above the untrained loss N times)."""

import logging
import math

from configs import demo
from decoupled_diloco.run import monitor as monitor_lib


def _monitor(patience=3, **kwargs):
  return monitor_lib.Monitor(outer_steps=10, tokens_per_round=1000, untrained_loss=math.log(256), patience=patience,
                             **kwargs)


def _eval(loss, tokens, wall=None, **extra):
  return {
      "kind": "eval", "outer_step": tokens // 1000, "inner_step": tokens // 100, "tokens": tokens, "wall_time": wall,
      "eval_loss": loss, **extra}


def test_untrained_loss_is_a_uniform_guess():
  assert monitor_lib.untrained_loss(256) == math.log(256)
  monitor = monitor_lib.Monitor.for_config(demo.get_config())
  assert monitor.untrained_loss == math.log(256) and monitor.tokens_per_round == 25 * 64 * 16 * 4


def test_a_non_finite_eval_diverges_at_once(caplog):
  monitor = _monitor()
  with caplog.at_level(logging.ERROR):
    monitor.observe(_eval(float("nan"), 1000))
  assert "not finite" in monitor.diverged
  assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [monitor.diverged]


def test_n_evals_in_a_row_above_the_untrained_loss_diverge_and_a_lower_one_resets_the_count():
  monitor = _monitor()
  for tokens, loss in enumerate([9.0, 9.0, 3.0, 9.0, 9.0], start=1):
    monitor.observe(_eval(loss, tokens * 1000))
  assert monitor.diverged is None
  monitor.observe(_eval(9.0, 6000))
  assert "for 3 evals in a row" in monitor.diverged and "--config.outer.lr" in monitor.diverged


def test_patience_zero_only_counts_non_finite_losses():
  monitor = _monitor(patience=0)
  for tokens in range(1, 10):
    monitor.observe(_eval(50.0, tokens * 1000))
  assert monitor.diverged is None
  monitor.observe(_eval(float("inf"), 10_000))
  assert monitor.diverged


def test_the_progress_line_has_the_run_s_place_loss_gap_and_speed_from_the_first_eval_on(caplog):
  monitor = _monitor(optimal_loss=1.0, virtual_clock=True)
  monitor.observe({"kind": "train", "outer_step": 1, "learner": 0, "loss": 2.0})
  monitor.observe({"kind": "train", "outer_step": 1, "learner": 1, "loss": 4.0})
  with caplog.at_level(logging.INFO):
    monitor.observe(_eval(2.5, 2000, wall=100.0, time=20.0))  # The first eval: compile time is before it.
    monitor.observe(_eval(2.0, 4000, wall=102.0, time=40.0))
  first, second = [r.getMessage() for r in caplog.records]
  assert first == "outer 2/10 | step 20 | loss 3.000 | eval 2.500 (optimum 1.000, gap 1.500) | virtual 20s"
  assert second == "outer 4/10 | step 40 | loss 3.000 | eval 2.000 (optimum 1.000, gap 1.000) | 1.0k tok/s | eta 6s"\
                   " | virtual 40s"

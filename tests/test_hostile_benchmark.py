"""The hostile benchmark's own bookkeeping (experiments/benchmarks/hostile.py): its windows, and its children's results."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from experiments.benchmarks import hostile

# pylint: disable=protected-access


@pytest.mark.slow
def test_the_hostile_benchmark_runs_to_the_end_with_no_honest_exchange_refused():
  # The attacker holds learner 4's credential and never trains: the start barrier must not wait for it.
  process = subprocess.run([sys.executable, "-m", "experiments.benchmarks.hostile", "--phase_seconds=4"],
                           capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert process.returncode == 0, process.stderr[-3000:]
  context, figures = (json.loads(line) for line in process.stdout.strip().splitlines()[-2:])
  assert context["run_done"] and figures["honest_refused"] == 0 and context["honest_exchanges"] > 0, (figures, context)
  assert sum(figures["refused"].values()) > 0, figures


def test_the_hostile_benchmark_charges_each_round_to_the_window_it_began_in():
  """Alternating windows share a change in the machine's load out between both phases, only if
  each round counts where it began and each phase divides by its own windows' seconds."""
  # Each window: its first and last samples (time, then the syncer's CPU and RSS, not needed here).
  spans = {"undisturbed": [((0,), (10,)), ((25,), (35,))], "attack": [((10,), (25,))]}
  begins = (-1, 0, 9.9, 10, 24.9, 25, 35)
  phases = [hostile._phase(t, spans) for t in begins]
  assert phases == ["other", "undisturbed", "undisturbed", "attack", "attack", "undisturbed", "other"]
  rounds = [(1.0, 0.5, "applied"), (12.0, 3.0, "applied"), (30.0, 1.5, "applied"), (40.0, 9.0, "applied")]
  assert hostile._fraction(rounds, "undisturbed", spans) == pytest.approx(2.0 / 20)
  assert hostile._fraction(rounds, "attack", spans) == pytest.approx(3.0 / 15)


def _exit_without_a_result(status: int) -> None:
  sys.exit(status)


def _put_a_result(results) -> None:
  results.put("result")


def test_the_hostile_benchmark_stops_at_once_when_a_child_dies_without_its_result():
  """A crashed attacker or learner puts nothing on its queue: the benchmark names it instead of waiting out its timeout."""
  context = multiprocessing.get_context("spawn")
  results = context.Queue()
  crashed = context.Process(target=_exit_without_a_result, args=(3,), name="attacker")
  crashed.start()
  start = time.monotonic()
  with pytest.raises(RuntimeError, match="attacker exited with status 3"):
    hostile._next(results, [crashed], 600)
  assert time.monotonic() - start < 60
  honest = context.Process(target=_put_a_result, args=(results,))
  honest.start()
  assert hostile._next(results, [honest], 60) == "result"
  with pytest.raises(TimeoutError, match="nothing from"):
    hostile._next(results, [], 0.1)
  for child in (crashed, honest):
    child.join()

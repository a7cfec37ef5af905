"""A faulty learner injected on the virtual clock, and the robust merge rules that contain it."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from decoupled_diloco import experiment, metrics as metrics_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.push import Push
from decoupled_diloco.runtime import byzantine, sim
from tests import helpers


def _delta():
  return {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)}


def _norm(tree):
  return math.sqrt(sum(float(np.sum(np.square(x))) for x in tree.values()))


@pytest.mark.parametrize("kind, expected", [("scaled", lambda d: {k: 100 * v for k, v in d.items()}),
                                            ("flipped", lambda d: {k: -v for k, v in d.items()})])
def test_scaled_and_flipped_pushes(kind, expected):
  out = byzantine.corrupt_delta(_delta(), kind, 100.0, np.random.default_rng(0))
  for key, value in expected(_delta()).items():
    np.testing.assert_array_equal(out[key], value)


def test_noise_has_the_honest_norm_no_signal_and_is_seeded():
  push = Push(1, _delta(), 0, 10, 2, delta_norm=_norm(_delta()))
  settings = byzantine.Settings(learner=1, kind="noise", scale=100.0, seed=0)
  first, again, later = (byzantine.corrupt(push, settings, steps) for steps in (4, 4, 8))
  assert _norm(first.delta) == pytest.approx(_norm(_delta()), rel=1e-5)
  assert first.delta_norm == pytest.approx(_norm(_delta()), rel=1e-5)
  np.testing.assert_array_equal(first.delta["a"], again.delta["a"])
  assert not np.array_equal(first.delta["a"], later.delta["a"])
  assert byzantine.corrupt(Push(0, _delta(), 0, 10, 2), settings, 4).delta is not None  # Another learner: as is.
  assert byzantine.corrupt(push, None, 4) is push


@pytest.mark.parametrize("overrides, message", [
    ({"failures.byzantine_learner": 2}, r"must be a learner in \[0, 2\)"),
    ({"failures.byzantine_learner": 0, "failures.byzantine_kind": "zero"}, "byzantine_kind='zero' is unknown"),
    ({"failures.byzantine_learner": 0, "runtime": "service"}, "runtime='service'"),
    ({"failures.byzantine_learner": 0, "compression.format": "int8"}, "format=fp32"),
    ({"syncer.merge_rule": "trimmed_mean", "syncer.quorum": 1}, r"raise syncer.quorum to >= 8"),
    ({"syncer.merge_rule": "trimmed_mean", "syncer.quorum": 2, "runtime": "service"}, "not built"),])
def test_settings_that_cannot_be_honoured_are_refused(overrides, message):
  config = helpers.tiny_config(mode="decoupled", runtime="sim")
  with pytest.raises(ConfigError, match=message):
    experiment.validate(experiment.with_overrides(config, overrides))


def _run(tmp_path, name, **overrides):
  """A short seeded run of 4 one-device learners, quorum 4: (summary, records)."""
  config = helpers.tiny_config(
      **{
          "mode": "decoupled", "runtime": "sim", "learners.devices": (1,) * 4, "learners.batch_size": (4,) * 4,
          "syncer.quorum": 4, "syncer.trim_fraction": 0.25, "outer_steps": 4, **overrides})
  workdir = os.fspath(tmp_path / name)
  exp = experiment.build(config)
  try:
    summary = sim.run(exp, workdir)
  finally:
    for learner in exp.learners:
      learner.batches.close()
  return summary, list(metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl")))


@pytest.mark.slow
def test_with_every_learner_honest_each_robust_rule_is_within_one_percent_of_the_mean(tmp_path):
  mean, _ = _run(tmp_path, "mean", **{"syncer.merge_rule": "mean"})
  assert mean["eval_loss"] < math.log(helpers.tiny_config().model.vocab_size)  # It learned.
  for rule in ("clip", "trimmed_mean"):
    robust, _ = _run(tmp_path, rule, **{"syncer.merge_rule": rule})
    assert robust["eval_loss"] == pytest.approx(mean["eval_loss"], rel=0.01), rule


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["scaled", "flipped", "noise"])
def test_a_faulty_learner_is_clipped_and_trimmed_and_recorded(tmp_path, kind):
  faulty = {"failures.byzantine_learner": 2, "failures.byzantine_kind": kind}
  _, clipped = _run(tmp_path, "clip", **{"syncer.merge_rule": "clip", **faulty})
  pushes = [r for r in clipped if r["kind"] == "push"]
  summaries = {r["learner"]: r for r in clipped if r["kind"] == "learner_summary"}
  if kind == "scaled":  # ×100: every push of learner 2 clipped to an honest size (c = 2), and no honest one.
    honest = max(r["checked_norm"] for r in pushes if r["learner"] != 2)
    assert all(
        r["clipped"] == 1 and r["checked_norm"] * r["clip_factor"] <= 2 * honest for r in pushes if r["learner"] == 2)
    assert summaries[2]["clipped"] == summaries[2]["pushes"] and summaries[0]["clipped"] == 0
  else:  # Honest size: its norm is recorded and judged like anyone's.
    assert all(r["checked_norm"] > 0 and "clip_factor" in r for r in pushes)
  _, trimmed = _run(tmp_path, "trimmed", **{"syncer.merge_rule": "trimmed_mean", **faulty})
  shares = {r["learner"]: r["trimmed_share"] for r in trimmed if r["kind"] == "learner_summary"}
  assert all(r["trimmed"] for r in trimmed if r["kind"] == "outer")
  if kind != "noise":  # ×100 or −Δ: trimmed at more coordinates than any honest learner.
    assert shares[2] > max(shares[m] for m in (0, 1, 3))


@pytest.mark.slow
def test_the_robust_merge_benchmark_runs_end_to_end_at_toy_size():
  """One round per row, mean and clip only: every row runs and the last line holds exactly `loss_ratio`."""
  result = subprocess.run(
      [sys.executable, "-m", "experiments.benchmarks.robust_merge", "--outer_steps=1", "--rules=mean,clip"],
      cwd=pathlib.Path(__file__).parents[1], env=helpers.quick_compile_env(), capture_output=True, text=True,
      timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  last = json.loads(result.stdout.strip().splitlines()[-1])
  assert set(last) == {"loss_ratio"} and set(last["loss_ratio"]) == {"mean", "clip"}
  assert all(set(row) == {"honest", "scaled", "flipped", "noise"} for row in last["loss_ratio"].values())
  assert last["loss_ratio"]["mean"]["honest"] == 1.0

"""Failures with real math on the virtual clock (runtime/failures.py): schedule, rejoin, runs."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from decoupled_diloco import experiment
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.costmodel import scale
from decoupled_diloco.runtime import failures, sim
from tests.helpers import quick_compile_env, tiny_config

FAILING = {
    "runtime": "sim", "failures.enabled": True, "failures.mtbi_seconds": 30.0, "failures.restart_seconds": 3.0,
    "failures.resize_seconds": 1.0, "failures.repair_seconds": 10.0, "outer_steps": 6}
DDP = {"mode": "ddp", "learners.devices": (2,), "learners.batch_size": (8,)}


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _records(workdir: pathlib.Path) -> list[dict]:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time", None)
  return records


def test_the_schedule_is_seeded_and_scales_with_the_chips():
  model = scale.FailureModel(mtbi_seconds=100.0)
  draws = [failures.next_failure(np.random.default_rng([0, 1]), 5.0, 4, model) for _ in range(2)]
  assert draws[0] == draws[1] > 5.0
  rng = np.random.default_rng(0)
  gaps = [failures.next_failure(rng, 0.0, 4, model) for _ in range(20_000)]
  assert np.mean(gaps) == pytest.approx(100.0 / 4, rel=0.03)  # A group of c chips fails at rate c / MTBI.
  assert failures.downtime(rng, 0.0) == 0.0
  assert failures.live_chips(512, 1, scale.FailureModel(domain_chips=256)) == 256
  assert failures.live_chips(512, 3, scale.FailureModel(domain_chips=256)) == 0


@pytest.mark.parametrize("overrides, message", [
    ({"runtime": "lockstep"}, "runtime=sim"),
    ({"mode": "diloco"}, "modes"),
    ({"mode": "decoupled", "failures.elastic": True}, "drop --config.failures.elastic"),
    ({"mode": "decoupled", "failures.checkpoint_every": 0}, "checkpoint_every"),
    ({"mode": "decoupled", "failures.mtbi_seconds": 0.0}, "mtbi_seconds"),])
def test_failure_settings_that_cannot_be_honoured_are_refused(overrides, message):
  config = tiny_config(**{**FAILING, **overrides})
  with pytest.raises(ConfigError, match=message):
    experiment.validate(config)


def test_a_rejoined_learner_has_theta_and_its_checkpointed_adamw_state():
  exp = experiment.build(tiny_config(mode="decoupled", runtime="sim"))
  learner = exp.learners[0]
  learner.start_from(exp.syncer.params, exp.syncer.versions)
  learner.step()
  saved = failures.checkpoint(learner, with_params=False)
  expected_opt, expected_step = _host(learner.state.opt_state), int(learner.state.step)
  for _ in range(3):
    learner.step()
  assert learner.steps == expected_step + 3
  theta = jax.tree.map(lambda x: x + 1.0, exp.syncer.params)  # A Θ that differs from every local param.
  for attempt in range(2):  # The checkpoint survives a rejoin and the donated steps after it.
    failures.rejoin(learner, saved, theta, 7)
    jax.tree.map(np.testing.assert_array_equal, _host(learner.state.params), _host(theta))
    jax.tree.map(np.testing.assert_array_equal, _host(learner.state.opt_state), expected_opt)
    assert int(learner.state.step) == learner.steps == expected_step
    assert learner.base_versions == [7] and learner.steps_since_push == [0]
    kept = [s for s, _ in learner.drain_losses()]  # The lost steps' losses are dropped.
    assert kept == ([0] if attempt == 0 else [])
    learner.step()


def test_decoupled_failures_are_deterministic_and_cost_goodput_not_tokens(tmp_path):
  config = tiny_config(mode="decoupled", **FAILING)
  summaries = [sim.run(experiment.build(config), str(tmp_path / name)) for name in ("a", "b")]
  assert _records(tmp_path / "a") == _records(tmp_path / "b")
  summary = summaries[0]
  assert summary["failures"] >= 1 and summary["lost_steps"] >= 1 and summary["down_seconds"] > 0
  assert sum(summary["steps"]) == config.outer_steps * config.inner_steps * 2  # Lost steps were redone.
  clean = sim.run(experiment.build(tiny_config(mode="decoupled", runtime="sim", outer_steps=6)), str(tmp_path / "c"))
  assert clean["failures"] is None  # The one summary schema: a field the run has no figure for is null.
  assert summary["goodput"] < clean["goodput"]


def test_elastic_ddp_keeps_the_math_and_pays_in_time_while_a_restart_loses_work(tmp_path):
  clean = sim.run(experiment.build(tiny_config(**DDP, runtime="sim", outer_steps=6)), str(tmp_path / "clean"))
  elastic = sim.run(
      experiment.build(
          tiny_config(**DDP, **FAILING,
                      **{"failures.elastic": True, "learners.chips": (8,), "failures.domain_chips": 2})),
      str(tmp_path / "elastic"))
  restart = sim.run(experiment.build(tiny_config(**DDP, **FAILING)), str(tmp_path / "restart"))
  assert elastic["failures"] >= 1 and restart["failures"] >= 1
  assert elastic["eval_loss"] == clean["eval_loss"]  # Fewer chips, same batches, same steps.
  assert elastic["virtual_seconds"] > clean["virtual_seconds"] and elastic["goodput"] < 1.0
  assert restart["lost_steps"] > restart["failures"]  # Everything since the checkpoint, not one step.
  assert restart["steps"] == clean["steps"] and restart["goodput"] < 1.0


ISSUE_KEYS = {  # The last line's keys, exactly, where the benchmark's issue names them all.
    "failure_quality": {"eval_loss", "goodput"}, "hetero_quality": {"eval_loss", "time_to_target"},
    "compression_quality": {"eval_loss"}, "h_sweep": {"eval_loss"}}
ROWS = {  # Rows every JSON map holds at the tiny size.
    "hetero_quality": {"ddp", "sync_diloco", "async_naive", "decoupled", "decoupled_homogeneous"},
    "compression_quality": {"fp32", "int4", "int2"}, "h_sweep": {"1", "2"}}
FLAGS = {"compression_quality": ["--formats=fp32,int4,int2"]}  # The rows it needs: each other format is one more.


@pytest.mark.parametrize(
    "benchmark",
    ["failure_quality", "quorum_grace", "learners_sweep", "hetero_quality", "compression_quality", "h_sweep"])
def test_paper_benchmarks_run_end_to_end(benchmark, tmp_path):
  """Tiny sizes on a small text file: the rows, the runs and the JSON line still fit together."""
  text = tmp_path / "text.txt"
  words = np.random.default_rng(0).choice(["to", "be", "or", "not", "that", "is", "the", "question"], 40_000)
  text.write_text(" ".join(words))
  result = subprocess.run([
      sys.executable, "-m", f"experiments.benchmarks.{benchmark}", "--size=tiny", f"--data_path={text}",
      *FLAGS.get(benchmark, [])], cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=900,
                          env=quick_compile_env())
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  figures = json.loads(lines[-1])
  assert all(np.isfinite(v) for v in figures["eval_loss"].values())
  if benchmark in ISSUE_KEYS:  # The issue's keys and nothing else.
    assert set(figures) == ISSUE_KEYS[benchmark]
  if benchmark in ROWS:
    assert all(set(figures[key]) == ROWS[benchmark] for key in ISSUE_KEYS[benchmark]), figures
  if benchmark == "compression_quality":  # The streamed rows too, on the context line.
    assert set(json.loads(lines[-2])["eval_loss_streaming"]) == {"fp32", "int4"}
  if benchmark in ("failure_quality", "quorum_grace"):
    assert set(figures["goodput"]) == set(figures["eval_loss"]) and len(figures["goodput"]) == 3
    assert all(0 < g <= 1 for g in figures["goodput"].values())

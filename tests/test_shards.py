"""Syncer shards: fragments dealt to shards by bytes, and S shards on the virtual clock equal to one syncer."""

import json

import chex
import jax
import numpy as np
import pytest

from decoupled_diloco import experiment, shards
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import sim
from decoupled_diloco.service import settings as service_settings
from tests.helpers import tiny_config


def test_fragments_go_to_shards_balanced_by_bytes_with_fragment_0_on_shard_0():
  assert shards.assign([10, 40, 30, 20], 2) == (0, 0, 1, 1)  # 40+10 | 30+20: loads 50 and 50.
  assert shards.assign([5, 100, 1, 1, 1], 2) == (0, 1, 0, 0, 0)  # The big one alone; the rest with fragment 0.
  assert shards.assign([7, 7, 7], 3) == (0, 1, 2)
  assert shards.assign([7, 7, 7], 1) == (0, 0, 0)
  loads = [0, 0, 0]
  sizes = [3, 9, 4, 8, 5, 7, 6, 6]
  for size, shard in zip(sizes, shards.assign(sizes, 3)):
    loads[shard] += size
  assert sorted(loads) == [14, 17, 17] and sum(loads) == sum(sizes)  # (48 over 3: within one tensor of even)


@pytest.mark.parametrize("num_shards", [0, 5, 1.5, "2"])
def test_a_shard_count_outside_1_to_the_fragments_is_refused(num_shards):
  with pytest.raises(ConfigError, match=r"service.shards=.* must be an int in \[1, 4\]"):
    shards.assign([1, 2, 3, 4], num_shards)


def test_a_config_with_more_shards_than_fragments_is_refused_before_anything_runs():
  with pytest.raises(ConfigError, match="service.shards=2 must be an int in"):
    experiment.validate(tiny_config(**{"runtime": "sim", "service.shards": 2}))
  with pytest.raises(ConfigError, match="no syncer to shard"):
    experiment.validate(
        tiny_config(**{"mode": "ddp", "learners.devices": (2,), "learners.batch_size": (4,), "service.shards": 2}))


def _records(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time", None)
  return records


def _streaming(num_shards: int):
  return tiny_config(
      **{
          "mode": "decoupled", "runtime": "sim", "learners.speed": (1.0, 2.0), "learners.jitter": 0.2,
          "policy.kind": "dylu", "syncer.quorum": 1, "syncer.staleness": "polynomial", "outer_steps": 3,
          "inner_steps": 6, "streaming.num_fragments": 4, "streaming.strategy": "balanced",
          "streaming.overlap_steps": 1, "service.shards": num_shards, "syncer.grace_gamma": 0.0
      })  # Each shard sizes its own grace window from its own estimates (syncer-shards.md).


def test_shards_on_the_virtual_clock_write_the_same_records_as_one_syncer_bit_for_bit(tmp_path):
  runs = {}
  for num_shards in (1, 3):
    exp = experiment.build(_streaming(num_shards))
    sim.run(exp, str(tmp_path / str(num_shards)))
    runs[num_shards] = (_records(tmp_path / str(num_shards)), jax.tree.map(np.asarray, exp.syncer.params), exp)
  one = runs[1]
  assert sum(r["kind"] == "outer" for r in one[0]) > 8 and {r["fragment"] for r in one[0] if r["kind"] == "outer"} \
      == {0, 1, 2, 3}
  for num_shards in (3,):
    records, params, exp = runs[num_shards]
    assert len(exp.syncer.shards) == num_shards
    assert records == one[0]
    chex.assert_trees_all_equal(params, one[1])
    # Each shard holds only the leaves of its own fragments.
    held = [len(jax.tree.leaves(shard.params)) for shard in exp.syncer.shards]
    assert sum(held) == len(jax.tree.leaves(params)) and min(held) >= 1


def test_the_shards_benchmark_runs_both_shard_counts_at_a_toy_size():
  from experiments.benchmarks import syncer_shards  # pylint: disable=g-import-not-at-top
  figures = syncer_shards.measure(200_000, 4, 1)
  assert {"memory_per_shard_ratio", "throughput_ratio"} <= figures.keys()
  for num_shards, rows in figures["per_shard"].items():
    assert len(rows) == num_shards and sum(r["fragments"] for r in rows) == 4
    assert all(r["outer_steps_per_second"] > 0 and r["bytes_per_second"] > 0 for r in rows)
  assert figures["throughput_ratio"] > 0


@pytest.mark.slow  # A simulation SIGKILLed and resumed: the fast subset leaves it out.
def test_a_sharded_simulation_killed_mid_run_resumes_to_the_uninterrupted_records(tmp_path):
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  from tests import test_sim_resume  # pylint: disable=g-import-not-at-top
  overrides = {**test_sim_resume.OVERRIDES, "service.shards": 2}  # Grace windows, τ, error feedback: per shard.
  sim.run(experiment.build(tiny_config(**overrides)), str(tmp_path / "once"))
  child = test_sim_resume.CHILD.replace("tiny_config(**RUNS[sys.argv[2]])",
                                        "tiny_config(**RUNS[sys.argv[2]], **{'service.shards': 2})")
  assert child != test_sim_resume.CHILD
  killed = subprocess.run(
      [sys.executable, "-c", child, str(tmp_path / "twice"), "streaming"], cwd=test_sim_resume.REPO,
      capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  assert 0 < len(_records(tmp_path / "twice")) < len(_records(tmp_path / "once"))
  sim.run(experiment.build(tiny_config(**{**overrides, "resume": True})), str(tmp_path / "twice"))
  assert _records(tmp_path / "twice") == _records(tmp_path / "once")


def test_shards_refuse_evaluating_on_a_syncer_and_take_an_evaluator():
  config = tiny_config(**{"service.shards": 2, "service.evaluate_on": "syncer"})
  with pytest.raises(ConfigError, match="leaves no syncer holding Θ whole to evaluate: set --config.service.eval"):
    service_settings.Settings.from_config(config.service)
  for where in ("evaluator", "none"):
    config.service.evaluate_on = where
    assert service_settings.Settings.from_config(config.service).shards == 2

"""Virtual-clock resume: a run SIGKILLed mid-flight and resumed writes what an uninterrupted run writes."""

import json
import pathlib
import signal
import subprocess
import sys

import pytest

from decoupled_diloco import experiment
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import sim
from tests.helpers import tiny_config

REPO = pathlib.Path(__file__).parents[1]

# Everything that carries state across events: streaming fragments in flight (τ = 1), error
# feedback residuals, a grace window, staleness, jittered step times, DyLU on two speeds and Muon's
# inner state (its momentum and its AdamW half's moments, partitioned over the params).
OVERRIDES = {
    "inner.optimizer": "muon", "mode": "decoupled", "runtime": "sim", "learners.speed":
        (1.0, 2.0), "policy.kind": "dylu", "syncer.quorum": 1, "syncer.grace_gamma": 0.5,
    "syncer.grace_overlap_steps": 2.0, "streaming.num_fragments": 2, "streaming.strategy": "balanced",
    "streaming.overlap_steps": 1, "compression.format": "int8", "compression.error_feedback": True,
    "learners.jitter": 0.2, "sim.link_latency_seconds": 0.3, "outer_steps": 4, "inner_steps": 4, "checkpoint_every": 1}
# Robust merges with a faulty learner: the clip rule's recent norms, a trimmed mean's held pushes (quorum 4:
# open across checkpoints) and the noise learner's draws carry state across a checkpoint too.
_ROBUST = {
    "mode": "decoupled", "runtime": "sim", "learners.devices": (1,) * 4, "learners.batch_size": (4,) * 4,
    "learners.jitter": 0.2, "syncer.quorum": 4, "syncer.trim_fraction": 0.25, "failures.byzantine_learner": 1,
    "failures.byzantine_kind": "noise", "outer_steps": 4, "inner_steps": 4, "checkpoint_every": 1}
RUNS = {
    "streaming": OVERRIDES, "clip": {**_ROBUST, "syncer.merge_rule": "clip"},
    "trimmed_mean": {**_ROBUST, "syncer.merge_rule": "trimmed_mean"}}

# The child runs the same simulation and SIGKILLs itself 15 events after its first checkpoint,
# so records past the checkpoint are on disk and must be replaced by the resumed run.
CHILD = """
import os, signal, sys
from decoupled_diloco import experiment
from decoupled_diloco.runtime import sim, sim_checkpoint
from tests import conftest  # 8 virtual CPU devices, as in the parent.
from tests.helpers import tiny_config
from tests.test_sim_resume import RUNS
since_save, call = [], sim_checkpoint.Cadence.__call__
def cadence(self):
  before = self.every.next
  call(self)
  if since_save or self.every.next > before:
    since_save.append(1)
  if len(since_save) > 15:
    os.kill(os.getpid(), signal.SIGKILL)
sim_checkpoint.Cadence.__call__ = cadence
sim.run(experiment.build(tiny_config(**RUNS[sys.argv[2]])), sys.argv[1])
"""


def _records(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time")
  return records


@pytest.mark.parametrize(
    "run",
    ["streaming",
     pytest.param("clip", marks=pytest.mark.slow),
     pytest.param("trimmed_mean", marks=pytest.mark.slow)])
def test_a_killed_simulation_resumes_and_writes_the_uninterrupted_records(tmp_path, run):
  overrides = RUNS[run]
  reference = sim.run(experiment.build(tiny_config(**overrides)), str(tmp_path / "once"))
  killed = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "twice"), run], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  partial = _records(tmp_path / "twice")
  expected = _records(tmp_path / "once")
  assert 0 < len(partial) < len(expected)  # Killed mid-run, after writing records.

  with pytest.raises(ConfigError, match="pass --config.resume=True"):
    sim.run(experiment.build(tiny_config(**overrides)), str(tmp_path / "twice"))
  with pytest.raises(ConfigError, match="another config"):
    sim.run(experiment.build(tiny_config(**{**overrides, "resume": True, "syncer.staleness_a": 0.25})),
            str(tmp_path / "twice"))
  resumed = sim.run(experiment.build(tiny_config(**{**overrides, "resume": True})), str(tmp_path / "twice"))
  assert _records(tmp_path / "twice") == expected
  assert {k: v for k, v in resumed.items() if k != "wall_time"
         } == {k: v for k, v in reference.items() if k != "wall_time"}
  with pytest.raises(ConfigError, match="finished run"):
    sim.run(experiment.build(tiny_config(**{**overrides, "resume": True})), str(tmp_path / "twice"))

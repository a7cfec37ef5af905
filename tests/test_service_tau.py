"""τ (streaming.overlap_steps) means the same on the virtual clock and in the service runtime.

One learner (so the order of pushes does not depend on who is faster) runs the same config on
the sim and as real processes (a syncer and a learner on localhost); each push's fragment and
local_steps must agree: fragment p is pushed after step t_p of every H-step period, Θ_p lands
τ steps later and the next push of p counts from there (docs/syncer.md, issue 14 deviation 5).
Before the fix the service overlapped one round whatever τ said, and counted from the push.
"""

import os

import pytest

from decoupled_diloco import experiment, metrics as metrics_lib
from decoupled_diloco.runtime import sim
from experiments.launch_local import LocalCluster
from tests import service_config

CONFIG = "tests/service_config.py"
ONE_LEARNER = {
    "learners.devices": (1,), "learners.batch_size": (4,), "outer_steps": 3, "inner_steps": 4, "syncer.quorum": 1}


def _pushes(path) -> list[tuple[int, int]]:
  return [(r["fragment"], r["local_steps"]) for r in metrics_lib.read_metrics(path) if r["kind"] == "push"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "num_fragments, tau, expected",
    [
        (2, 1, [(0, 2), (1, 4), (0, 3), (1, 3), (0, 3), (1, 3), (0, 1)]),  # Offsets 2, 4; Θ_p lands a step later.
        (1, 2, [(0, 4), (0, 2), (0, 2)]),  # Each landing drops the 2 steps after the push (α = 0).
    ])
def test_the_same_tau_gives_the_same_push_counts_on_the_sim_and_the_service(tmp_path, num_fragments, tau, expected):
  settings = {
      **ONE_LEARNER, "streaming.num_fragments": num_fragments, "streaming.overlap_steps": tau,
      "streaming.strategy": "balanced"}
  config = service_config.get_config()
  config.update_from_flattened_dict(dict(settings, runtime="sim"))
  sim.run(experiment.build(config), str(tmp_path / "sim"))
  assert _pushes(tmp_path / "sim" / "metrics.jsonl") == expected

  overrides = [f"--config.{key}={value}" for key, value in settings.items()]
  run = LocalCluster(CONFIG, str(tmp_path / "service"), overrides, 1, env=dict(os.environ, DD_SYNCER_TOKEN="t" * 32))
  try:
    run.start()
    assert run.wait(300.0) == {"syncer": 0, "learner_0": 0}
  finally:
    run.stop()
  assert _pushes(tmp_path / "service" / "metrics.jsonl") == expected

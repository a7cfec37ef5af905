"""A push that waits in an open grace window is answered with that window's merge, in every runtime.

docs/syncer.md ("Grace window"): the virtual clock replies to such a push with the merge that holds
it; the threads runtime and the gRPC service used to answer at once with the Θ from before the
merge, so the learner went on from a Θ without its own push and its next push was one version stale.
"""

import os
import threading
import time

import jax
import numpy as np
import pytest

from decoupled_diloco import experiment, metrics as metrics_lib, model as model_lib, outer
from decoupled_diloco.runtime import sim, threads
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import wire
from decoupled_diloco.syncer import Settings, Syncer
from experiments.launch_local import LocalCluster
from tests import service_config
from tests.helpers import wait_for

CONFIG = "tests/service_config.py"
# Quorum 1 with a window far longer than a round (γ·τ_g·ξ_step): the first push of a round opens it and
# every merge waits for the second learner ("all M reported"), whatever the timing. So each merge holds
# both learners and, if every learner receives the merge its push waited for, every push has staleness 0.
HUGE_WINDOW = {
    "outer_steps": 3, "inner_steps": 4, "syncer.quorum": 1, "syncer.grace_gamma": 0.9,
    "syncer.grace_overlap_steps": 1e6}


def _core(directory):
  params = model_lib.build_model(service_config.get_config().model, 0)[1]
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2),
                  Settings(quorum=1, grace_gamma=0.5, grace_overlap_steps=80.0))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(directory), checkpoint_every_merges=10,
                             lease_seconds=60.0, metadata={})
  core.start(time.time())
  return core, params


def test_a_service_pull_waits_for_the_merge_of_the_grace_window_its_push_is_in(tmp_path):
  """ξ_step = 0.1 s / 4 steps, so learner 0's push (quorum 1) opens a 0.5 · 80 · 0.025 = 1 s window.
  Its pull waits, the core's lock released (learner 1's pull and the tick go through meanwhile), and
  returns the window's merge, version 1, once the tick closes it. Before: version 0 at once."""
  core, params = _core(tmp_path)
  now = time.time()
  payload = bytearray(b"".join(wire.encode(jax.tree.map(lambda x: np.full(x.shape, 0.01, np.float32), params))))
  header = {
      "learner": 0, "seq": 0, "base_version": 0, "fragment": 0, "tokens": 64, "local_steps": 4, "budget_steps": 4,
      "budget_tokens": 64, "compute_seconds": 0.1, "payload_bytes": len(payload), "incarnation": 0}
  assert core.push(header, payload, now)["status"] == "applied"
  assert core.syncer.fragments[0].deadline == pytest.approx(now + 1.0)
  replies, bounds = [], []
  waiter = threading.Thread(target=lambda: replies.append(core.pull(0, 0, 0, now, on_wait=bounds.append)))
  waiter.start()
  assert wait_for(lambda: bounds) and waiter.is_alive()  # It waits; an answer at once never calls on_wait.
  assert bounds == [pytest.approx(1.0 + 5.0)]  # Deadline + the tick's slack.
  status, theta = core.pull(1, 0, 0, now)  # Learner 1 pushed nothing: answered at once, Θ unchanged.
  assert status["versions"] == [0] and theta is None
  core.tick(now + 1.0)  # The window closes: merge.
  waiter.join(5.0)
  assert not waiter.is_alive()
  status, theta = replies[0]
  assert status["versions"] == [1] and theta is not None
  for fragment in (-1, 1):  # A fragment the run does not have: refused as before, not waited on.
    with pytest.raises(wire.WireError, match="is not in"):
      core.pull(0, fragment, 0, now)
  core.close()


def _pushes_and_merges(path):
  records = metrics_lib.read_metrics(path)
  pushes = [(r["learner"], r["staleness"]) for r in records if r["kind"] == "push"]
  merges = [sorted(r["learners"]) for r in records if r["kind"] == "outer"]
  return sorted(pushes), merges


def _config(runtime):
  config = service_config.get_config()
  config.update_from_flattened_dict(dict(HUGE_WINDOW, runtime=runtime))
  return config


EXPECTED = ([(0, 0)] * 3 + [(1, 0)] * 3, [[0, 1]] * 3)


def test_the_sim_and_threads_answer_a_push_in_a_grace_window_with_its_merge(tmp_path):
  sim.run(experiment.build(_config("sim")), str(tmp_path / "sim"))
  assert _pushes_and_merges(tmp_path / "sim" / "metrics.jsonl") == EXPECTED
  threads.run(experiment.build(_config("threads")), str(tmp_path / "threads"))
  assert _pushes_and_merges(tmp_path / "threads" / "metrics.jsonl") == EXPECTED


@pytest.mark.slow
def test_the_service_answers_a_push_in_a_grace_window_with_its_merge_as_the_sim_does(tmp_path):
  overrides = [f"--config.{key}={value}" for key, value in HUGE_WINDOW.items()]
  run = LocalCluster(CONFIG, str(tmp_path), overrides, 2, env=dict(os.environ, DD_SYNCER_TOKEN="t" * 32))
  try:
    run.start()
    assert run.wait(300.0) == {"syncer": 0, "learner_0": 0, "learner_1": 0}
  finally:
    run.stop()
  assert _pushes_and_merges(tmp_path / "metrics.jsonl") == EXPECTED

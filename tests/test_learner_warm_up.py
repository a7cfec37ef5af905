"""A learner's warm-up compiles what its first pushes and landings would, and changes no result.

Why it matters: a restarted learner process warms up during its start-up (service/learner_main.py),
so the programs of a push and a landing (scanned layers' layout converters, a compressed format's
encoder and error feedback, α's blend) are not compiled in its first round, after it counts as
started, where the chaos benchmark's `rest` would hold them. Each check compares twin learners
built from one seeded config, one warmed up and one not, through the same steps, pushes and landings.
"""

import jax
import numpy as np

from decoupled_diloco import experiment, fragments
from tests import helpers

# Every program a warm-up covers: stacked layers, int4 with error feedback, α > 0, two fragments; Muon's state.
_OVERRIDES = {
    "inner.optimizer": "muon", "mode": "decoupled", "runtime": "sim", "model.scan_layers": True,
    "compression.format": "int4", "compression.error_feedback": True, "streaming.alpha": 0.5,
    "streaming.num_fragments": 2, "streaming.strategy": "balanced"}


def _programs(caplog) -> list[str]:
  return [r.getMessage().split(" with ")[0] for r in caplog.records if r.getMessage().startswith("Compiling ")]


def _started(warm: bool, caplog):
  """A learner started from Θ (its own initial params, on the host), warmed up or not: (learner, Θ, lowered).

  Its programs are new to this process: jax keeps compiled programs in memory by function, so a twin built
  earlier (or another test) would have compiled them already.
  """
  jax.clear_caches()
  learner = experiment.build(helpers.tiny_config(**_OVERRIDES)).learners[0]
  theta = jax.device_get(learner.params)
  learner.start_from(theta, 0)
  caplog.clear()
  if warm:
    learner.warm_up()
  return learner, theta, _programs(caplog)


def _rounds(learner, theta, caplog) -> tuple[list, list[str]]:
  """Steps, a push of each fragment, landings of a moved Θ_p, and a second push of each (the residual folded in):
  what the pushes sent, and the programs the pushes and landings lowered (the steps' are left out)."""
  sent, lowered = [], []
  for round_index in range(2):
    learner.step()
    learner.step()
    jax.block_until_ready(learner.state)
    caplog.clear()
    for p in range(learner.num_fragments):
      sent.append(jax.device_get(learner.push(p).delta))
      moved = jax.tree.map(lambda x, r=round_index: x + 0.01 * (r + 1), fragments.select(theta, learner.assignment, p))
      learner.land(p, moved, round_index + 1)
    lowered += _programs(caplog)
  return sent, lowered


def _arrays(learner) -> list:
  return [learner.state, learner.residuals, learner.anchors, learner.pushed]


def _counts(learner) -> tuple:
  return learner.steps, learner.base_versions, learner.steps_since_push, learner.tokens_since_push


def test_a_warm_up_compiles_the_first_pushes_and_landings_and_changes_no_result(compile_log):
  cold, theta, _ = _started(False, compile_log)
  cold_sent, after_start = _rounds(cold, theta, compile_log)
  assert after_start, "without a warm-up the first pushes and landings compile their programs"
  warm, _, warmed = _started(True, compile_log)
  assert sorted(set(warmed)) == sorted(set(after_start)), "the warm-up lowers what the first pushes and landings do"
  warm_sent, after_warm_up = _rounds(warm, theta, compile_log)
  assert not after_warm_up, f"compiled after the warm-up, in what would be the first round: {after_warm_up}"
  # The warm-up changed no state: the same payloads, params, optimizer state, residuals, anchors and counts.
  for a, b in zip(jax.tree.leaves(cold_sent), jax.tree.leaves(warm_sent), strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(_arrays(cold)), jax.tree.leaves(_arrays(warm)), strict=True):
    np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))
  assert _counts(cold) == _counts(warm)
  np.testing.assert_array_equal(cold.batches.batch(cold.steps), warm.batches.batch(warm.steps))

"""The virtual-clock runtime, hardware profiles and local-step policies, end to end."""

import shutil

import chex
import jax
import numpy as np
import pytest

from decoupled_diloco import experiment, hardware, policy
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import schedule
from decoupled_diloco.runtime import lockstep, sim
from tests.helpers import read_records as _records
from tests.helpers import tiny_config


def _params(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _hetero(**overrides):
  """Two learners, the second twice as fast (relative speeds), DyLU, quorum 1."""
  base = {
      "mode": "decoupled", "runtime": "sim", "learners.speed": (1.0, 2.0), "policy.kind": "dylu", "syncer.quorum": 1,
      "outer_steps": 4, "inner_steps": 4}
  return tiny_config(**{**base, **overrides})


@pytest.mark.slow  # Long: the fast subset leaves it to CI.
def test_equal_speeds_with_full_quorum_reproduce_synchronous_diloco_exactly(tmp_path):
  decoupled = experiment.build(
      tiny_config(
          **{
              "mode": "decoupled", "runtime": "sim", "syncer.quorum": 0, "syncer.staleness": "constant",
              "syncer.grace_gamma": 0.0}))
  sync = experiment.build(tiny_config(mode="diloco"))
  summary = sim.run(decoupled, str(tmp_path / "sim"))
  lockstep.run(sync, str(tmp_path / "lockstep"))
  assert summary["outer_updates"] == sync.syncer.version == 3
  chex.assert_trees_all_equal(_params(decoupled.global_params), _params(sync.global_params))
  for a, b in zip(decoupled.learners, sync.learners):  # (the simulated learners already pulled the last Θ)
    chex.assert_trees_all_equal(_params(a.state.opt_state), _params(b.state.opt_state))


def test_a_seeded_simulation_gives_identical_metrics_twice(tmp_path):
  config = _hetero(**{"learners.jitter": 0.2, "syncer.staleness": "polynomial"})
  for name in ("a", "b"):
    sim.run(experiment.build(config), str(tmp_path / name))
  assert _records(tmp_path / "a") == _records(tmp_path / "b")
  assert len(_records(tmp_path / "a", "push")) > 4


def test_faster_learners_take_more_local_steps_and_nobody_waits(tmp_path):
  """Without a grace window (the decoupled default waits up to ~2 steps for a round's other pushes)."""
  summary = sim.run(experiment.build(_hetero(**{"syncer.grace_gamma": 0.0})), str(tmp_path))
  pushes = _records(tmp_path, "push")
  # The last push of each learner may be short: the run's token budget ran out.
  slow_steps, fast_steps = ([p["local_steps"] for p in pushes if p["learner"] == m][:-1] for m in (0, 1))
  assert set(slow_steps) == {2} and set(fast_steps) == {4} and len(slow_steps) >= 4
  assert {"learner", "local_steps", "tokens", "staleness", "time"} <= pushes[0].keys()
  assert all(p["pseudo_gradient_norm"] > 0 for p in pushes)  # ‖Δ‖ per push, per learner in TensorBoard.
  slow, fast = (r for r in _records(tmp_path, "learner_summary"))
  assert fast["steps"] >= 1.8 * slow["steps"]
  assert slow["idle_seconds"] == fast["idle_seconds"] == 0.0  # free links: no waiting at all
  # Every step was useful; only the tail after the token budget ran out is unused.
  assert summary["goodput"] == pytest.approx(
      (slow["busy_seconds"] + fast["busy_seconds"]) / (2 * summary["virtual_seconds"]))
  assert summary["goodput"] > 0.95
  assert max(int(s) for s in fast["staleness_histogram"]) >= 1  # merges happen between a learner's pushes


def test_synchronous_diloco_on_the_clock_makes_the_fast_learner_wait(tmp_path):
  summary = sim.run(experiment.build(_hetero(mode="diloco", **{"policy.kind": "fixed"})), str(tmp_path))
  slow, fast = _records(tmp_path, "learner_summary")
  assert slow["idle_seconds"] == 0.0
  assert fast["idle_seconds"] == pytest.approx(fast["busy_seconds"])  # half its time spent waiting
  assert summary["goodput"] == pytest.approx(0.75)


def test_time_budget_rounds_fit_the_budget(tmp_path):
  sim.run(experiment.build(_hetero(**{"policy.kind": "time_budget", "policy.round_seconds": 1.5})), str(tmp_path))
  pushes = _records(tmp_path, "push")
  assert set([p["local_steps"] for p in pushes if p["learner"] == 1][:-1]) == {3}  # 0.5 s steps
  assert set([p["local_steps"] for p in pushes if p["learner"] == 0][:-1]) == {1}  # 1 s steps


def test_link_costs_show_up_as_idle_time(tmp_path):
  config = _hetero(**{"sim.link_latency_seconds": 0.25})
  sim.run(experiment.build(config), str(tmp_path))
  slow, _ = _records(tmp_path, "learner_summary")
  assert slow["idle_seconds"] >= 0.5  # a push and a pull per round, 0.25 s each


def test_hardware_profiles_follow_the_chip_table():
  v5p = hardware.HardwareProfile("v5p", chips=16, mfu=0.5, speed=1.0)
  v6e = hardware.HardwareProfile("v6e", chips=16, mfu=0.5, speed=1.0)
  assert v5p.mean_step_seconds(459e12 * 8) == pytest.approx(1.0)
  assert v5p.mean_step_seconds(1e15) / v6e.mean_step_seconds(1e15) == pytest.approx(2.0)
  jittery = hardware.HardwareProfile("relative", 1, 1.0, speed=2.0, jitter=0.3)
  samples = [jittery.step_seconds(0, np.random.default_rng(i)) for i in range(4000)]
  assert np.mean(samples) == pytest.approx(0.5, rel=0.03) and np.std(samples) > 0.1


def test_dylu_steps_scale_with_speed():
  assert [policy.dylu_steps(v, 4.0, 20) for v in (4.0, 2.0, 1.0, 0.1)] == [20, 10, 5, 1]
  assert policy.dylu_steps(1.0, 1.18, 20) == 16  # the paper's floor: a round up to a step short of the fastest's
  # Rounded to the nearest step, a round of every speed lasts the fastest's to within half a step.
  for speed in np.linspace(0.05, 1.0, 96):
    assert abs(policy.dylu_steps(speed, 1.0, 20, "nearest") - 20 * speed) <= 0.5 + 1e-9
  tracker = policy.SpeedTracker([1.0, 1.0], ema=0.5)
  tracker.observe(1, 0.25)  # measured 4 steps/s: estimate moves halfway
  assert tracker.speeds == [1.0, 2.5] and tracker.max_speed == 2.5
  fresh = policy.SpeedTracker([0.0])
  fresh.observe(0, 0.5)  # No estimate yet: the first measurement is taken as it is.
  assert fresh.speeds == [2.0]


@pytest.mark.parametrize(
    "kind, source, own, others, expected",
    [
        ("dylu", "measured", 0.0, 9.0, 20),  # Not measured yet: a round of H.
        ("dylu", "measured", 2.0, 8.0, 5),  # A quarter of the fastest other learner's speed.
        ("dylu", "measured", 8.0, 2.0, 20),  # The fastest itself.
        ("dylu", "declared", 8.0, 2.0, 10),  # Declared speeds 1 of 2: half of H, whatever was measured.
        ("fixed", "measured", 2.0, 8.0, 20),
        ("time_budget", "declared", 0.0, 0.0, 20),
        ("time_budget", "declared", 4.0, 0.0, 12),  # 3 s of budget at 4 steps/s.
    ])
def test_measured_round_steps(kind, source, own, others, expected):
  config = tiny_config(**{"policy.kind": kind, "policy.speed_source": source, "policy.round_seconds": 3.0})
  assert policy.measured_round_steps(config.policy, 20, own, others, 1.0, 2.0) == expected


@pytest.mark.parametrize("overrides, message", [
    ({"learners.hardware": ("v7",)}, "learners.hardware"),
    ({"learners.speed": (1.0, 2.0, 3.0)}, "learners.speed has 3 entries"),
    ({"policy.kind": "greedy"}, "policy.kind"),
    ({"syncer.merge_rule": "median"}, "syncer.merge_rule"),
    ({"runtime": "lockstep"}, "needs a clock"),])
def test_bad_simulation_configs_name_the_fix(overrides, message):
  with pytest.raises(ConfigError, match=message):
    experiment.validate(_hetero(**overrides))


def test_ddp_runs_on_the_clock_with_its_own_pace(tmp_path):
  config = tiny_config(**{
      "mode": "ddp", "runtime": "sim", "learners.devices": (2,), "learners.batch_size": (4,), "learners.speed": (4.0,)})
  summary = sim.run(experiment.build(config), str(tmp_path))
  assert summary["steps"] == [12] and summary["virtual_seconds"] == pytest.approx(3.0)
  assert summary["goodput"] == 1.0 and summary["outer_updates"] == 0
  assert len(_records(tmp_path, "eval")) == 3


def test_decoupled_learners_size_their_schedule_by_their_share_of_the_budget():
  config = _hetero()  # speeds (1, 2), budget 4 x 4 x 2 = 32 steps
  profiles = hardware.profiles_from_config(config.learners, 1.0)
  assert schedule.expected_steps(config, profiles, [1.0, 1.0]) == [11, 21]
  config.mode = "diloco"
  assert schedule.expected_steps(config, profiles, [1.0, 1.0]) == [16, 16]


@pytest.mark.slow  # Long: the fast subset leaves it to CI.
def test_a_rerun_after_a_crash_keeps_no_records_of_the_crashed_attempt(tmp_path):
  config = _hetero()
  sim.run(experiment.build(config), str(tmp_path / "once"))
  sim.run(experiment.build(config), str(tmp_path / "twice"))
  shutil.rmtree(tmp_path / "twice" / "checkpoints")  # as if it died before its checkpoint
  sim.run(experiment.build(config), str(tmp_path / "twice"))
  assert _records(tmp_path / "twice") == _records(tmp_path / "once")


def test_synchronous_diloco_honours_the_configured_merge_rule_and_token_weighting(tmp_path):
  """mode='diloco' used Settings() whatever config.syncer said (issue 14): now the weighting and the
  rule apply (docs/syncer.md), with quorum = all and staleness 0 implied."""

  def run(name, **syncer):
    config = tiny_config(
        **{
            "runtime": "sim", "outer_steps": 1, "inner_steps": 2, "learners.batch_size": (4, 8), **{
                f"syncer.{k}": v for k, v in syncer.items()}})
    exp = experiment.build(config)
    assert exp.syncer.quorum == 2  # Every learner, though the default config's quorum is 1.
    sim.run(exp, str(tmp_path / name))
    return _records(tmp_path / name, "outer")[0]["weights"], _params(exp.syncer.params)

  plain, mean = run("tokens")
  squared, _ = run("squared", token_weighting="tokens_squared_per_step")
  np.testing.assert_allclose(plain, [1 / 3, 2 / 3], rtol=1e-6)  # Tokens 1 : 2.
  np.testing.assert_allclose(squared, [0.2, 0.8], rtol=1e-6)  # tokens²/steps 1 : 4.
  _, rda = run("rda", merge_rule="rda")
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(rda)))


@pytest.mark.parametrize("overlap", [0, 2])
def test_a_push_waiting_in_a_grace_window_gets_the_merge_that_includes_it(tmp_path, overlap):
  """The grace window holds a merge open so that the learners in it receive a Θ with their own push
  (docs/syncer.md); the virtual clock replied with the Θ from before the merge (issue 14), so every
  learner's next push started from a Θ without its previous one."""
  config = _hetero(
      **{
          "learners.speed": (1.0, 1.1), "policy.kind": "fixed", "syncer.grace_gamma": 0.8,
          "syncer.grace_overlap_steps": 2.0, "streaming.overlap_steps": overlap})
  sim.run(experiment.build(config), str(tmp_path))
  merges = _records(tmp_path, "outer")
  assert any(len(r["learners"]) == 2 for r in merges)  # The window did hold merges open for the other.
  for m in (0, 1):
    merged_in = [r["outer_step"] for r in merges if m in r["learners"]]
    bases = [r["outer_step"] - r["staleness"] for r in _records(tmp_path, "push") if r["learner"] == m]
    assert len(bases) >= 3
    for version, next_base in zip(merged_in, bases[1:]):
      assert next_base >= version


class _Merged(Exception):
  """Stops a simulation once its first merge is done."""


def test_a_push_waiting_for_the_quorum_keeps_its_learners_progress(tmp_path):
  """With quorum K > 1, a push that does not complete the quorum is answered with an unmoved Θ: its learner
  must go on from θ as pushed (as a learner process does), not land that Θ, drop the pushed steps and push
  them again from the same Θ (issue 14: quorum 4 + grace with failures diverged).

  Learner 1 is four times as fast: it pushes every 0.5 s until learner 0's first push completes the quorum
  at 2 s, so the first merge (outer SGD at lr 1, equal weights) is the mean of Θ0 − θ'_2 (learner 0) and
  learner 1's θ_0 − θ_2, θ_2 − θ_4, ... along one uninterrupted run from θ_0 = Θ0."""
  config = _hetero(
      **{
          "learners.speed": (1.0, 4.0), "policy.kind": "fixed", "inner_steps": 2, "syncer.quorum": 2,
          "syncer.staleness": "constant", "outer.optimizer": "sgd", "outer.lr": 1.0, "outer.momentum": 0.0})
  exp = experiment.build(config)

  def stop_after_the_first_merge():
    if exp.syncer.version:
      raise _Merged

  with metrics_lib.MetricsWriter(str(tmp_path)) as writer, pytest.raises(_Merged):
    sim.Simulation(exp, writer).run(stop_after_the_first_merge)
  (merge,) = _records(tmp_path, "outer")
  fast_pushes = merge["learners"].count(1)
  assert merge["learners"].count(0) == 1 and fast_pushes >= 3
  reference = experiment.build(config)
  theta, deltas = reference.syncer.params, []
  for learner, pushes in zip(reference.learners, (1, fast_pushes)):
    learner.start_from(theta, 0)
    before = _params(theta)
    for _ in range(pushes):
      for _ in range(2):
        learner.step()
      after = _params(learner.params)
      deltas.append(jax.tree.map(np.subtract, before, after))
      before = after
  expected = jax.tree.map(lambda t, *d: t - sum(d) / len(d), _params(theta), *deltas)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), _params(exp.syncer.params),
               expected)

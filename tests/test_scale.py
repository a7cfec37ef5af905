"""Cost-model learners under failures: determinism, exact no-failure figures, renewal theory."""

import math

import pytest

from decoupled_diloco.errors import ConfigError
from decoupled_diloco.costmodel.scale import SECONDS_PER_YEAR, FailureModel, ScaleSimulation, simulate_goodput

NEVER = FailureModel(mtbi_seconds=math.inf)
CHIPS = 315_360  # Fails at λ = 0.01 /s with the default one-year MTBI per chip.
RATE = CHIPS / SECONDS_PER_YEAR


def test_same_seed_gives_identical_figures_and_another_seed_does_not():
  model = FailureModel(restart_seconds=20.0, resize_seconds=5.0, domain_chips=1000, repair_seconds=600.0)
  run = lambda seed: simulate_goodput(CHIPS, 4, True, model, 1.0, 6, 3000.0, seed)
  first = run(0)
  assert first == run(0)
  assert first != run(1)
  assert first["failures"] > 10


@pytest.mark.parametrize("quorum", [1, 0])
def test_without_failures_every_chip_second_is_useful(quorum):
  result = simulate_goodput(4096, 4, True, NEVER, step_seconds=2.0, inner_steps=5, duration_seconds=100.0,
                            quorum=quorum, seed=3)
  assert result["goodput"] == 1.0 and result["lost_fraction"] == 0.0 and result["failures"] == 0
  assert result["merges"] == (40 if quorum == 1 else 10)  # 10 rounds of 4 groups: one merge each, or one per round.


def test_an_unfinished_round_at_the_end_is_not_useful():
  result = simulate_goodput(1000, 1, False, NEVER, step_seconds=2.0, inner_steps=5, duration_seconds=105.0)
  assert result["goodput"] == pytest.approx(100.0 / 105.0)


def test_quorum_one_staleness_is_the_pushes_merged_since_the_pull():
  """4 groups in step: the first round's pushes see 0, 1, 2, 3 merges before them, later ones 3."""
  rounds = 10
  sim = ScaleSimulation(1000, 4, False, NEVER, step_seconds=1.0, inner_steps=3, duration_seconds=3.0 * rounds)
  result = sim.run()
  assert result["mean_staleness"] == pytest.approx((1.5 + 3 * (rounds - 1)) / rounds)
  assert [version for _, version in sim.merges] == list(range(1, 4 * rounds + 1))
  times = [time for time, _ in sim.merges]
  assert times == sorted(times) and result["version"] == result["merges"] == result["accepted"] == 4 * rounds


def test_data_parallel_goodput_matches_renewal_theory():
  """Each failure costs the restart plus half a step: g = 1 / (1 + λ(R + s/2))."""
  model = FailureModel(restart_seconds=19.0)
  result = simulate_goodput(CHIPS, 1, False, model, step_seconds=2.0, inner_steps=1, duration_seconds=50_000.0)
  assert result["goodput"] == pytest.approx(1 / (1 + RATE * (19.0 + 1.0)), abs=0.02)
  assert result["mean_staleness"] == 0.0


def test_elastic_goodput_matches_renewal_theory_with_absent_domains():
  """A share c = 1/(1 + x) of the chips is in the job; failures strike it at rate cλ."""
  model = FailureModel(resize_seconds=19.0, domain_chips=3000, repair_seconds=0.05 * SECONDS_PER_YEAR / 3000)
  live = 1 - model.down_share
  assert live == pytest.approx(1 / 1.05)
  result = simulate_goodput(CHIPS, 1, True, model, step_seconds=2.0, inner_steps=1, duration_seconds=50_000.0)
  assert result["goodput"] == pytest.approx(live / (1 + live * RATE * (19.0 + 1.0)), abs=0.02)


def test_a_group_whose_only_domain_fails_waits_for_the_repair():
  """One domain: every failure empties the job, which resumes when the repair lands (100 s)."""
  model = FailureModel(mtbi_seconds=1000 * 1000.0, resize_seconds=10.0, domain_chips=1000, repair_seconds=100.0)
  result = simulate_goodput(1000, 1, True, model, step_seconds=5.0, inner_steps=4, duration_seconds=200_000.0)
  assert result["goodput"] == pytest.approx(1 / (1 + (100.0 + 2.5) / 1000.0), abs=0.02)


@pytest.mark.parametrize("elastic", [False, True])
def test_more_learners_on_the_same_chips_give_more_goodput(elastic):
  model = FailureModel(restart_seconds=30.0, resize_seconds=15.0, domain_chips=1000, repair_seconds=600.0)
  goodput = [simulate_goodput(CHIPS, m, elastic, model, 1.0, 20, 6000.0, seed=0)["goodput"] for m in (1, 4, 16)]
  assert goodput[0] < goodput[1] < goodput[2]


def test_a_restart_loses_the_round_an_elastic_resize_only_the_step():
  model = FailureModel(restart_seconds=10.0, resize_seconds=10.0, domain_chips=1000, repair_seconds=600.0)
  run = lambda elastic: simulate_goodput(CHIPS, 4, elastic, model, 1.0, 20, 8000.0)
  restart, resize = run(False), run(True)
  assert restart["lost_fraction"] > 5 * resize["lost_fraction"] > 0
  assert restart["goodput"] < resize["goodput"]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_chips": 1000, "num_learners": 3}, "not divisible"),
    ({"num_learners": 0}, "num_learners"),
    ({"step_seconds": 0.0}, "step_seconds"),
    ({"duration_seconds": -1.0}, "duration_seconds"),
    ({"inner_steps": 0}, "inner_steps"),
    ({"quorum": 5}, "quorum"),
    ({"failure_model": FailureModel(restart_seconds=-1.0)}, "restart_seconds"),
    ({"failure_model": FailureModel(mtbi_seconds=0.0)}, "mtbi_seconds"),
    ({"failure_model": FailureModel(domain_chips=0)}, "domain_chips"),
    ({"elastic": True, "failure_model": FailureModel(domain_chips=500)}, "smaller than one failure domain"),])
def test_bad_arguments_raise_config_error_naming_the_problem(kwargs, message):
  args = {"num_chips": 1000, "num_learners": 4, "elastic": False, "failure_model": NEVER, **kwargs}
  with pytest.raises(ConfigError, match=message):
    simulate_goodput(**args)


def test_time_budget_policy_is_refused():
  with pytest.raises(ConfigError, match="time_budget"):
    ScaleSimulation(1000, 4, False, NEVER, policy_kind="time_budget")

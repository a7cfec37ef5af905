"""The wide-area cost model: hand-computed cases, invariants, bad inputs and both benchmarks."""

import dataclasses
import json
import math

import pytest

from decoupled_diloco import compression
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.hardware import HardwareProfile
from decoupled_diloco.costmodel import wan
from experiments.benchmarks import bandwidth_utilization, wan_service, wan_walltime

PARAMS, LAYERS = 100_000_000, 8
GBIT = 1e9 / 8  # Bytes per second of 1 Gbit/s.


def region(step=1.0, gbps=1.0, latency=0.0, chips=1, tokens=1000) -> wan.Region:
  return wan.Region(HardwareProfile("relative", chips, 1.0, 1.0, reference_step_seconds=step), tokens, gbps, latency)


def setup(*regions, steps=240, layers=LAYERS) -> wan.Setup:
  regions = regions or (region(), region())
  return wan.Setup(PARAMS, layers, steps * 1000 * len(regions), regions)  # `steps` each at 1000 tokens.


STREAMING = wan.streaming(12, 4, 2)
ALL = {"ddp": wan.DDP, "diloco": wan.diloco(12), "streaming": STREAMING}


def test_ddp_is_a_blocking_ring_all_reduce_every_step():
  bf16 = 2 * PARAMS
  s = setup(region(step=1.0, gbps=4.0, latency=0.01), region(step=2.0, gbps=8.0), region(step=1.5, gbps=9.0))
  result = wan.simulate(s, wan.DDP)
  all_reduce = 2 * 2 * (bf16 / 3 / (4.0 * GBIT) + 0.01)  # 2(M-1) phases on the slowest link, worst latency.
  assert result.seconds == pytest.approx(240 * (2.0 + all_reduce))
  assert result.utilization == pytest.approx((1.0 + 2.0 + 1.5) / 3 / (2.0 + all_reduce))
  assert result.wan_bytes == pytest.approx(240 * 2 * 2 * bf16)
  assert result.steps == (240, 240, 240)


def test_streaming_with_one_learner_and_no_overlap_waits_for_each_round_trip():
  """H = P = 1, tau = 0: every step is compute + push + pull of the whole int4 model."""
  payload = compression.wire_bytes(compression.Codec("int4"), wan.layer_shapes(setup()))
  result = wan.simulate(setup(region(step=1.0, gbps=2.0, latency=0.05), steps=50), wan.streaming(1, 1, 0))
  round_trip = 2 * (payload / (2.0 * GBIT) + 0.05)
  assert result.seconds == pytest.approx(50 + 49 * round_trip)  # The last step ends the run before its sync.
  assert result.wan_bytes == 49 * 2 * payload and result.peak_bytes == payload


def test_decoupled_learners_run_at_their_own_speed():
  """A learner behind a slow link stalls; the other one is not held back by it."""
  fast, slow = region(gbps=math.inf), region(gbps=0.02)  # The slow link needs ~22 s per 12-step period.
  result = wan.simulate(setup(fast, slow, steps=120), STREAMING)
  assert result.steps[0] == pytest.approx(result.seconds, abs=1)  # Computed the whole time, 1 s per step.
  assert result.steps[1] < 0.6 * result.steps[0]
  assert 0.6 < result.utilization < 0.8


def test_same_inputs_give_identical_results():
  s = setup(region(gbps=0.7, latency=0.02), region(step=1.3, gbps=1.1))
  assert all(wan.simulate(s, scheme) == wan.simulate(s, scheme) for scheme in ALL.values())


@pytest.mark.parametrize("name", ALL)
def test_utilization_is_in_unit_interval_and_one_without_communication_cost(name):
  for gbps in (0.01, 0.3, 10.0):
    assert 0 < wan.simulate(setup().with_gbps(gbps), ALL[name]).utilization <= 1
  assert wan.simulate(setup().with_gbps(math.inf), ALL[name]).utilization == pytest.approx(1.0)


@pytest.mark.parametrize("name", ALL)
def test_more_bandwidth_is_never_slower(name):
  s = setup(region(latency=0.01), region(step=1.4, latency=0.02))
  results = [wan.simulate(s.with_gbps(g), ALL[name]) for g in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, math.inf)]
  assert all(a.seconds >= b.seconds for a, b in zip(results, results[1:]))
  assert all(a.utilization <= b.utilization for a, b in zip(results, results[1:]))


def test_overlap_is_never_slower_than_waiting():
  s = setup(region(gbps=0.3, latency=0.02), region(step=0.8, gbps=0.5))
  seconds = [wan.simulate(s, wan.streaming(12, 4, tau)).seconds for tau in range(6)]
  assert all(a >= b for a, b in zip(seconds, seconds[1:])) and seconds[0] > seconds[-1]


def test_streaming_lowers_the_peak_p_fold_and_int4_sends_about_8x_fewer_bytes():
  s = setup()
  whole = wan.simulate(s, wan.streaming(12, 1, 2, "fp32"))
  fragmented = wan.simulate(s, wan.streaming(12, 4, 2, "fp32"))
  assert whole.peak_bytes == 4 * PARAMS and fragmented.peak_bytes == PARAMS
  assert fragmented.wan_bytes == pytest.approx(whole.wan_bytes, rel=0.02)  # Same total, spread out.
  int4 = wan.simulate(s, wan.streaming(12, 4, 2, "int4"))
  blocks = math.ceil(PARAMS / LAYERS / 64)  # Per layer; a fragment holds LAYERS / 4 = 2 layers.
  assert int4.peak_bytes == 2 * blocks * (32 + 4)  # 64 4-bit codes + one fp32 scale per block.
  assert 7 < fragmented.wan_bytes / int4.wan_bytes <= 8


def test_ddp_is_slowest_at_low_bandwidth():
  s = setup(region(latency=0.03), region(step=1.2, latency=0.03)).with_gbps(1.0)
  seconds = {name: wan.simulate(s, scheme).seconds for name, scheme in ALL.items()}
  assert seconds["ddp"] > seconds["diloco"] > seconds["streaming"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("target", [0.5, 0.9])
def test_bisection_finds_the_smallest_bandwidth_reaching_the_target(name, target):
  s = setup(region(latency=0.01), region(latency=0.01), steps=120)
  gbps = wan.bandwidth_for_utilization(s, ALL[name], target, rel_tol=1e-3)
  assert wan.simulate(s.with_gbps(gbps), ALL[name]).utilization >= target
  assert wan.simulate(s.with_gbps(gbps / 1.002), ALL[name]).utilization < target


def test_bisection_reports_an_unreachable_target():
  """Synchronous groups wait for the slowest one, so no bandwidth gets ddp to 99% here."""
  s = setup(region(step=1.0), region(step=2.0))
  assert wan.bandwidth_for_utilization(s, wan.DDP, 0.99) == math.inf
  assert wan.bandwidth_for_utilization(s, STREAMING, 0.99) < math.inf


@pytest.mark.parametrize("scheme, change, match", [
    (wan.Scheme("allreduce"), {}, "unknown"),
    (wan.streaming(12, 4, 12), {}, "overlap_steps=12"),
    (wan.streaming(12, 4, -1), {}, "overlap_steps=-1"),
    (wan.streaming(12, LAYERS + 1, 2), {}, "fragments=9"),
    (wan.streaming(12, 4, 2, "int3"), {}, "wire_format"),
    (wan.Scheme("ddp", inner_steps=4), {}, "use scheme 'diloco'"),
    (wan.Scheme("diloco", 12, fragments=4), {}, "use scheme 'streaming'"),
    (wan.Scheme("diloco", 0), {}, "inner_steps=0"),
    (STREAMING, {"gbps": 0.0}, "gbps=0.0"),
    (STREAMING, {"latency_seconds": -1.0}, "latency_seconds"),
    (STREAMING, {"tokens_per_step": 0}, "tokens_per_step"),
    (STREAMING, {"hardware": HardwareProfile("v7", 8, 0.5, 1.0)}, "chip 'v7'"),
    (STREAMING, {"hardware": HardwareProfile("v5p", 8, 1.5, 1.0)}, "mfu"),])
def test_bad_inputs_raise_one_line_config_errors(scheme, change, match):
  s = setup(dataclasses.replace(region(), **change))
  with pytest.raises(ConfigError, match=match) as error:
    wan.simulate(s, scheme)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("change, match", [({"regions": ()}, "no regions"), ({"token_budget": 0}, "token_budget"),
                                           ({"layers": 0}, "layers=0")])
def test_bad_setups_raise_config_errors(change, match):
  with pytest.raises(ConfigError, match=match):
    wan.simulate(dataclasses.replace(setup(), **change), STREAMING)
  with pytest.raises(ConfigError, match="target"):
    wan.bandwidth_for_utilization(setup(), STREAMING, 1.5)


def _emitted(capsys) -> dict:
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_wan_walltime_runs_end_to_end(capsys):
  wan_walltime.main(["--quick"])
  figures = _emitted(capsys)
  assert figures["speedup_vs_ddp"] > 1 and 0 < figures["utilization"] <= 1
  assert set(figures["hours"]["all 2 Gbit/s"]) == {"ddp", "diloco", "streaming"}


def test_bandwidth_utilization_runs_end_to_end(capsys):
  bandwidth_utilization.main(["--quick"])
  needed = _emitted(capsys)["gbps_needed"]
  assert set(needed) == {"1B", "12B"}
  for rows in needed.values():
    for cells in rows.values():
      assert list(cells) == ["50", "80", "90", "95", "99"]
      assert all(a <= b for a, b in zip(list(cells.values()), list(cells.values())[1:]))
    assert rows["streaming"]["95"] < rows["diloco"]["95"] < rows["ddp"]["95"]


def test_wan_service_refuses_an_h_its_streaming_run_cannot_overlap(capsys):
  """τ = 2 needs H > 2: refused in one line before anything starts, not as a learner process failing later."""
  with pytest.raises(SystemExit) as refused:
    wan_service.parse_args(["--inner_steps=2", "--outer_steps=1"])
  assert refused.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()
  assert len(error) == 1 and "--inner_steps=3" in error[0], error
  assert wan_service.parse_args(["--inner_steps=3"]).inner_steps == 3

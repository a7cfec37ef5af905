"""compile_scale and mfu at tiny sizes: each main ends with its one JSON line with the keys the issue names."""

import json

import pytest

from experiments.benchmarks import compile_scale, mfu

TINY_COMPILE = ["--depths=1,2", "--remat_depth=1", "--width=16"]


def _last_json(capsys) -> dict:
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_compile_scale_out_of_budget_still_ends_with_its_json_line(capsys):
  """A spent budget skips every later measurement (named), and the keys are still there (null)."""
  compile_scale.main([*TINY_COMPILE, "--budget_s=0"])
  result = _last_json(capsys)
  assert list(result["compile"]) == ["scan_1"] and result["compile"]["scan_1"]["fusions"] > 0
  assert result["compile"]["scan_1"]["compile_s"] > 0 and result["compile"]["scan_1"]["xla_peak_bytes"] > 0
  assert result["skipped"][:3] == ["scan_2", "remat_none", "remat_full"] and "loop_2" in result["skipped"]
  assert result["compile_ratio_32_vs_4"] is None and result["remat_full_vs_none_bytes"] is None


@pytest.mark.slow
def test_compile_scale_measures_everything_it_names(capsys):
  compile_scale.main(TINY_COMPILE)
  result = _last_json(capsys)
  assert result["skipped"] == []
  assert set(result["compile"]) == {"scan_1", "scan_2", "loop_1", "loop_2"}
  assert set(result["breakdown"]) == {"grads_1", "grads_2", "convert_1", "convert_2"}
  assert set(result["remat_1_layers"]) == {"none", "full", "minimal"}
  for key in ("compile_ratio_32_vs_4", "compile_ratio_32_vs_4_wall", "compile_ratio_32_vs_4_loop",
              "compile_ratio_32_vs_4_grads_only", "compile_ratio_32_vs_4_conversions", "remat_full_vs_none_xla_peak"):
    assert result[key] > 0, key
  assert 0 < result["remat_full_vs_none_bytes"] < 1  # Full remat keeps less than no remat, even at one layer.


def test_mfu_times_framework_and_bare_loop_and_checks_the_flop_count(capsys):
  """`auto` attention is xla on CPU: timed once, under the name of what ran."""
  mfu.main(["--sizes=125m", "--variants=xla/none,auto/none", "--blocks=1", "--steps=1"])
  result = _last_json(capsys)
  assert result["backend"] == "cpu" and result["mfu"] == {"125m-cpu/xla/none": None}
  assert set(result["ratios"]) == set(result["mfu"]) and result["ratio"] == max(result["ratios"].values()) > 0
  assert abs(result["flops_xla_vs_analytic"]["125m"] - 1) < 0.05  # XLA counts what model.flops_per_token says.


def test_mfu_refuses_an_unknown_size():
  with pytest.raises(SystemExit) as exit_info:
    mfu.main(["--sizes=7b"])
  assert exit_info.value.code == 2

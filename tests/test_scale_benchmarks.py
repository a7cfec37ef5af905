"""compile_scale, mfu and inner_overhead at tiny sizes: each main ends with its one JSON line with the keys the issue
names."""

import json

import pytest

from experiments.benchmarks import compile_scale, inner_overhead, mfu

TINY_COMPILE = ["--depths=1,2", "--remat_depth=1", "--width=16"]


def _json_lines(capsys) -> tuple[dict, dict]:
  """(context line, last line): the issue's keys are exactly the last line's."""
  lines = capsys.readouterr().out.strip().splitlines()
  return json.loads(lines[-2])["context"], json.loads(lines[-1])


def test_compile_scale_out_of_budget_still_ends_with_its_json_line(capsys):
  """A spent budget skips every later measurement (named), and the keys are still there (null)."""
  compile_scale.main([*TINY_COMPILE, "--budget_s=0"])
  context, result = _json_lines(capsys)
  assert list(context["compile"]) == ["scan_1"] and context["compile"]["scan_1"]["fusions"] > 0
  assert context["compile"]["scan_1"]["compile_s"] > 0 and context["compile"]["scan_1"]["xla_peak_bytes"] > 0
  assert context["skipped"][:3] == ["scan_2", "remat_none", "remat_full"] and "loop_2" in context["skipped"]
  assert result == {"compile_ratio_32_vs_4": None, "remat_full_vs_none_bytes": None}


@pytest.mark.slow
def test_compile_scale_measures_everything_it_names(capsys):
  compile_scale.main(TINY_COMPILE)
  context, result = _json_lines(capsys)
  assert context["skipped"] == []
  assert set(context["compile"]) == {"scan_1", "scan_2", "loop_1", "loop_2"}
  assert set(context["breakdown"]) == {"grads_1", "grads_2", "convert_1", "convert_2"}
  assert set(context["remat_1_layers"]) == {"none", "full", "minimal"}
  for key in ("compile_ratio_32_vs_4_wall", "compile_ratio_32_vs_4_loop", "compile_ratio_32_vs_4_grads_only",
              "compile_ratio_32_vs_4_conversions", "remat_full_vs_none_xla_peak"):
    assert context[key] > 0, key
  assert set(result) == {"compile_ratio_32_vs_4", "remat_full_vs_none_bytes"} and result["compile_ratio_32_vs_4"] > 0
  assert 0 < result["remat_full_vs_none_bytes"] < 1  # Full remat keeps less than no remat, even at one layer.


def test_mfu_times_the_learner_step_against_a_bare_loop_with_an_aa_control(capsys):
  """`auto` attention is xla on CPU: timed once, under the name of what ran."""
  mfu.main(["--sizes=125m", "--variants=xla/none,auto/none", "--rounds=2", "--steps=1"])
  context, result = _json_lines(capsys)
  assert set(result) == {"backend", "mfu", "ratio"}
  assert result["backend"] == "cpu" and result["mfu"] == {"125m-cpu/xla/none": None}
  timed = context["timed"]["125m-cpu/xla/none"]
  assert context["ratio_clock"] == "cpu" and result["ratio"] == timed["cpu"]["ratio"] > 0  # The worst of one.
  for clock in ("cpu", "wall"):
    assert timed[clock]["ms_per_step"] > 0
    for key in ("ratio", "aa"):  # framework / bare, and bare / bare: the method's own noise.
      low, high = timed[clock][f"{key}_quartiles"]
      assert 0 < low <= timed[clock][key] <= high
  assert context["compiled_framework_vs_bare"]["125m-cpu/xla/none"] == {"flops": 1.0, "bytes accessed": 1.0}
  assert abs(context["flops_xla_vs_analytic"]["125m"] - 1) < 0.05  # XLA counts what model.flops_per_token says.


def test_mfu_refuses_an_unknown_size():
  with pytest.raises(SystemExit) as exit_info:
    mfu.main(["--sizes=7b"])
  assert exit_info.value.code == 2


def test_inner_overhead_times_the_framework_step_against_the_bare_loop(capsys):
  """One block of two steps per loop (after a warm-up block): the timed steps and the ratio of the same run."""
  inner_overhead.main(["--blocks=1", "--steps=2"])
  context, result = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:])
  assert set(result) == {"ratio"} and context["framework_ms_per_step"] > 0 and context["bare_ms_per_step"] > 0
  assert result["ratio"] == pytest.approx(context["framework_ms_per_step"] / context["bare_ms_per_step"], rel=1e-3)

"""experiments.benchmarks.low_bit at its tiny size: both modes train fp32 and int2 with and without error feedback,
and the JSON line holds the issue's key, one ratio to fp32 per mode and error feedback."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import quick_compile_env

pytestmark = pytest.mark.slow  # Six short runs in a child process.


def test_low_bit_benchmark_sets_each_format_against_fp32_in_both_modes(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text(" ".join(np.random.default_rng(0).choice(["to", "be", "or", "not", "that", "is"], 40_000)))
  result = subprocess.run(
      [sys.executable, "-m", "experiments.benchmarks.low_bit", "--size=tiny", f"--data_path={text}", "--formats=int2"],
      cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=900, env=quick_compile_env())
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(result.stdout.splitlines()[-1])
  assert set(figures) == {"eval_loss_vs_fp32"} and set(figures["eval_loss_vs_fp32"]) == {"int2"}
  ratios = figures["eval_loss_vs_fp32"]["int2"]
  assert set(ratios) == {"sync", "sync_ef", "decoupled", "decoupled_ef"}
  assert all(-0.5 < ratio < 0.5 for ratio in ratios.values()), ratios
  context = json.loads(result.stdout.splitlines()[-2])["eval_loss"]
  assert all(np.isfinite(loss) and loss < np.log(256) for loss in context.values()), context


def test_an_unknown_format_exits_2_in_one_line():
  result = subprocess.run([sys.executable, "-m", "experiments.benchmarks.low_bit", "--formats=int3"],
                          cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
  assert result.returncode == 2 and "--formats='int3'" in result.stderr.strip().splitlines()[-1], result.stderr

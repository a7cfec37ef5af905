"""experiments.benchmarks.defaults at its tiny size: both modes of every config train and the JSON line holds the
issue's key, one ratio per config."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import quick_compile_env

pytestmark = pytest.mark.slow  # Six short runs in a child process.


def test_defaults_benchmark_compares_decoupled_and_sync_on_every_config(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text(" ".join(np.random.default_rng(0).choice(["to", "be", "or", "not", "that", "is"], 40_000)))
  result = subprocess.run(
      [sys.executable, "-m", "experiments.benchmarks.defaults", "--size=tiny", f"--data_path={text}"],
      cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=900, env=quick_compile_env())
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(result.stdout.splitlines()[-1])
  assert set(figures) == {"loss_ratio"}
  assert set(figures["loss_ratio"]) == {"demo", "tiny_shakespeare", "hetero_v5p_v6e"}
  assert all(0.5 < ratio < 2 for ratio in figures["loss_ratio"].values()), figures

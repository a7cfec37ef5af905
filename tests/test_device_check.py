"""experiments.benchmarks.device_check's CPU toy: the same code as on an accelerator, end to end, the issue's keys."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from experiments.benchmarks import device_check
from tests.helpers import quick_compile_env

VOCAB = 256  # The demo's byte-level vocabulary: an untrained model's loss is ln(256).


def test_kernels_per_backend_are_what_auto_runs_and_xla():
  assert device_check.kernels("gpu") == ["cudnn", "xla"]
  assert device_check.kernels("gpu", "float32") == ["xla"]  # auto falls back to XLA's: timed once.
  assert device_check.kernels("tpu") == ["splash", "xla"] and device_check.kernels("cpu") == ["xla"]


@pytest.mark.slow  # Four timed configs, two peak processes and a three-process decoupled run.
def test_the_toy_runs_end_to_end_and_prints_the_issues_keys():
  result = subprocess.run([sys.executable, "-m", "experiments.benchmarks.device_check", "--quick"],
                          cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=1800,
                          env=quick_compile_env())
  assert result.returncode == 0, result.stderr[-3000:]
  context, figures = (json.loads(line) for line in result.stdout.splitlines()[-2:])
  assert set(figures) == {"device", "mfu", "ratio", "peak_bytes", "decoupled"}
  assert figures["device"] is None and set(figures["mfu"]) == {"350m-cpu/xla", "1b-cpu/xla"}
  assert all(value is None for value in figures["mfu"].values())  # No peak FLOP/s for a CPU.
  assert 0.5 < figures["ratio"] < 2, context["configs"]
  for peak in figures["peak_bytes"].values():
    assert peak["measured"] is None and peak["planned"] > 0
  decoupled = figures["decoupled"]
  assert len(decoupled["steps"]) == len(decoupled["blocked"]) == 2 and min(decoupled["steps"]) > 0
  assert all(0 <= blocked < 1 for blocked in decoupled["blocked"])
  losses = context["eval_losses"]  # Θ learned: below the untrained ln(V) and falling.
  assert decoupled["eval_loss"] == losses[-1] < losses[0] and losses[-1] < math.log(VOCAB)

"""experiments.plan: the analytic memory plan against XLA's own analysis, the shipped TPU configs, bad input."""

import importlib
import os
import subprocess
import sys

import jax
import pytest

from decoupled_diloco import mode_defaults, plan
from tests.helpers import tiny_config

GB = 1e9


def _small(layouts, remat="none"):
  """A ~3M-param model whose activations dominate, so the comparison measures the residual count."""
  return tiny_config(
      **{
          "model.d_model": 128, "model.num_layers": 2, "model.seq_len": 128, "model.num_heads": 4, "model.d_ff": 512,
          "model.attention": "xla", "model.remat": remat, "learners.devices": (4, 4), "learners.batch_size": (
              16, 16), "learners.layouts": layouts, "learners.hardware": ("v5p", "v6e")})


@pytest.mark.parametrize("group", [0, 1])
def test_analytic_peak_is_within_25_percent_of_xla_memory_analysis(group):
  config = _small(("fsdp=4", "fsdp=2,tensor=2"))
  analytic = plan.memory_plan(config, group).peak
  xla = plan.compile_group(config, group)["peak_bytes"]
  assert abs(analytic - xla) <= 0.25 * xla, (analytic, xla)


def test_remat_shrinks_the_analytic_activations():
  """8 layers: remat keeps 8 block inputs and recomputes one layer at a time instead of keeping 8 layers' worth."""
  configs = [_small(("data=4", "data=4"), remat) for remat in ("none", "full")]
  for config in configs:
    config.model.num_layers = 8
  none, full = (plan.memory_plan(config, 0).activations for config in configs)
  assert full < none / 4


def test_exchange_hides_only_with_enough_overlap_and_link():
  config = _small(("data=4", "data=4"))
  config.runtime, config.mode, config.inner_steps = "sim", "decoupled", 10
  config.sim.link_gbps = 1e-4
  starved = plan.comm_plan(config, 0)
  assert not starved.hides and starved.overlap_needed > config.inner_steps
  assert plan.hiding_format(config, 0) is None
  config.sim.link_gbps = 1e4
  fast = plan.comm_plan(config, 0)
  assert not fast.hides  # tau = 0: the learner waits for every exchange.
  config.streaming.overlap_steps = fast.overlap_needed
  assert fast.overlap_needed < config.inner_steps and plan.comm_plan(config, 0).hides
  assert plan.comm_plan(config, 0, fmt="int4").push_bytes < fast.push_bytes / 6


@pytest.mark.parametrize("name", ["tpu_1b", "tpu_8b", "tpu_12b"])
def test_shipped_tpu_configs_fit_every_group_analytically(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  for group, chip in enumerate(config.learners.hardware):
    memory = plan.memory_plan(config, group)
    assert memory.peak <= memory.usable, (name, group, memory)
    assert memory.startup <= memory.peak, (name, group, memory)  # Sharded init: start-up never the binding peak.
    if chip == "v6e":
      assert memory.peak <= 28 * GB
    assert plan.comm_plan(config, group).hides


def test_the_syncer_host_holds_theta_outer_state_sums_and_one_tensor_whatever_the_learners():
  """Delayed Nesterov (decoupled's default): Θ 4 + momentum 4 + its window's sum 4 + the merge's sums 4 B/param and
  the largest tensor being received (gRPC fallback too); Nesterov SGD holds no window sum."""
  config = importlib.import_module("configs.tpu_1b").get_config()
  mode_defaults.resolve(config)  # As experiments.plan's validation does.
  _, shapes, _ = plan.model_lib.abstract_params(config.model)
  theta, largest = 4 * plan.model_lib.count_params(shapes), max(4 * x.size for x in jax.tree.leaves(shapes))
  largest += 4  # DN's arrival count (an int32) rides along.
  # DN's outer step keeps its window sum's new value beside the old (read twice): 4 B per param of the largest
  # fragment, as XLA compiles it (plus the count's few bytes).
  scratch = plan.merge_scratch_bytes(config)
  assert theta / config.streaming.num_fragments <= scratch <= theta / config.streaming.num_fragments * 1.1 + 64
  assert config.outer.optimizer == "delayed_nesterov" and plan.syncer_bytes(config) == 4 * theta + largest + scratch
  config.learners.devices, config.learners.batch_size = (8,) * 16, (8,) * 16
  assert plan.syncer_bytes(config) == 4 * theta + largest + scratch  # Flat in the number of learners.
  config.service.data_port = -1  # Spooled as on the data channel.
  assert plan.syncer_bytes(config) == 4 * theta + largest + scratch
  config.outer.optimizer = "sgd"
  assert plan.merge_scratch_bytes(config) == 0 and plan.syncer_bytes(config) == 3 * theta + largest - 4


def _run_plan(*flags):
  return subprocess.run([sys.executable, "-m", "experiments.plan", *flags], capture_output=True, text=True, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow  # An 8B model traced abstractly, in a subprocess.
def test_an_moe_variant_of_tpu_8b_plans_with_its_experts_sharded_and_reports_active_params():
  """8 experts of width 1792, top-2: 8.03B params of which 3.80B a token runs through (issue 30)."""
  done = _run_plan("--config=configs/tpu_8b.py", "--xla=false", "--config.model.moe.num_experts=8",
                   "--config.model.moe.d_ff=1792",
                   "--config.learners.layouts=('fsdp=32,expert=8','fsdp=64,expert=2,tensor=2')")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "8.03B params (3.80B active)" in done.stdout
  assert "layout data=1,fsdp=32,expert=8,tensor=1" in done.stdout and "expert=2,tensor=2" in done.stdout


def test_a_group_that_does_not_fit_is_one_line_naming_group_shortfall_and_knob():
  done = _run_plan("--config=configs/default.py", "--xla=false", "--config.learners.hardware=('v5e','v5e','v5e','v5e')",
                   "--config.model.seq_len=4096", "--config.learners.batch_size=(256,256,256,256)")
  assert done.returncode == 2
  error = done.stderr.strip().splitlines()[-1]
  assert error.startswith("error: group 0 (v5e x 2) needs") and "GB over its 14.0 GB usable HBM" in error
  assert "--config.model.remat=full" in error


@pytest.mark.slow
def test_plan_of_tpu_12b_fits_every_slice_at_start_up_and_step_and_remat_off_does_not():
  """Analytic only (--xla=false): the 12B config's four slices fit, start-up (sharded init) beside the step; the
  same model without remat holds every layer's activations and exits 2 naming the knob."""
  done = _run_plan("--config=configs/tpu_12b.py", "--xla=false")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.count(": fits") == 4 and done.stdout.count("start-up (init)") == 4
  assert "DOES NOT FIT" not in done.stdout and "delayed_nesterov" in done.stdout
  overfull = _run_plan("--config=configs/tpu_12b.py", "--xla=false", "--config.model.remat=none")
  assert overfull.returncode == 2 and "--config.model.remat=full" in overfull.stderr.strip().splitlines()[-1]


def test_a_config_without_chips_is_refused():
  done = _run_plan("--config=configs/default.py", "--xla=false")
  assert done.returncode == 2 and "set --config.learners.hardware" in done.stderr.strip().splitlines()[-1]


def test_tpu_1b_groups_compile_abstractly_at_their_per_chip_shapes_and_fit():
  """The CPU-cheap version of the full plan: configs/tpu_1b.py's 1B widths, per-chip batch and both
  layouts, scaled from 64 chips to 8 and from 20 layers to 2, compiled abstractly in this process
  (plan.compile_group: ShapeDtypeStructs, nothing allocated): both layouts compile, and XLA's peak
  per chip fits the group's chip."""
  config = importlib.import_module("configs.tpu_1b").get_config()
  config.model.num_layers, config.streaming.num_fragments = 2, 2
  config.learners.devices, config.learners.batch_size = (8, 8), (32, 32)  # 4 sequences per chip, as at 64 chips.
  config.learners.layouts = ("data=2,fsdp=4", "fsdp=4,tensor=2")
  for group in (0, 1):
    xla = plan.compile_group(config, group)
    assert 0 < xla["peak_bytes"] <= plan.memory_plan(config, group).usable and xla["flops"] > 0, (group, xla)


@pytest.mark.slow
def test_full_plan_of_tpu_1b_compiles_every_group_and_fits():
  """The real command: 20 layers on 64 virtual devices per group, in subprocesses."""
  done = _run_plan("--config=configs/tpu_1b.py")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.count(": fits") == 2 and "compiled in" in done.stdout

"""The chip table: GPUs beside TPUs in learners.hardware, the virtual clock, the plan and the MFU benchmark."""

import types

import numpy as np
import pytest

from decoupled_diloco import hardware, plan
from experiments.benchmarks import mfu
from tests.helpers import tiny_config

GPUS = {
    "a100": (312e12, 80e9), "h100": (989e12, 80e9), "h100_pcie": (756e12, 80e9), "h200": (989e12, 141e9),
    "b200": (2250e12, 180e9), "l40s": (362e12, 48e9)}


@pytest.mark.parametrize("chip", sorted(GPUS))
def test_every_gpu_is_a_learner_chip_with_its_dense_bf16_peak_and_memory(chip):
  peak, memory = GPUS[chip]
  spec = hardware.ACCELERATORS[chip]
  assert (spec.peak_bf16_flops, spec.hbm_bytes, spec.backend) == (peak, memory, "gpu")
  config = tiny_config(**{"learners.hardware": (chip, "v5p"), "learners.mfu": 0.5})
  gpu, tpu = hardware.profiles_from_config(config.learners, 1.0)
  assert gpu.chip == chip
  flops = 1e15  # The virtual clock's step time follows the chip's peak: 2 chips at 50% MFU.
  assert gpu.mean_step_seconds(flops) == pytest.approx(flops / (2 * peak * 0.5))
  assert gpu.step_seconds(flops, np.random.default_rng(0)) / tpu.step_seconds(flops, np.random.default_rng(0)) == (
      pytest.approx(hardware.CHIP_PEAK_FLOPS["v5p"] / peak))
  assert plan.memory_plan(config, 0).hbm == memory and plan.chip_of(config, 0) == chip


@pytest.mark.parametrize("kind, chip", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"),
                                        ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                        ("NVIDIA B200", "b200"), ("NVIDIA L40S", "l40s"), ("TPU v5 lite", "v5e"),
                                        ("TPU v5", "v5p"), ("TPU v6 lite", "v6e"), ("NVIDIA H100", None),
                                        ("NVIDIA H200 NVL", None), ("NVIDIA A100-SXM4-40GB", None),
                                        ("TPU v5 lite pod", None), ("cpu", None)])
def test_device_kinds_match_exactly_never_by_prefix(kind, chip):
  assert hardware.chip_of_device(kind) == chip
  peak = mfu.device_peak_flops(types.SimpleNamespace(device_kind=kind))
  assert peak == (None if chip is None else hardware.CHIP_PEAK_FLOPS[chip])


def test_an_unknown_chip_is_refused_naming_the_gpus():
  config = tiny_config(**{"learners.hardware": ("h800", "v5p")})
  with pytest.raises(hardware.ConfigError, match="l40s"):
    hardware.profiles_from_config(config.learners, 1.0)

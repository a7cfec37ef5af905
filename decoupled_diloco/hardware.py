"""How long a learner group's inner step takes: chip profiles or plain relative speeds.

The virtual-clock runtime advances each learner by the time its hardware would need,
while the math runs on whatever devices are present. A step costs
    flops_per_token · tokens_per_step / (chips · peak bf16 FLOP/s · MFU)
on a chip profile (TPU or GPU, `ACCELERATORS`), or reference_step_seconds / speed on a relative-speed profile, times
an optional seeded log-normal jitter (mean 1) for stragglers.
"""

import dataclasses
import math

import numpy as np

from decoupled_diloco.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """Public per-chip specs: what the step-time model and the memory plan measure a chip against."""
  peak_bf16_flops: float  # Dense bf16 peak FLOP/s of one chip (one JAX device), without sparsity.
  hbm_bytes: float  # High-bandwidth memory of one chip, in bytes (GB = 1e9 as vendors quote).
  backend: str = "tpu"  # JAX backend it runs under: picks attention='auto''s kernel in the plan.
  tpu_type: str = ""  # Cloud TPU accelerator-type prefix (gcloud's v5p in 'v5p-128'); '' = not a Cloud TPU.
  runtime_version: str = ""  # Cloud TPU VM software version that runs JAX on it (gcloud --version).
  cores_per_chip: int = 1  # What a Cloud TPU size counts per chip: TensorCores on v4/v5p (v5p-128 = 64 chips).
  device_kinds: tuple[str, ...] = ()  # jax.Device.device_kind strings of this chip, matched exactly.


# One table for every reader (simulated clock, experiments.plan, launchers, the MFU benchmarks): TPU chips and GPUs.
# GPU figures are the vendors' datasheets, dense (the "with sparsity" figures are twice these).
ACCELERATORS = {
    "v4": Accelerator(275e12, 32e9, tpu_type="v4", runtime_version="tpu-ubuntu2204-base", cores_per_chip=2,
                      device_kinds=("TPU v4",)),
    "v5e": Accelerator(197e12, 16e9, tpu_type="v5litepod", runtime_version="v2-alpha-tpuv5-lite",
                       device_kinds=("TPU v5 lite", "TPU v5e")),
    "v5p": Accelerator(459e12, 95e9, tpu_type="v5p", runtime_version="v2-alpha-tpuv5", cores_per_chip=2,
                       device_kinds=("TPU v5", "TPU v5p")),
    "v6e": Accelerator(918e12, 32e9, tpu_type="v6e", runtime_version="v2-alpha-tpuv6e",
                       device_kinds=("TPU v6 lite", "TPU v6e")),
    # A100 80GB (SXM4 and PCIe: the same tensor cores): 312 TFLOP/s bf16.
    "a100": Accelerator(312e12, 80e9, "gpu", device_kinds=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
    "h100": Accelerator(989e12, 80e9, "gpu", device_kinds=("NVIDIA H100 80GB HBM3",)),  # H100 SXM.
    "h100_pcie": Accelerator(756e12, 80e9, "gpu", device_kinds=("NVIDIA H100 PCIe",)),
    "h200": Accelerator(989e12, 141e9, "gpu", device_kinds=("NVIDIA H200",)),  # H200 SXM: H100's compute, more HBM.
    "b200": Accelerator(2250e12, 180e9, "gpu", device_kinds=("NVIDIA B200",)),  # HGX B200: 180 GB HBM3e per GPU.
    "l40s": Accelerator(362e12, 48e9, "gpu", device_kinds=("NVIDIA L40S",)),  # 48 GB GDDR6, not HBM.
}
CHIP_PEAK_FLOPS = {name: spec.peak_bf16_flops for name, spec in ACCELERATORS.items()}
RELATIVE = "relative"


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One learner group's simulated hardware."""
  chip: str  # A key of CHIP_PEAK_FLOPS, or 'relative' for a plain speed.
  chips: int  # Chips in the slice (TPU profiles).
  mfu: float  # Model FLOPs utilisation the slice achieves (TPU profiles).
  speed: float  # Relative speed (relative profiles): 2.0 steps twice as fast as 1.0.
  jitter: float = 0.0  # Log-std of the per-step time noise; 0 = deterministic steps.
  reference_step_seconds: float = 1.0  # Step time at speed 1.0 (relative profiles).

  def mean_step_seconds(self, flops_per_step: float) -> float:
    """Expected time of one inner step of `flops_per_step` training FLOPs."""
    if self.chip == RELATIVE:
      return self.reference_step_seconds / self.speed
    return flops_per_step / (self.chips * CHIP_PEAK_FLOPS[self.chip] * self.mfu)

  def step_seconds(self, flops_per_step: float, rng: np.random.Generator) -> float:
    """One sampled step time; the jitter has mean 1 so it does not change the speed."""
    mean = self.mean_step_seconds(flops_per_step)
    if self.jitter == 0:
      return mean
    return mean * math.exp(self.jitter * rng.standard_normal() - self.jitter**2 / 2)


def chip_of_device(device_kind: str) -> str | None:
  """The ACCELERATORS name of a JAX device by its exact `device_kind`, None for any other (a CPU, an unlisted GPU).

  Why exact: prefixes mistake one chip for another ("NVIDIA H100" would take an H100 PCIe, 24% slower,
  for an SXM; "TPU v5" every v5 lite), and an MFU against the wrong peak is wrong silently.
  """
  return next((name for name, spec in ACCELERATORS.items() if device_kind in spec.device_kinds), None)


def _per_group(value, count: int, name: str):
  """A per-group tuple from a scalar, an empty tuple (default) or a tuple of length `count`."""
  if isinstance(value, (int, float, str)):
    return (value,) * count
  value = tuple(value)
  if len(value) != count:
    raise ConfigError(f"learners.{name} has {len(value)} entries for {count} learner groups: "
                      "give one per group (or a single value)")
  return value


def profiles_from_config(learners_cfg, reference_step_seconds: float) -> list[HardwareProfile]:
  """One profile per learner group from `config.learners` (hardware, chips, speed, mfu, jitter)."""
  count = len(learners_cfg.devices)
  chips_default = tuple(learners_cfg.devices)
  hardware = _per_group(learners_cfg.hardware or RELATIVE, count, "hardware")
  chips = _per_group(learners_cfg.chips or chips_default, count, "chips")
  speeds = _per_group(learners_cfg.speed or 1.0, count, "speed")
  profiles = []
  for group, (chip, n, speed) in enumerate(zip(hardware, chips, speeds)):
    if chip != RELATIVE and chip not in CHIP_PEAK_FLOPS:
      raise ConfigError(f"learners.hardware[{group}]={chip!r} is unknown: use one of "
                        f"{sorted(CHIP_PEAK_FLOPS)} or {RELATIVE!r}")
    if n < 1 or speed <= 0 or not 0 < learners_cfg.mfu <= 1 or learners_cfg.jitter < 0:
      raise ConfigError(f"learner group {group}: chips={n}, speed={speed}, mfu={learners_cfg.mfu}, "
                        f"jitter={learners_cfg.jitter}: need chips >= 1, speed > 0, 0 < mfu <= 1, jitter >= 0")
    profiles.append(
        HardwareProfile(chip, int(n), float(learners_cfg.mfu), float(speed), float(learners_cfg.jitter),
                        reference_step_seconds))
  return profiles

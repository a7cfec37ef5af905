"""Steady-state memory of one DiLoCo learner group vs a bare jit + AdamW loop, same run.

Device bytes are what `jax.live_arrays()` holds on the group's devices; host bytes are
what lives on the syncer's device (the host CPU device): Θ, outer momentum, anchors.
Targets: device_ratio <= 1.3 (at most one extra parameter copy on top of params +
AdamW moments); host_bytes_per_param is reported (Θ + Nesterov momentum = 8 in fp32).

  python -m experiments.benchmarks.memory
"""

import gc

from experiments.benchmarks import common

common.use_virtual_devices()

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

from decoupled_diloco import experiment, model as model_lib  # noqa: E402
from experiments.benchmarks import inner_overhead  # noqa: E402


def bytes_on(devices) -> int:
  """Bytes of the distinct live buffers on `devices`.

  Buffers are keyed by address: `addressable_shards` hands out per-shard views that are
  live arrays themselves, and must not be counted twice.
  """
  devices, buffers = set(devices), {}
  for array in jax.live_arrays():
    for shard in array.addressable_shards:
      if shard.device in devices:
        buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
  return sum(buffers.values())


def framework_peak(config, devices) -> tuple[int, int, int]:
  """Runs two DiLoCo rounds of one group; returns (peak device bytes, peak host bytes, params)."""
  exp = experiment.build(config, devices=devices)
  learner, host = exp.learners[0], [exp.syncer.device]
  peak_device = peak_host = 0
  for _ in range(2):
    learner.start_from(exp.syncer.params, exp.syncer.version)
    for _ in range(config.inner_steps):
      learner.step()
    learner.drain_losses()
    push = learner.push(exp.syncer)
    peak_device, peak_host = max(peak_device, bytes_on(devices)), max(peak_host, bytes_on(host))
    exp.syncer.receive(push, now=0.0)
    del push
    peak_device, peak_host = max(peak_device, bytes_on(devices)), max(peak_host, bytes_on(host))
  return peak_device, peak_host, model_lib.count_params(exp.syncer.params)


def bare_peak(config, devices) -> int:
  """The hand-written loop's device bytes after some steps."""
  run_block = inner_overhead.bare_loop(config, devices)
  run_block()
  return bytes_on(devices)


def main():
  """Measures both sides and prints the ratios."""
  config = inner_overhead.benchmark_config()
  config.mode = "diloco"
  config.inner_steps = 5
  devices = jax.devices()[4:8]
  baseline_host = bytes_on(jax.devices()[:1])
  device_bytes, host_bytes, num_params = framework_peak(config, devices)
  gc.collect()
  bare_bytes = bare_peak(config, devices)
  figures = {
      "device_ratio": round(device_bytes / bare_bytes, 4), "host_bytes_per_param": round(
          (host_bytes - baseline_host) / num_params, 3), "framework_device_bytes": device_bytes,
      "bare_device_bytes": bare_bytes, "params": num_params}
  print(
      f"device: framework {device_bytes:,} B vs bare {bare_bytes:,} B; host {host_bytes:,} B for {num_params:,} params")
  common.emit(figures)


if __name__ == "__main__":
  main()

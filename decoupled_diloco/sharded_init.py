"""Initial parameters and optimizer state, created where they will live: never a whole model on one chip.

Why: the model's own initialiser (`model.build_model`) runs op by op on JAX's default device,
which on an accelerator is chip 0: an 8B model's 32 GB of float32 params would be built on one
32 GB v6e chip before anything shards them, and a 12B model could not start at all. Here the
initialiser is traced once and compiled with the target shardings as its outputs, so XLA's SPMD
partitioner has each device draw only its own shard (threefry is partitionable:
`jax_threefry_partitionable`, on by default) and a chip holds its shard plus the init's scratch.
Learner groups build their TrainState this way (`inner.InnerLoop.fresh`), the syncer its Θ on the
host's CPU device (`host_params`), in every runtime and in learner and syncer processes alike.

Values: on CPU a seed gives the params it always gave. XLA's algebraic simplifier would fold the
initialiser's scale (normal draw × stddev) into erf_inv's constants, which rounds differently
from the op-by-op init; it is switched off for these programs only (they run once per process).
An accelerator compiles them with all its passes: its op-by-op values were never the CPU's either.
"""

from collections.abc import Callable
from typing import Any

import jax

from decoupled_diloco import model as model_lib

# Compiler options of an init program for CPU devices: the same float rounding as the op-by-op initialiser.
SAME_AS_EAGER = {"xla_disable_hlo_passes": "algsimp"}


def params_fn(model_cfg, seed: int) -> Callable[[], dict]:
  """A pure zero-argument function returning the seed's initial params tree: what the compiled inits trace.

  Why a function, not params: traced under `jax.jit` it allocates nothing until the compiled
  program runs, and then only each device's shard.
  """
  return lambda: model_lib.build_model(model_cfg, seed)[1]


def compile_init(fn: Callable[[], Any], out_shardings) -> jax.stages.Compiled:
  """`fn` (no arguments) compiled to produce its outputs directly in `out_shardings`.

  Why compiled rather than jitted: a caller (the plan, the tests) can read the program's
  per-device memory before running it, and the options that keep the seed's values apply.
  """
  platform = next(iter(jax.tree.leaves(out_shardings)[0].device_set)).platform
  options = SAME_AS_EAGER if platform == "cpu" else None
  return jax.jit(fn, out_shardings=out_shardings).lower().compile(compiler_options=options)


def host_params(model_cfg, seed: int, device: jax.Device | None = None) -> dict:
  """Θ at `seed` on the host (the first CPU device, or `device`): what a syncer starts from.

  Why not `build_model`: on an accelerator host that would draw the whole model on chip 0 and
  copy it back; the syncer's Θ belongs in host memory from the start.
  """
  device = device or jax.local_devices(backend="cpu")[0]
  return compile_init(params_fn(model_cfg, seed), jax.sharding.SingleDeviceSharding(device))()


def peak_bytes(compiled: jax.stages.Compiled) -> int:
  """Bytes one device holds at a compiled program's peak by XLA's memory analysis: arguments,
  outputs and scratch, less what outputs alias (the figure `plan` prints for steps and inits)."""
  stats = compiled.memory_analysis()
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes -
             stats.alias_size_in_bytes)

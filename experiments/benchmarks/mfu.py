"""Model FLOPs utilisation of the framework's inner step, and its ratio to a bare jax loop.

For ~125M and ~350M Llama-style configs (RoPE, SwiGLU, bf16) with attention/remat variants,
times the framework's compiled inner step (inner.build_inner_loop: sharded jit, activation
constraints, donation) against a hand-written jax.jit + optax AdamW step of the same model on
the same devices, alternating blocks so both see the same load. mfu = model FLOPs per second /
(devices x peak bf16 FLOP/s) where the device's peak is known (TPU, H100/H200), else null.
On CPU the configs shrink to CPU-sized variants of the same shape (a quarter of the depth,
an eighth of the width, seq 128): the figure that matters there is `ratio` (target <= 1.03).

  python -m experiments.benchmarks.mfu
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import hardware, inner, mesh, model as model_lib  # noqa: E402

STEPS_PER_BLOCK = 5
BLOCKS = 7
# Peak dense bf16 FLOP/s per device, by jax device_kind prefix.
_PEAKS = {"TPU v4": hardware.CHIP_PEAK_FLOPS["v4"], "TPU v5 lite": hardware.CHIP_PEAK_FLOPS["v5e"],
          "TPU v5": hardware.CHIP_PEAK_FLOPS["v5p"], "TPU v6 lite": hardware.CHIP_PEAK_FLOPS["v6e"],
          "NVIDIA H100": 989e12, "NVIDIA H200": 989e12}
SIZES = {"125m": dict(d_model=768, num_layers=12, num_heads=12, d_ff=2048),
         "350m": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=2816)}
VARIANTS = {"xla": dict(attention="xla", remat="none"), "auto+minimal": dict(attention="auto", remat="minimal")}


def model_config(size: str, variant: str, on_cpu: bool):
  """The size's model (seq 2048, 32k vocab), or its CPU-sized variant."""
  cfg = default.get_config().model
  shape = dict(SIZES[size], vocab_size=32_000, seq_len=2048)
  if on_cpu:
    shape = dict(d_model=shape["d_model"] // 8, num_layers=shape["num_layers"] // 4, num_heads=shape["num_heads"],
                 d_ff=shape["d_ff"] // 8, vocab_size=1024, seq_len=128)
  cfg.update(dict(shape, dtype="bfloat16", position="rope", mlp="swiglu", scan_layers=True, **VARIANTS[variant]))
  return cfg


def runners(cfg, devices, batch_size):
  """(framework block, bare block): each takes STEPS_PER_BLOCK steps and waits for the last."""
  model, params, axes = model_lib.build_model(cfg, seed=0)
  optimizer = inner.inner_optimizer(default.get_config().inner, 10_000)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices), jax.eval_shape(lambda p: p, params),
                                axes)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32)
             for _ in range(STEPS_PER_BLOCK)]
  framework = {"state": loop.init(params)}

  def run_framework():
    for batch in batches:
      framework["state"], metrics = loop.step(framework["state"], loop.put_batch(batch))
    jax.block_until_ready(metrics)

  bare_mesh = jax.make_mesh((len(devices),), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
  replicated, split = NamedSharding(bare_mesh, PartitionSpec()), NamedSharding(bare_mesh, PartitionSpec("data"))
  bare = {"params": jax.device_put(params, replicated)}
  bare["opt_state"] = jax.jit(optimizer.init)(bare["params"])

  def bare_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  bare_step = jax.jit(bare_step, donate_argnums=(0, 1))

  def run_bare():
    for batch in batches:
      bare["params"], bare["opt_state"], loss = bare_step(bare["params"], bare["opt_state"],
                                                          jax.device_put(batch, split))
    jax.block_until_ready(loss)
  return run_framework, run_bare


def main() -> None:
  """Times every size x variant and prints per-config MFU (or null) and the worst ratio."""
  backend = jax.default_backend()
  devices = jax.devices()[:4] if backend == "cpu" else jax.devices()
  peak = next((p for prefix, p in _PEAKS.items() if devices[0].device_kind.startswith(prefix)), None)
  batch_size = 8 if backend == "cpu" else 8 * len(devices)
  mfu, ratios, ms = {}, {}, {}
  for size in SIZES:
    for variant in VARIANTS:
      cfg = model_config(size, variant, backend == "cpu")
      run_framework, run_bare = runners(cfg, devices, batch_size)
      run_framework(), run_bare()  # compile and warm up
      medians = common.interleaved_medians({"framework": run_framework, "bare": run_bare}, BLOCKS)
      name = f"{size}/{variant}"
      step = medians["framework"] / STEPS_PER_BLOCK
      flops = model_lib.flops_per_token(cfg) * batch_size * cfg.seq_len
      mfu[name] = None if peak is None else round(flops / step / (peak * len(devices)), 4)
      ratios[name] = round(medians["framework"] / medians["bare"], 4)
      ms[name] = round(step * 1e3, 2)
      print(f"{name}: {ms[name]} ms/step, ratio {ratios[name]}, mfu {mfu[name]}", flush=True)
  common.emit({"backend": backend, "device": devices[0].device_kind, "mfu": mfu, "ratio": max(ratios.values()),
               "ratios": ratios, "framework_ms_per_step": ms})


if __name__ == "__main__":
  main()

"""Model FLOPs utilisation of the framework's inner step, its ratio to a bare jax loop, and its FLOP count.

For ~125M and ~350M Llama-style configs (RoPE, SwiGLU, bf16, seq 2048) with attention and remat
variants, times the framework's compiled inner step (inner.build_inner_loop: sharded jit,
activation constraints, donation, scanned layers held stacked) against a hand-written jax.jit +
optax AdamW step of the same model, layout and devices (`runners`), both back to back in every
block (`paired_ratios`: alternating order, median of the blocks' ratios; in CPU seconds on the
CPU backend, where the devices are this process's threads, and in wall seconds elsewhere;
both clocks are printed on the context line). mfu = model FLOPs per
second / (devices x peak bf16 FLOP/s), where the device's peak is known (TPU, H100/H200), else
null; model FLOPs are the analytic 6N + attention count (model.flops_per_token), so remat's
recomputation is not counted as useful work.

The analytic count is checked against XLA's own: `flops_xla_vs_analytic` is the cost analysis
of the lowered forward + backward of each full-size config (loop layers, no remat, one
sequence of 2048 tokens: nothing compiled or allocated) over the analytic count, on any backend.

On CPU there is no MFU to measure: the configs shrink to CPU-sized variants of the same shape
(a quarter of the depth, an eighth of the width, seq 128, vocab 1024; named `<size>-cpu`), and
the figure that matters is `ratio` (framework / bare; target <= 1.03), the worst over configs.
`auto` attention resolves per backend (xla on CPU, so it is timed as such and labelled so).
The last line holds the issue's keys only (backend, mfu, ratio); the line before it, `context`,
holds per-config ms/step and ratios on both clocks with their range over blocks (the noise), the
compiled programs' FLOPs and bytes (framework / bare) and the FLOP-count check.

  python -m experiments.benchmarks.mfu [--sizes=125m,350m] [--variants=xla/none,...] [--blocks=11]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import argparse  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import hardware, inner, mesh, model as model_lib  # noqa: E402
from decoupled_diloco.model import attention  # noqa: E402

# Peak dense bf16 FLOP/s per device, by jax device_kind prefix.
_PEAKS = {
    "TPU v4": hardware.CHIP_PEAK_FLOPS["v4"], "TPU v5 lite": hardware.CHIP_PEAK_FLOPS["v5e"],
    "TPU v5": hardware.CHIP_PEAK_FLOPS["v5p"], "TPU v6 lite": hardware.CHIP_PEAK_FLOPS["v6e"], "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12}
SIZES = {
    "125m": dict(d_model=768, num_layers=12, num_heads=12, d_ff=2048), "350m": dict(d_model=1024, num_layers=24,
                                                                                    num_heads=16, d_ff=2816)}
# attention/remat: the plain model, the fused kernel per backend, and the remat policies that trade FLOPs for memory.
VARIANTS = ("xla/none", "dot_product/none", "auto/minimal", "auto/full")


def model_config(size: str, variant: str, on_cpu: bool, scan_layers: bool = True):
  """The size's model (seq 2048, 32k vocab) with the variant's attention/remat, or its CPU-sized variant."""
  cfg = default.get_config().model
  shape = dict(SIZES[size], vocab_size=32_000, seq_len=2048)
  if on_cpu:
    shape = dict(d_model=shape["d_model"] // 8, num_layers=shape["num_layers"] // 4, num_heads=shape["num_heads"],
                 d_ff=shape["d_ff"] // 8, vocab_size=1024, seq_len=128)
  attention_kind, remat = variant.split("/")
  cfg.update(
      dict(shape, dtype="bfloat16", position="rope", mlp="swiglu", scan_layers=scan_layers, attention=attention_kind,
           remat=remat))
  return cfg


def xla_vs_analytic_flops(size: str) -> float:
  """XLA's FLOPs of one full-size sequence's forward + backward over the analytic count (lowered only)."""
  cfg = model_config(size, "xla/none", on_cpu=False, scan_layers=False)
  model, shapes, _ = model_lib.abstract_params(cfg)
  cost = jax.jit(jax.value_and_grad(model.loss)).lower(shapes, jax.ShapeDtypeStruct((1, cfg.seq_len + 1),
                                                                                    "int32")).cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return round(float(cost["flops"]) / (model_lib.flops_per_token(cfg) * cfg.seq_len), 4)


def runners(cfg, devices, batch_size, steps):
  """(framework block, bare block, compiled-cost ratios): each block takes `steps` steps and waits for the last.

  Like with like: the bare loop is a hand-written jax.jit + optax AdamW step of the same model,
  traced under the same mesh (so the model's activation constraints apply alike) with its state
  placed, laid out and pinned as the framework's (FSDP shardings in and out, scanned blocks
  stacked) and donated: left to propagation, its outputs' shardings could drift from its inputs';
  what it leaves out is the framework itself (step counter, gradient norm, the InnerLoop). Both
  steps are compiled once, ahead of time, and the blocks call those executables (one compile per
  side: a jit call after `.lower().compile()` would compile again); both place each host batch
  inside the timed loop.
  """
  model, params, axes = model_lib.build_model(cfg, seed=0)
  optimizer = inner.inner_optimizer(default.get_config().inner, 10_000)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices), jax.eval_shape(lambda p: p, params), axes)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32) for _ in range(steps)]
  framework = {"state": loop.init(params)}
  bare = {"params": loop.to_step(loop.put_params(params))}
  bare["opt_state"] = jax.jit(optimizer.init)(bare["params"])

  def bare_step(params, opt_state, batch):
    with jax.sharding.use_abstract_mesh(loop.mesh.abstract_mesh):
      loss, grads = jax.value_and_grad(model.loss)(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

  shardings = (loop.state_shardings.params, loop.state_shardings.opt_state)
  bare_step = jax.jit(bare_step, in_shardings=(*shardings, loop.batch_sharding),
                      out_shardings=(*shardings, mesh.replicated(loop.mesh)), donate_argnums=(0, 1))
  batch = loop.put_batch(batches[0])
  framework_step = loop.step.lower(framework["state"], batch).compile()
  bare_step = bare_step.lower(bare["params"], bare["opt_state"], batch).compile()

  def run_framework():
    for batch in batches:
      framework["state"], metrics = framework_step(framework["state"], loop.put_batch(batch))
    jax.block_until_ready(metrics)

  def run_bare():
    for batch in batches:
      bare["params"], bare["opt_state"], loss = bare_step(bare["params"], bare["opt_state"],
                                                          jax.device_put(batch, loop.batch_sharding))
    jax.block_until_ready(loss)

  framework_cost, bare_cost = _cost(framework_step), _cost(bare_step)
  return run_framework, run_bare, {key: round(framework_cost[key] / bare_cost[key], 4) for key in _COST_KEYS}


_COST_KEYS = ("flops", "bytes accessed")


def _cost(compiled) -> dict:
  """XLA's cost analysis of a compiled step (FLOPs and bytes accessed per step).

  Why: on a loaded machine step times swing by tens of percent; the two compiled programs'
  own counts say, independently of the load, whether the framework's step does more work.
  """
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return {key: float(cost[key]) for key in _COST_KEYS}


def paired_ratios(run_framework, run_bare, blocks: int) -> dict:
  """Median framework seconds and median framework/bare ratio of paired blocks, in CPU and wall seconds.

  Why pairs: on a shared machine the load drifts between blocks; a block times both sides back to
  back (in alternating order, so neither always runs first), and the median of those ratios is
  robust to a slow stretch hitting one block, where a ratio of two medians is not. Why CPU seconds:
  on the CPU backend the devices are this process's threads, so its CPU seconds are the step's
  work (Python dispatch included) and leave out the time other jobs took; wall seconds beside them
  count that time too (and would show a framework that waited idle, which CPU seconds would not).
  """
  times = {(side, clock): [] for side in ("framework", "bare") for clock in ("cpu", "wall")}
  sides = [("framework", run_framework), ("bare", run_bare)]
  for block in range(blocks):
    for name, run in sides[::1 if block % 2 == 0 else -1]:
      wall, cpu = time.perf_counter(), time.process_time()
      run()
      times[name, "cpu"].append(time.process_time() - cpu)
      times[name, "wall"].append(time.perf_counter() - wall)
  figures = {}
  for clock in ("cpu", "wall"):
    ratios = sorted(f / b for f, b in zip(times["framework", clock], times["bare", clock]))
    figures[clock] = {
        "framework_s": statistics.median(times["framework", clock]), "ratio": statistics.median(ratios),
        "ratio_range": (ratios[0], ratios[-1])}
  return figures


def measure(sizes, variants, blocks: int, steps: int) -> tuple[dict, dict]:
  """Times every size x variant; returns (context, the issue's figures: backend, mfu, the worst ratio).

  `ratio` is in CPU seconds on the CPU backend and in wall seconds elsewhere (`paired_ratios`
  says why); the context holds both clocks per config.
  """
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  clock = "cpu" if on_cpu else "wall"
  devices = jax.devices()[:4] if on_cpu else jax.devices()
  peak = next((p for prefix, p in _PEAKS.items() if devices[0].device_kind.startswith(prefix)), None)
  batch_size = 8 if on_cpu else 8 * len(devices)
  mfu, timed, costs = {}, {}, {}
  for size in sizes:
    for variant in variants:
      cfg = model_config(size, variant, on_cpu)
      kind, remat = variant.split("/")
      name = f"{size}{'-cpu' if on_cpu else ''}/{attention.resolve_implementation(kind, backend)}/{remat}"
      if name in timed:
        continue  # `auto` resolved to a kernel already timed with the same remat.
      run_framework, run_bare, costs[name] = runners(cfg, devices, batch_size, steps)
      run_framework(), run_bare()  # compile and warm up
      timed[name] = {
          c: {
              "ms_per_step": round(f["framework_s"] / steps * 1e3, 2), "ratio": round(f["ratio"], 4),
              "ratio_range": [round(r, 4) for r in f["ratio_range"]
                             ]} for c, f in paired_ratios(run_framework, run_bare, blocks).items()}
      flops = model_lib.flops_per_token(cfg) * batch_size * cfg.seq_len
      step_s = timed[name]["wall"]["ms_per_step"] / 1e3
      mfu[name] = None if peak is None else round(flops / step_s / (peak * len(devices)), 4)
      print(f"{name}: {timed[name]}, mfu {mfu[name]}, compiled {costs[name]}", flush=True)
  context = {
      "device": devices[0].device_kind, "load_average": os.getloadavg(), "devices": len(devices),
      "batch_size": batch_size, "steps_per_block": steps, "blocks": blocks, "ratio_clock": clock, "timed": timed,
      "compiled_framework_vs_bare": costs,
      "flops_xla_vs_analytic": {size: xla_vs_analytic_flops(size) for size in sizes}}
  return context, {"backend": backend, "mfu": mfu, "ratio": max(t[clock]["ratio"] for t in timed.values())}


def main(argv=None) -> None:
  """Parses which configs to time, measures them, prints the context line and then the one JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default=",".join(SIZES), help=f"some of {', '.join(SIZES)}")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="attention/remat pairs")
  parser.add_argument("--blocks", type=int, default=11, help="alternating timed blocks per side (median taken)")
  parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
  args = parser.parse_args(argv)
  sizes, variants = args.sizes.split(","), args.variants.split(",")
  unknown = [s for s in sizes if s not in SIZES] + [v for v in variants if v.count("/") != 1]
  if unknown:
    parser.error(f"unknown sizes or variants {unknown}: sizes are {list(SIZES)}, variants attention/remat pairs")
  context, figures = measure(sizes, variants, args.blocks, args.steps)
  print(json.dumps({"context": context}, sort_keys=True))
  common.emit(figures)


if __name__ == "__main__":
  main()

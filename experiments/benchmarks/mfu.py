"""Model FLOPs utilisation of the framework's inner step, its ratio to a bare jax loop, and its FLOP count.

For ~125M and ~350M Llama-style configs (RoPE, SwiGLU, bf16, seq 2048) with attention and remat
variants, times what a learner runtime calls per inner step, `Learner.step` (batch placed by
`put_local_batch`, `InnerLoop.step` through its jit dispatch, losses fetched once a block), against
a plain jax.jit + optax AdamW step of the same model, layout and devices (`runners`), and a second
bare loop as an A/A control; `paired_ratios` says how the noise of a shared machine is handled.
mfu = model FLOPs per second / (devices x peak bf16 FLOP/s) where the device's peak is known
(hardware.ACCELERATORS, matched by exact device_kind), else null; model FLOPs are the analytic 6N + attention count
(model.flops_per_token), so remat's recomputation is not counted as useful work.
`flops_xla_vs_analytic` checks that count: XLA's cost analysis of the lowered forward + backward
of each full-size config (one sequence, nothing compiled) over the analytic count.

On CPU there is no MFU to measure: the configs shrink to CPU-sized variants of the same shape
(a quarter of the depth, an eighth of the width, seq 128, vocab 1024; named `<size>-cpu`), and
the figure that matters is `ratio` (framework / bare; target <= 1.03), the worst over configs.
`auto` attention resolves per backend (xla on CPU, so it is timed as such and labelled so).
The last line holds the issue's keys only (backend, mfu, ratio); the line before it, `context`,
holds per config ms/step, `ratio` and `aa` on both clocks with their quartiles over rounds, the
compiled programs' FLOPs and bytes (framework / bare) and the FLOP-count check.

  python -m experiments.benchmarks.mfu [--sizes=125m,350m] [--variants=xla/none,...] [--rounds=15] [--steps=1]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import argparse  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import hardware, inner, learner as learner_lib, mesh, model as model_lib  # noqa: E402
from decoupled_diloco.model import attention  # noqa: E402

SIZES = {
    "125m": dict(d_model=768, num_layers=12, num_heads=12, d_ff=2048),
    "350m": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=2816),
    "1b": dict(d_model=2048, num_layers=18, num_heads=16, d_ff=5632),}  # 1b: the device check's (device_check.py).
# attention/remat: the plain model, the fused kernel per backend, and the remat policies that trade FLOPs for memory.
VARIANTS = ("xla/none", "dot_product/none", "auto/minimal", "auto/full")
SIDES = ("framework", "bare", "bare_again")


def device_peak_flops(device) -> float | None:
  """The device's dense bf16 peak by its exact device_kind (hardware.chip_of_device); None where unknown (CPU)."""
  chip = hardware.chip_of_device(device.device_kind)
  return None if chip is None else hardware.CHIP_PEAK_FLOPS[chip]


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
  return round(_cost(cost)["flops"] / (model_lib.flops_per_token(cfg) * cfg.seq_len), 4)


def runners(cfg, devices, batch_size, steps):
  """({side: a block of `steps` steps that waits for its losses}, compiled-cost ratios framework / bare).

  Like with like: the bare step is a plain jax.jit + optax AdamW step of the same model, traced
  under the same mesh (so the model's activation constraints apply alike), its state placed, laid
  out and pinned as the framework's (FSDP shardings in and out, scanned blocks stacked) and
  donated; what it leaves out is the framework (the Learner and its bookkeeping, the InnerLoop,
  step counter, gradient norm). Both sides go through jit dispatch on every step and place each
  host batch inside the timed loop. `bare_again` is a second bare loop, its own state, the same
  executable: the A/A control.
  """
  model, params, axes = model_lib.build_model(cfg, seed=0)
  optimizer = inner.inner_optimizer(default.get_config().inner, 10_000)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices), jax.eval_shape(lambda p: p, params), axes)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), dtype=np.int32) for _ in range(steps)]
  data = types.SimpleNamespace(batch=lambda step: batches[step % steps], tokens_per_batch=batch_size * cfg.seq_len)
  learner = learner_lib.Learner(0, loop, data, loop.init(params))

  def bare_step(params, opt_state, batch):
    with jax.sharding.use_abstract_mesh(loop.mesh.abstract_mesh):
      loss, grads = jax.value_and_grad(model.loss)(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

  shardings = (loop.state_shardings.params, loop.state_shardings.opt_state)
  bare_step = jax.jit(bare_step, in_shardings=(*shardings, loop.batch_sharding),
                      out_shardings=(*shardings, mesh.replicated(loop.mesh)), donate_argnums=(0, 1))

  def bare_loop():
    state = {"params": loop.to_step(loop.put_params(params))}
    state["opt_state"] = jax.jit(optimizer.init, out_shardings=shardings[1])(state["params"])

    def run():
      losses = []
      for batch in batches:
        state["params"], state["opt_state"], loss = bare_step(state["params"], state["opt_state"],
                                                              jax.device_put(batch, loop.batch_sharding))
        losses.append(loss)
      jax.device_get(losses)

    return run, state

  def run_framework():
    for _ in batches:
      learner.step()
    learner.drain_losses()

  run_bare, bare_state = bare_loop()
  batch = loop.put_batch(batches[0])
  # Compiled ahead of time for XLA's counts; the jit calls above then find these executables in jax's cache.
  framework_cost = _cost(loop.step.lower(learner.state, batch).compile().cost_analysis())
  bare_cost = _cost(bare_step.lower(bare_state["params"], bare_state["opt_state"], batch).compile().cost_analysis())
  ratios = {key: round(framework_cost[key] / bare_cost[key], 4) for key in _COST_KEYS}
  return dict(zip(SIDES, (run_framework, run_bare, bare_loop()[0]))), ratios


_COST_KEYS = ("flops", "bytes accessed")


def _cost(cost) -> dict:
  """FLOPs and bytes accessed of a cost analysis (a dict, or a list of one): whether the framework's compiled
  step does more work than the bare one, whatever the load."""
  cost = cost[0] if isinstance(cost, list) else cost
  return {key: float(cost[key]) for key in _COST_KEYS}


def paired_ratios(runs: dict, rounds: int) -> dict:
  """Per clock: median framework seconds per block, and the medians over rounds of framework / bare and
  bare_again / bare (the A/A control) with their quartiles.

  Why this shape, on a shared machine: each round runs every side twice in palindrome order (ABCCBA,
  the first side rotating between rounds), so a load that rises or falls steadily within a round adds
  the same to each side's two blocks; short rounds keep that drift near linear, many rounds let the
  median drop the ones a burst of load hit unevenly. The A/A ratio, measured the same way between
  two identical loops, is the method's own error: a framework / bare ratio inside its spread is noise.
  Clock: on the CPU backend the devices are this process's threads, so its CPU seconds are the step's
  work (dispatch included) without other jobs' time; wall seconds beside them count that time too.
  """
  names = list(runs)
  times = {(name, clock): [] for name in names for clock in ("cpu", "wall")}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    spent = {(name, clock): 0.0 for name, clock in times}
    for name in order + order[::-1]:
      wall, cpu = time.perf_counter(), time.process_time()
      runs[name]()
      spent[name, "cpu"] += time.process_time() - cpu
      spent[name, "wall"] += time.perf_counter() - wall
    for key, seconds in spent.items():
      times[key].append(seconds / 2)
  figures = {}
  for clock in ("cpu", "wall"):
    bare = np.array(times["bare", clock])
    figures[clock] = {"framework_s": float(np.median(times["framework", clock]))}
    for key, side in (("ratio", "framework"), ("aa", "bare_again")):
      quartiles = np.percentile(np.array(times[side, clock]) / bare, [25, 50, 75])
      figures[clock] |= {key: float(quartiles[1]), f"{key}_quartiles": [float(quartiles[0]), float(quartiles[2])]}
  return figures


def measure(sizes, variants, rounds: int, steps: int) -> tuple[dict, dict]:
  """Times every size x variant; returns (context with both clocks, the issue's figures: the worst ratio)."""
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  clock = "cpu" if on_cpu else "wall"
  devices = jax.devices()[:4] if on_cpu else jax.devices()
  peak = device_peak_flops(devices[0])
  batch_size = 8 if on_cpu else 8 * len(devices)
  mfu, timed, costs = {}, {}, {}
  for size in sizes:
    for variant in variants:
      cfg = model_config(size, variant, on_cpu)
      kind, remat = variant.split("/")
      name = f"{size}{'-cpu' if on_cpu else ''}/{attention.select(kind, backend, cfg.dtype).kernel}/{remat}"
      if name in timed:
        continue  # `auto` resolved to a kernel already timed with the same remat.
      runs, costs[name] = runners(cfg, devices, batch_size, steps)
      for run in [*runs.values()] * 2:
        run()  # warm up
      timed[name] = {
          c: dict(ms_per_step=round(f.pop("framework_s") / steps * 1e3, 2),
                  **{k: np.round(v, 4).tolist() for k, v in f.items()}) for c, f in paired_ratios(runs, rounds).items()}
      flops = model_lib.flops_per_token(cfg) * batch_size * cfg.seq_len
      step_s = timed[name]["wall"]["ms_per_step"] / 1e3
      mfu[name] = None if peak is None else round(flops / step_s / (peak * len(devices)), 4)
      print(f"{name}: {timed[name]}, mfu {mfu[name]}, compiled {costs[name]}, load {os.getloadavg()}", flush=True)
  context = {
      "device": devices[0].device_kind, "load_average": os.getloadavg(), "devices": len(devices),
      "batch_size": batch_size, "steps_per_block": steps, "rounds": rounds, "ratio_clock": clock, "timed": timed,
      "compiled_framework_vs_bare": costs,
      "flops_xla_vs_analytic": {size: xla_vs_analytic_flops(size) for size in sizes}}
  return context, {"backend": backend, "mfu": mfu, "ratio": max(t[clock]["ratio"] for t in timed.values())}


def main(argv=None) -> None:
  """Parses which configs to time, measures them, prints the context line and then the one JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", default="125m,350m", help=f"some of {', '.join(SIZES)}")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="attention/remat pairs")
  parser.add_argument("--rounds", type=int, default=15, help="palindrome rounds per config (medians taken)")
  parser.add_argument("--steps", type=int, default=1, help="steps per timed block")
  args = parser.parse_args(argv)
  sizes, variants = args.sizes.split(","), args.variants.split(",")
  unknown = [s for s in sizes if s not in SIZES] + [v for v in variants if v.count("/") != 1]
  if unknown:
    parser.error(f"unknown sizes or variants {unknown}: sizes are {list(SIZES)}, variants attention/remat pairs")
  context, figures = measure(sizes, variants, args.rounds, args.steps)
  print(json.dumps({"context": context}, sort_keys=True))
  common.emit(figures)


if __name__ == "__main__":
  main()

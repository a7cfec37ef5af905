"""Compile time and memory of the inner step as depth grows, with and without scan_layers and remat.

Compiles the framework's real train step (inner.build_inner_loop, FSDP over 8 virtual CPU
devices) abstractly -- sharded ShapeDtypeStructs, nothing allocated -- for 4/8/16/32 layers of a
small-width model, once as a Python loop of blocks and once as one scanned block, and reads
XLA's memory analysis. Compile seconds are the compiling process's CPU seconds (XLA's CPU
compiler runs on one thread, so on an idle machine they equal wall seconds; on a loaded one
they do not count the time other jobs took); wall seconds are reported beside them.

Where the time goes (`breakdown`, scan at 4 and 32 layers): tracing + lowering vs XLA compile,
the model's loss and gradients alone, the kernels (fusions) in the compiled step, and the
conversions between the step's stacked state and the params tree of block_i's (compiled once
per run, outside the step: `InnerLoop.from_step` / `to_step`). Remat's effect is counted from
the saved residuals of jax.vjp (jax.ad_checkpoint.print_saved_residuals): XLA's CPU memory analysis does not reflect
rematerialisation reliably, so both are reported. Targets: with scan, 32 layers compile in
<= 1.5x the time of 4; at 16 layers full remat saves <= 1/4 of the residual bytes of none.

The run keeps to --budget_s: the measurements the target keys need come first, and once the
budget is spent the rest are skipped (listed under `skipped`), so it always ends with its JSON line.
That last line holds the issue's two keys only; the line before it, `context`, holds the rest.

  python -m experiments.benchmarks.compile_scale [--budget_s=1500] [--depths=4,8,16,32]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import contextlib  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax import ad_checkpoint  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import inner, mesh, model as model_lib  # noqa: E402

REMAT_DEPTH = 16
BATCH = 16
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "u32": 4, "bool": 1, "pred": 1, "s32": 4}


def model_config(num_layers: int, scan_layers: bool, remat: str = "none", width: int = 128):
  """A Llama-style model narrow enough to compile quickly, deep enough to show the trend."""
  cfg = default.get_config().model
  cfg.update(
      dict(vocab_size=256, seq_len=width, d_model=width, num_heads=4, d_ff=4 * width, num_layers=num_layers,
           dtype="bfloat16", position="rope", mlp="swiglu", scan_layers=scan_layers, remat=remat))
  return cfg


def _step_and_inputs(cfg):
  """The framework's jitted inner step on 8-way FSDP and its abstract (state, batch)."""
  model, shapes, axes = model_lib.abstract_params(cfg)
  optimizer = inner.inner_optimizer(default.get_config().inner, 100)
  devices = jax.devices()[:8]
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices, mesh.Layout(fsdp=len(devices))), shapes,
                                axes)
  return loop, optimizer, inner.abstract_inputs(loop, optimizer, shapes, BATCH, cfg.seq_len)


def timed_compile(jitted, *args) -> dict:
  """Lowers and compiles `jitted` for abstract args: seconds of each, XLA's memory, kernel count."""
  wall, cpu = time.perf_counter(), time.process_time()
  lowered = jitted.lower(*args)
  lower_cpu = time.process_time() - cpu
  wall, cpu = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  seconds, wall = time.process_time() - cpu, time.perf_counter() - wall
  memory = compiled.memory_analysis()
  peak = (memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes -
          memory.alias_size_in_bytes)
  return {
      "compile_s": round(seconds, 2), "compile_wall_s": round(wall, 2), "lower_s": round(lower_cpu, 2),
      "xla_peak_bytes": int(peak), "xla_temp_bytes": int(memory.temp_size_in_bytes),
      "fusions": compiled.as_text().count(" fusion(")}


def compile_step(cfg) -> dict:
  """`timed_compile` of the framework's inner step for `cfg`."""
  loop, _, inputs = _step_and_inputs(cfg)
  return timed_compile(loop.step, *inputs)


def compile_grads(cfg) -> dict:
  """`timed_compile` of the model's loss and gradients alone (no optimizer), same shardings."""
  loop, _, (state, batch) = _step_and_inputs(cfg)
  model, _, _ = model_lib.abstract_params(cfg)

  def grads(params, tokens):
    with jax.sharding.use_abstract_mesh(loop.mesh.abstract_mesh):
      return jax.value_and_grad(model.loss)(params, tokens)

  return timed_compile(jax.jit(grads), state.params, batch)


def compile_conversions(cfg) -> dict:
  """`timed_compile` of the step layout's conversions back and forth (stacked blocks <-> block_i's), summed.

  Why: with scan_layers the step holds the blocks stacked, and these deal them out where the
  tree leaves the step (pushes, landings, checkpoints). They are compiled once per run, not per
  step, and hold the L slices and stacks per block param that the step no longer does.
  """
  loop, _, (state, _) = _step_and_inputs(cfg)
  back = timed_compile(jax.jit(loop.from_step), state)
  canonical = jax.eval_shape(loop.from_step, state)
  forth = timed_compile(jax.jit(loop.to_step), canonical)
  return {key: round(back[key] + forth[key], 2) for key in ("compile_s", "compile_wall_s", "lower_s")}


def saved_residual_bytes(cfg) -> int:
  """Bytes the backward pass keeps from the forward (per global batch), params excluded."""
  model, shapes, _ = model_lib.abstract_params(cfg)
  batch = jax.ShapeDtypeStruct((BATCH, cfg.seq_len + 1), "int32")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    ad_checkpoint.print_saved_residuals(model.loss, shapes, batch)
  total = 0
  for line in out.getvalue().splitlines():
    match = re.match(r"(\w+)\[([\d,]*)\]", line)
    if match and "from the argument" not in line:
      count = 1
      for dim in filter(None, match.group(2).split(",")):
        count *= int(dim)
      total += count * _ITEMSIZE[match.group(1)]
  return total


def _ratio(results: dict, top: str, bottom: str, key: str = "compile_s"):
  if top not in results or bottom not in results:
    return None
  return round(results[top][key] / results[bottom][key], 3)


def measure(depths: tuple[int, ...], remat_depth: int, width: int, budget_s: float) -> tuple[dict, dict]:
  """Every measurement, most needed first, until the budget is spent; returns (context, the issue's keys)."""
  low, high = min(depths), max(depths)
  plan = [(f"scan_{d}", compile_step, model_config(d, True, width=width)) for d in (low, high)]
  plan += [(f"remat_{p}", compile_step, model_config(remat_depth, True, p, width)) for p in ("none", "full", "minimal")]
  plan += [(f"grads_{d}", compile_grads, model_config(d, True, width=width)) for d in (low, high)]
  plan += [(f"convert_{d}", compile_conversions, model_config(d, True, width=width)) for d in (low, high)]
  plan += [(f"scan_{d}", compile_step, model_config(d, True, width=width)) for d in depths if d not in (low, high)]
  plan += [(f"loop_{d}", compile_step, model_config(d, False, width=width)) for d in depths]
  begin, results, skipped = time.perf_counter(), {}, []
  for name, fn, cfg in plan:
    if results and time.perf_counter() - begin > budget_s:
      skipped.append(name)
      continue
    results[name] = fn(cfg)
    if name.startswith("remat_"):
      results[name]["saved_residual_bytes"] = saved_residual_bytes(cfg)
    print(f"{name}: {results[name]}", flush=True)
  residuals = {k: v["saved_residual_bytes"] for k, v in results.items() if k.startswith("remat_")}
  context = {
      "backend": jax.default_backend(),
      "load_average": os.getloadavg(),
      "compile_seconds": "compiling process CPU seconds (compile_wall_s beside them)",
      "width": width,
      "depths": list(depths),
      "compile": {k: v for k, v in results.items() if k.startswith(("scan_", "loop_"))},
      "breakdown": {k: v for k, v in results.items() if k.startswith(("grads_", "convert_"))},
      f"remat_{remat_depth}_layers": {k[len("remat_"):]: v for k, v in results.items() if k.startswith("remat_")},
      "compile_ratio_32_vs_4_wall": _ratio(results, f"scan_{high}", f"scan_{low}", "compile_wall_s"),
      "compile_ratio_32_vs_4_loop": _ratio(results, f"loop_{high}", f"loop_{low}"),
      "compile_ratio_32_vs_4_grads_only": _ratio(results, f"grads_{high}", f"grads_{low}"),
      "compile_ratio_32_vs_4_conversions": _ratio(results, f"convert_{high}", f"convert_{low}"),
      "remat_full_vs_none_xla_peak": _ratio(results, "remat_full", "remat_none", "xla_peak_bytes"),
      "skipped": skipped,}
  return context, {
      "compile_ratio_32_vs_4": _ratio(results, f"scan_{high}", f"scan_{low}"), "remat_full_vs_none_bytes":
          (round(residuals["remat_full"] /
                 residuals["remat_none"], 4) if {"remat_full", "remat_none"} <= residuals.keys() else None)}


def main(argv=None) -> None:
  """Parses the sizes and budget, measures, prints the context line and then the one JSON line."""
  parser = common.parser(__doc__)
  parser.add_argument("--depths", default="4,8,16,32", help="layer counts; the ratio is largest over smallest")
  parser.add_argument("--remat_depth", type=int, default=REMAT_DEPTH)
  parser.add_argument("--width", type=int, default=128, help="d_model and seq_len")
  parser.add_argument("--budget_s", type=float, default=1500.0, help="after the first, start no measurement past this")
  args = parser.parse_args(argv)
  depths = tuple(int(d) for d in args.depths.split(","))
  context, figures = measure(depths, args.remat_depth, args.width, args.budget_s)
  print(json.dumps({"context": context}, sort_keys=True))
  common.emit(figures)


if __name__ == "__main__":
  main()

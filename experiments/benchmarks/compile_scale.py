"""Compile time and memory of the inner step as depth grows, with and without scan_layers and remat.

Compiles the framework's real train step (inner.build_inner_loop, FSDP over 8 virtual CPU
devices) abstractly -- sharded ShapeDtypeStructs, nothing allocated -- for 4/8/16/32 layers of a
small-width model, once as a Python loop of blocks and once as one scanned block, and reads
XLA's memory analysis. Remat's effect is counted from the saved residuals of jax.vjp
(jax.ad_checkpoint.print_saved_residuals): XLA's CPU memory analysis does not reflect
rematerialisation reliably, so both are reported. Targets: with scan, 32 layers compile in
<= 1.5x the time of 4; at 16 layers full remat saves <= 1/4 of the residual bytes of none.

  python -m experiments.benchmarks.compile_scale
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import contextlib  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import io  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax import ad_checkpoint  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import inner, mesh, model as model_lib  # noqa: E402

DEPTHS = (4, 8, 16, 32)
REMAT_DEPTH = 16
BATCH = 16
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "u32": 4, "bool": 1, "pred": 1, "s32": 4}


def model_config(num_layers: int, scan_layers: bool, remat: str = "none"):
  """A Llama-style model narrow enough to compile quickly, deep enough to show the trend."""
  cfg = default.get_config().model
  cfg.update(dict(vocab_size=256, seq_len=128, d_model=128, num_heads=4, d_ff=512, num_layers=num_layers,
                  dtype="bfloat16", position="rope", mlp="swiglu", scan_layers=scan_layers, remat=remat))
  return cfg


def compile_step(cfg) -> tuple[float, int, int]:
  """(compile seconds, XLA peak bytes per device, XLA temp bytes) of the inner step on 8 devices."""
  model, shapes, axes = model_lib.abstract_params(cfg)
  optimizer = inner.inner_optimizer(default.get_config().inner, 100)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(jax.devices(), mesh.Layout(fsdp=len(jax.devices()))),
                                shapes, axes)
  lowered = loop.step.lower(*inner.abstract_inputs(loop, optimizer, shapes, BATCH, cfg.seq_len))
  begin = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - begin
  memory = compiled.memory_analysis()
  peak = (memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
          - memory.alias_size_in_bytes)
  return seconds, int(peak), int(memory.temp_size_in_bytes)


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


def main() -> None:
  """Compiles every depth both ways, then the remat comparison, and prints the JSON line."""
  results = {}
  for scan in (False, True):
    for depth in DEPTHS:
      seconds, peak, _ = compile_step(model_config(depth, scan))
      results[f"{'scan' if scan else 'loop'}_{depth}"] = {"compile_s": round(seconds, 2), "xla_peak_bytes": peak}
      print(f"{'scan' if scan else 'loop'} L={depth}: compile {seconds:.1f} s, XLA peak {peak / 2**20:.1f} MiB",
            flush=True)
  remat = {}
  for policy in ("none", "minimal", "full"):
    cfg = model_config(REMAT_DEPTH, True, policy)
    _, peak, temp = compile_step(cfg)
    remat[policy] = {"saved_residual_bytes": saved_residual_bytes(cfg), "xla_peak_bytes": peak,
                     "xla_temp_bytes": temp}
    print(f"remat={policy} L={REMAT_DEPTH}: {remat[policy]}", flush=True)
  common.emit({
      "backend": jax.default_backend(),
      "compile": results,
      "remat_16_layers": remat,
      "compile_ratio_32_vs_4": round(results["scan_32"]["compile_s"] / results["scan_4"]["compile_s"], 3),
      "compile_ratio_32_vs_4_loop": round(results["loop_32"]["compile_s"] / results["loop_4"]["compile_s"], 3),
      "remat_full_vs_none_bytes": round(remat["full"]["saved_residual_bytes"]
                                        / remat["none"]["saved_residual_bytes"], 4),
      "remat_full_vs_none_xla_peak": round(remat["full"]["xla_peak_bytes"] / remat["none"]["xla_peak_bytes"], 4),
  })


if __name__ == "__main__":
  main()

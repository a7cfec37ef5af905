r"""What only an accelerator can show, in one run: MFU and its ratio to a bare loop, peak bytes, a decoupled run.

  python -m experiments.benchmarks.device_check            # on a GPU (or TPU): the check; on a CPU: its toy
  python -m experiments.benchmarks.device_check --quick    # fewer rounds and a shorter decoupled run (tests)

Three parts, each the framework's own code path:
- Throughput: at ~350M and ~1B (Llama-style, bf16, seq 2048, no remat; mfu.model_config), for each attention
  kernel that applies on this backend (attention.select of 'auto' and 'xla': cuDNN's flash kernel and XLA's on
  a GPU), the learner's inner step (`Learner.step`) against a bare jax.jit + optax loop of the same model
  (mfu.runners, timed in palindrome rounds by mfu.paired_ratios): MFU where the chip's peak is known
  (hardware.chip_of_device), tokens/s, and `ratio` = framework / bare seconds, the worst config's (target <= 1.03).
- Peak device bytes: per size, a fresh process builds one learner (its state created sharded, sharded_init),
  takes a few steps and reads the device's `peak_bytes_in_use`, beside what `plan.memory_plan` predicts for that
  model, batch and chip (target: within 15%).
- A decoupled run: the syncer service on CPU and two learner processes (experiments.launch_local's
  LocalCluster; on a GPU machine both learners share the GPU, each preallocating its share, gpu_placement),
  the second slowed to half speed so that DyLU (measured speeds) can give the first more local steps (the
  toy's four rounds are too short to show it: 50 and 49 steps here): each learner's steps and blocked fraction
  (target <= 0.05) and Θ's final eval loss.
On a machine without an accelerator the same code runs on CPU-sized variants of the models (`<size>-cpu`,
XLA attention only): `device` is null, and so are the MFUs and measured peaks (a CPU reports no peak bytes).
The last line holds the issue's keys only: device, mfu, ratio, peak_bytes, decoupled; the line before it the
context (ms/step, tokens/s, build + compile seconds, the A/A control, the load).
"""

from experiments.benchmarks import mfu  # Sets up the CPU backend's virtual devices (common.use_virtual_devices).

import argparse  # noqa: E402  pylint: disable=g-import-not-at-top,g-bad-import-order
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import hardware, inner, learner as learner_lib, mesh, metrics as metrics_lib  # noqa: E402
from decoupled_diloco import plan, sharded_init  # noqa: E402
from decoupled_diloco import model as model_lib  # noqa: E402
from decoupled_diloco.model import attention  # noqa: E402
from experiments import gpu_placement  # noqa: E402
from experiments.benchmarks import common  # noqa: E402

SIZES = ("350m", "1b")
KEYS = ("device", "mfu", "ratio", "peak_bytes", "decoupled")
DECOUPLED = ("--config.mode=decoupled", "--config.learners.devices=(1,1)", "--config.learners.batch_size=(16,16)",
             "--config.learners.slowdown=(0.0,1.0)", "--config.policy.speed_source=measured", "--config.eval_every=2",
             "--config.service.learner_checkpoint_every=0")


def kernels(backend: str, dtype: str = "bfloat16") -> list[str]:
  """The attention kernels that apply on `backend`: what 'auto' runs and XLA's own, each once."""
  return list(dict.fromkeys(attention.select(setting, backend, dtype).kernel for setting in ("auto", "xla")))


def batch_size(on_cpu: bool, devices: int) -> int:
  """Sequences per step: 8 per device (8 on the CPU toy's 4 virtual devices)."""
  return 8 if on_cpu else 8 * devices


def planned_peak(cfg, devices: int, batch: int, chip: str) -> int:
  """plan.memory_plan's per-chip peak for one learner group of this model, batch and chip (FSDP over `devices`)."""
  config = default.get_config()
  config.model = cfg
  config.learners.update(dict(devices=(devices,), batch_size=(batch,), hardware=(chip,), layouts=(), fsdp=True))
  return plan.memory_plan(config, 0).peak


def measure_peak(size: str, kernel: str, steps: int) -> dict:
  """This process's device peak after building one learner (sharded init) and taking `steps` steps (a fresh process:
  the peak counter never resets), beside the plan's figure; measured is None where the device reports none."""
  devices = jax.devices()
  on_cpu = jax.default_backend() == "cpu"
  devices = devices[:4] if on_cpu else devices
  cfg = mfu.model_config(size, f"{kernel}/none", on_cpu)
  batch = batch_size(on_cpu, len(devices))
  model, shapes, axes = model_lib.abstract_params(cfg)
  optimizer = inner.inner_optimizer(default.get_config().inner, 10_000)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices, mesh.Layout(fsdp=len(devices))), shapes,
                                axes)
  rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1), dtype=np.int32)
  data = types.SimpleNamespace(batch=lambda step: rows, tokens_per_batch=batch * cfg.seq_len)
  learner = learner_lib.Learner(0, loop, data, loop.init_fresh(sharded_init.params_fn(cfg, 0)))
  for _ in range(steps):
    learner.step()
  learner.drain_losses()
  stats = devices[0].memory_stats()
  chip = hardware.chip_of_device(devices[0].device_kind) or "h200"  # A CPU has no HBM: the plan's figure only.
  return {
      "measured": stats.get("peak_bytes_in_use") if stats else None,
      "planned": planned_peak(cfg, len(devices), batch, chip)}


def peak_in_subprocess(size: str, kernel: str) -> dict:
  """`measure_peak` in a fresh process of this module (--peak=SIZE/KERNEL), its JSON line read back."""
  done = subprocess.run([sys.executable, "-m", "experiments.benchmarks.device_check", f"--peak={size}/{kernel}"],
                        capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f"the peak run of {size}/{kernel} failed: {done.stderr.strip()[-2000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def throughput(rounds: int, steps: int) -> tuple[dict, dict, float, dict]:
  """({config: MFU}, {config: peak bytes}, worst framework / bare ratio, context) over SIZES x kernels."""
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  devices = jax.devices()[:4] if on_cpu else jax.devices()
  peak_flops = mfu.device_peak_flops(devices[0])
  batch = batch_size(on_cpu, len(devices))
  figures, peaks, context = {}, {}, {}
  for size in SIZES:
    for index, kernel in enumerate(kernels(backend)):
      cfg = mfu.model_config(size, f"{kernel}/none", on_cpu)
      name = f"{size}{'-cpu' if on_cpu else ''}/{kernel}"
      begin = time.perf_counter()
      runs, costs = mfu.runners(cfg, devices, batch, steps)
      for run in runs.values():
        run()  # The first call compiles (or loads) each side's step.
      built = time.perf_counter() - begin
      timed = mfu.paired_ratios(runs, rounds)["cpu" if on_cpu else "wall"]
      step_seconds = timed["framework_s"] / steps
      flops = model_lib.flops_per_token(cfg) * batch * cfg.seq_len
      figures[name] = None if peak_flops is None else round(flops / step_seconds / (peak_flops * len(devices)), 4)
      context[name] = {
          "ms_per_step": round(step_seconds * 1e3, 2), "ratio": round(timed["ratio"], 4), "aa": round(timed["aa"], 4),
          "tokens_per_s": round(batch * cfg.seq_len / step_seconds), "build_and_compile_seconds": round(built, 1),
          "compiled_framework_vs_bare": costs}
      if index == 0:  # The kernel 'auto' runs: the peak a run of this model would reach.
        peaks[name] = peak_in_subprocess(size, kernel)
      print(f"{name}: {context[name]}, mfu {figures[name]}, peak {peaks.get(name)}", flush=True)
  return figures, peaks, max(c["ratio"] for c in context.values()), context


def decoupled_run(outer_steps: int, inner_steps: int, timeout: float) -> dict:
  """Two learner processes (on the accelerator when there is one) and a CPU syncer: steps, blocked, eval loss."""
  from experiments.launch_local import LocalCluster  # pylint: disable=g-import-not-at-top  (defines flags)
  overrides = [
      *DECOUPLED, f"--config.outer_steps={outer_steps}", f"--config.inner_steps={inner_steps}",
      f"--config.streaming.overlap_steps={inner_steps - 1}"]
  with tempfile.TemporaryDirectory() as workdir:
    cluster = LocalCluster("configs/demo.py", workdir, overrides, 2, group_devices=(1, 1),
                           gpu_ids=gpu_placement.visible_gpus())
    common.run_to_end(cluster, timeout)
    summaries = common.learner_summaries(cluster)
    records = metrics_lib.read_metrics(os.path.join(cluster.workdir, "metrics.jsonl"))
    evals = [r["eval_loss"] for r in records if r["kind"] == "eval"]
  return {
      "steps": [s["steps"] for s in summaries], "blocked": [round(s["blocked_fraction"], 4) for s in summaries],
      "eval_loss": round(evals[-1], 4) if evals else None, "eval_losses": [round(x, 4) for x in evals]}


def main(argv=None) -> None:
  """The check (or its CPU toy): throughput, peaks and the decoupled run, then the context and the JSON line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="3 rounds, 4 outer steps: the suite's toy")
  parser.add_argument("--peak", default=None, help="internal: SIZE/KERNEL, measure one peak and print it")
  args = parser.parse_args(argv)
  if args.peak:
    print(json.dumps(measure_peak(*args.peak.split("/"), steps=3)))
    return
  begin = time.perf_counter()
  device = None if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
  mfus, peaks, ratio, context = throughput(rounds=3 if args.quick else 7, steps=2)
  decoupled = decoupled_run(outer_steps=4 if args.quick else 8, inner_steps=10, timeout=900)
  eval_losses = decoupled.pop("eval_losses")
  common.emit_keys(
      {
          "device": device, "mfu": mfus, "ratio": ratio, "peak_bytes": peaks, "decoupled": decoupled,
          "configs": context, "eval_losses": eval_losses, "seconds": round(time.perf_counter() - begin),
          "load_average": os.getloadavg()}, KEYS)


if __name__ == "__main__":
  main()

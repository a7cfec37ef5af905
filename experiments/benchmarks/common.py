"""What every benchmark shares: virtual devices, interleaved timing, one local service run, the JSON line.

The machine is shared and noisy, so a benchmark never compares against a number from
another run: it alternates short blocks of the framework and of the baseline and takes
the median of each, so both see the same background load.
"""

import json
import os
import statistics
import time
from collections.abc import Callable

from decoupled_diloco import metrics as metrics_lib

NUM_DEVICES = 8


def use_virtual_devices(count: int = NUM_DEVICES) -> None:
  """Gives the CPU backend `count` devices; call before any JAX computation."""
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", count)


def interleaved_medians(runners: dict[str, Callable[[], None]], blocks: int) -> dict[str, float]:
  """Median seconds per call of each runner, calling them in alternation `blocks` times."""
  times = {name: [] for name in runners}
  for _ in range(blocks):
    for name, run in runners.items():
      begin = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - begin)
  return {name: statistics.median(values) for name, values in times.items()}


def run_to_end(cluster, timeout: float, chaos=None) -> None:
  """Runs a local service run (an experiments.launch_local.LocalCluster) to the end of its budget.

  Whatever is left is stopped, and a process that exited with an error fails the benchmark (a figure of a
  failed run would be wrong), except those `chaos` killed and learners stopped after the run ended.
  """
  cluster.start()
  try:
    codes = cluster.wait(timeout, chaos)
  finally:
    cluster.stop()
  excused = (chaos.abandoned if chaos is not None else set()) | cluster.stopped_after_end
  failed = {name: code for name, code in codes.items() if code and name not in excused}
  if failed:
    raise RuntimeError(f"processes failed: {failed}; see {cluster.workdir}/logs")


def learner_summaries(cluster) -> list[dict]:
  """Each learner's `learner_summary` record of a finished run, in learner order: its accounting."""
  summaries = []
  for m in range(cluster.num_learners):
    path = os.path.join(cluster.workdir, f"learner_{m}", "metrics.jsonl")
    summaries.append(next((r for r in metrics_lib.read_metrics(path) if r["kind"] == "learner_summary"), None))
    if summaries[-1] is None:
      raise RuntimeError(f"learner {m} wrote no learner_summary to {path}; see {cluster.workdir}/logs")
  return summaries


def emit(figures: dict) -> None:
  """The benchmark's result: one JSON line, always the last line printed."""
  print(json.dumps(figures, sort_keys=True))


def throughput_figures(figures: dict, nbytes: int, medians: dict[str, float], framework: str, baseline: str) -> dict:
  """`figures` plus seconds and GB/s of both sides of a same-bytes comparison, and `ratio`
  = baseline seconds / framework seconds (the framework's share of the baseline's throughput)."""
  for side in (framework, baseline):
    figures[f"{side}_seconds"] = round(medians[side], 4)
    figures[f"{side}_gbytes_per_s"] = round(nbytes / medians[side] / 1e9, 3)
  return {**figures, "bytes": nbytes, "ratio": round(medians[baseline] / medians[framework], 3)}


def emit_throughput_ratio(figures: dict, nbytes: int, medians: dict[str, float], framework: str, baseline: str) -> None:
  """`throughput_figures` as the result line."""
  emit(throughput_figures(figures, nbytes, medians, framework, baseline))


def emit_keys(figures: dict, keys: tuple[str, ...]) -> None:
  """`figures` without `keys` as a context line, then the result line of exactly `keys` (the issue's)."""
  print(json.dumps({k: v for k, v in figures.items() if k not in keys}, sort_keys=True))
  emit({k: figures[k] for k in keys})

"""What every benchmark shares: virtual devices, interleaved timing, one local service run, the JSON line.

The machine is shared and noisy, so a benchmark never compares against a number from
another run: it alternates short blocks of the framework and of the baseline and takes
the median of each, so both see the same background load.
"""

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from decoupled_diloco import metrics as metrics_lib

NUM_DEVICES = 8


def use_virtual_devices(count: int = NUM_DEVICES) -> None:
  """Gives the CPU backend `count` devices; call before any JAX computation."""
  os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={count}")
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", count)


def parser(doc: str) -> argparse.ArgumentParser:
  """A benchmark's argument parser, described by the first line of its module docstring."""
  return argparse.ArgumentParser(description=doc.splitlines()[0])


def parse_quick(doc: str, quick_help: str, argv=None) -> argparse.Namespace:
  """The cost-model benchmarks' one flag, --quick: a smaller run (for tests) whose shrinking `quick_help` names."""
  quick = parser(doc)
  quick.add_argument("--quick", action="store_true", help=quick_help)
  return quick.parse_args(argv)


def status_kb(field: str, pid: int | str = "self") -> int:
  """A kB field of a process's /proc status (VmRSS: resident memory now, VmHWM: its peak), Linux only."""
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak_kb() -> int:
  """Resets this process's peak RSS (VmHWM) to its RSS now, which it returns (kB): a phase's peak from here on."""
  with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
    f.write("5")
  return status_kb("VmRSS")


def interleaved_medians(runners: dict[str, Callable[[], None]], blocks: int, warm_up: bool = False) -> dict[str, float]:
  """Median seconds per call of each runner, calling them in alternation `blocks` times.

  `warm_up`: call each once first, untimed, so compilation and first connections are not measured.
  """
  for run in runners.values() if warm_up else ():
    run()
  times = {name: [] for name in runners}
  for _ in range(blocks):
    for name, run in runners.items():
      begin = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - begin)
  return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def compile_once():
  """Rows that compile the same programs load them from a persistent cache (a temporary directory) instead.

  A row's learners, syncer and evaluation are fresh functions, so JAX's in-memory cache misses on every row.
  """
  from decoupled_diloco.service import runconfig  # pylint: disable=g-import-not-at-top  (after use_virtual_devices)
  with tempfile.TemporaryDirectory() as cache:
    runconfig.cache_compiled_programs(cache)  # As a restarted learner or syncer loads its programs.
    yield


def simulate(config) -> tuple[dict, list[dict]]:
  """Runs `config` on the virtual clock in a fresh workdir: its summary (plus `wall_seconds`) and its eval records.

  The quality benchmarks' rows are such runs; they differ only in their configs and in what they print.
  """
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top  (after use_virtual_devices)
  from decoupled_diloco.runtime import sim  # pylint: disable=g-import-not-at-top
  begin = time.time()
  with tempfile.TemporaryDirectory() as workdir:
    summary = sim.run(experiment.build(config), workdir)
    evals = [r for r in metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl")) if r["kind"] == "eval"]
  return {**summary, "wall_seconds": time.time() - begin}, evals


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


def service_run(overrides, learners: int, timeout: float, config: str = "configs/demo.py",
                prefix: str = "") -> list[dict]:
  """A local service run of `config` (syncer and `learners` learner processes) in a fresh workdir, to its end.

  Prints each learner's accounting (`prefix` names the run) and the run's wall-clock; returns the
  learners' `learner_summary` records.
  """
  from experiments.launch_local import LocalCluster  # pylint: disable=g-import-not-at-top  (defines flags)
  begin = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    cluster = LocalCluster(config, workdir, list(overrides), learners)
    run_to_end(cluster, timeout)
    summaries = learner_summaries(cluster)
  for s in summaries:
    print(f"{prefix}learner {s['learner']}: {s['steps']} steps in {s['rounds']} rounds, wall {s['wall_seconds']:.1f}s, "
          f"compute {s['busy_seconds']:.1f}s, blocked {s['blocked_seconds']:.3f}s ({100 * s['blocked_fraction']:.2f}%; "
          f"final acks {s['final_ack_seconds']:.3f}s), exchanges {s['exchange_seconds']:.2f}s")
  print(f"{prefix}run wall-clock {time.perf_counter() - begin:.0f}s (with start-up and compilation)")
  return summaries


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


def emit_keys(figures: dict, keys: tuple[str, ...]) -> None:
  """`figures` without `keys` as a context line, then the result line of exactly `keys` (the issue's)."""
  print(json.dumps({k: v for k, v in figures.items() if k not in keys}, sort_keys=True))
  emit({k: figures[k] for k in keys})

"""Gbit/s each scheme needs to reach 50/80/90/95/99% compute utilization (Streaming DiLoCo Table 4).

Bisection on the per-link bandwidth (every link alike) with the cost model of
`decoupled_diloco.costmodel.wan`, for a 1B and a 12B model. Matched to Table 4 of
Streaming DiLoCo (arXiv 2501.18512) where it states its setup: step times of pure
compute 0.1 s for 1B (24 layers); for 12B, 48 layers (its 10B has 48) and 0.8 s x 12/10
= 0.96 s (its 10B step at the same hardware and batch, step time proportional to the
parameters); H = 100 for DiLoCo and streaming; fragments of 3 layers (P = 8 and 16);
tau = 1 (a sync may take one full compute step, as in its Table 1). Not stated there,
chosen here: M = 2 replicas (its main runs), no latency, full-duplex links.

Where the model differs from the paper's DAG simulation (so the figures are not expected
to match): ddp all-reduces after the step with no overlap (the paper overlaps the
gradient reduce with the backward pass, which is why its ddp needs far less at 95-99%);
diloco sends fp32 (the paper's vanilla DiLoCo row likely bf16); streaming pushes the
fragment to a syncer and gets the merge back only after the whole push arrived (store and
forward: 2x the one-way time, where a 2-replica all-reduce costs 1x), within exactly tau
steps (the paper's schedule also overlaps the sync with parts of the surrounding steps);
int4 carries one fp32 scale per 64 values (4.5 bits per value, FP4 E3M0 in the paper
likewise has scales). The paper reports the first point of a bandwidth grid that reaches
each level, we report the bisected threshold.

  python -m experiments.benchmarks.bandwidth_utilization [--quick]
"""

import math
import time

from decoupled_diloco.hardware import HardwareProfile
from decoupled_diloco.costmodel import wan
from experiments.benchmarks import common

TARGETS = (0.50, 0.80, 0.90, 0.95, 0.99)
REPLICAS = 2
H, TAU, LAYERS_PER_FRAGMENT = 100, 1, 3
TOKENS_PER_STEP = 1_000_000  # Only sets how many steps the budget holds (the step time is given).
PERIODS, QUICK_PERIODS = 20, 5  # H-step periods simulated: utilization is a steady-state figure.
REL_TOL, QUICK_REL_TOL = 1e-3, 2e-2
# name -> (params, layers, step seconds).
MODELS = {"1B": (1_000_000_000, 24, 0.1), "12B": (12_000_000_000, 48, 0.96)}
# Streaming DiLoCo Table 4, 1B rows (Gbit/s at 50/80/90/95/99%).
PUBLISHED_1B = {
    "ddp": (86.8, 152.6, 184.2, 222.3, 569.0), "diloco": (1.4, 6.2, 13.3, 23.3, 86.8),
    "streaming_bf16": (1.4, 4.3, 6.2, 9.1, 11.0), "streaming": (0.4, 0.9, 1.7, 2.0, 3.0)}
PUBLISHED_10B = {
    "ddp": (104.8, 222.3, 222.3, 268.3, 471.5), "diloco": (1.7, 7.5, 16.0, 33.9, 104.8),
    "streaming_bf16": (1.7, 3.6, 5.2, 6.2, 7.5), "streaming": (0.4, 0.9, 1.4, 1.4, 1.7)}
LABELS = {
    "ddp": "data-parallel (bf16)", "diloco": f"DiLoCo H={H} (fp32)", "streaming_bf16": "streaming + overlap (bf16)",
    "streaming": "streaming + overlap + int4"}


def make_setup(params: int, layers: int, step_seconds: float, periods: int) -> wan.Setup:
  """REPLICAS identical learners whose step takes `step_seconds` (a relative hardware profile)."""
  region = wan.Region(HardwareProfile("relative", 1, 1.0, 1.0, reference_step_seconds=step_seconds), TOKENS_PER_STEP,
                      gbps=1.0, latency_seconds=0.0)
  return wan.Setup(params, layers, periods * H * REPLICAS * TOKENS_PER_STEP, (region,) * REPLICAS)


def schemes(layers: int) -> dict[str, wan.Scheme]:
  """The table's rows for a model of `layers` layers."""
  fragments = layers // LAYERS_PER_FRAGMENT
  return {
      "ddp": wan.DDP, "diloco": wan.diloco(H), "streaming_bf16": wan.streaming(H, fragments, TAU, "bf16"),
      "streaming": wan.streaming(H, fragments, TAU, "int4")}


def _cell(gbps: float) -> str:
  return "unreachable" if math.isinf(gbps) else f"{gbps:.1f}" if gbps < 1000 else f"{gbps:.0f}"


def main(argv=None):
  """Bisects every (model, scheme, target) and prints the table beside the published rows."""
  args = common.parse_quick(__doc__, f"{QUICK_PERIODS} periods, tolerance {QUICK_REL_TOL}.", argv)
  begin = time.perf_counter()
  periods, tol = (QUICK_PERIODS, QUICK_REL_TOL) if args.quick else (PERIODS, REL_TOL)
  needed = {}
  for model, (params, layers, step) in MODELS.items():
    setup = make_setup(params, layers, step, periods)
    needed[model] = {
        name: {str(round(t * 100)): wan.bandwidth_for_utilization(setup, scheme, t, rel_tol=tol) for t in TARGETS}
        for name, scheme in schemes(layers).items()}
  print(f"M={REPLICAS}, H={H}, tau={TAU}, fragments of {LAYERS_PER_FRAGMENT} layers, no latency; " +
        "; ".join(f"{m}: {l} layers, step {s} s" for m, (_, l, s) in MODELS.items()))
  header = f"{'model':<6}{'scheme':<30}" + "".join(f"{f'{t:.0%}':>12}" for t in TARGETS)
  print(f"\nGbit/s to reach a compute utilization of\n{header}")
  for model, rows in needed.items():
    published = {"1B": PUBLISHED_1B, "12B": PUBLISHED_10B}[model]
    for name, cells in rows.items():
      print(f"{model:<6}{LABELS[name]:<30}" + "".join(f"{_cell(g):>12}" for g in cells.values()))
      print(f"{'':<6}{'  paper, ' + ('1B' if model == '1B' else '10B'):<30}" +
            "".join(f"{g:>12.1f}" for g in published[name]))
  print(f"runtime {time.perf_counter() - begin:.1f} s")
  finite = lambda g: None if math.isinf(g) else round(g, 3)
  by_target = lambda published: {n: dict(zip((str(round(t * 100)) for t in TARGETS), v)) for n, v in published.items()}
  common.emit({
      "gbps_needed": {m: {n: {t: finite(g) for t, g in c.items()} for n, c in rows.items()} for m, rows in needed.items()},
      "published_1B": by_target(PUBLISHED_1B), "published_10B": by_target(PUBLISHED_10B), "parameters": {
          "replicas": REPLICAS, "inner_steps": H, "overlap_steps": TAU, "layers_per_fragment": LAYERS_PER_FRAGMENT,
          "periods": periods, "rel_tol": tol,
          "models": {m: {"params": p, "layers": l, "step_seconds": s} for m, (p, l, s) in MODELS.items()}}})


if __name__ == "__main__":
  main()

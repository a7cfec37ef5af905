r"""Number of learners at a fixed token budget (Decoupled DiLoCo paper, Table 11).

M = 1, 2, 4, 8, 16 decoupled learners on tiny Shakespeare, equal speeds, the same global
batch split M ways (so every row takes the same steps per learner and sees the same
tokens), quorum 1 with Delayed Nesterov (one momentum step per M merges). Published
(text score, higher is better) for M = 2 / 4 / 8 / 16: 54.4 / 55.0 / 55.4 / 53.4 (quality
peaks near M = 8 and dips at 16). No target: an honest table.

  python -m experiments.benchmarks.learners_sweep
"""

from experiments.benchmarks import common

common.use_virtual_devices(16)

from absl import app  # noqa: E402  pylint: disable=g-import-not-at-top

from experiments.benchmarks import shakespeare  # noqa: E402

LEARNERS, OUTER_STEPS = (1, 2, 4, 8, 16), 8
PUBLISHED = {"2": 54.4, "4": 55.0, "8": 55.4, "16": 53.4}


def main(argv) -> None:
  """Runs one row per M and prints the table and the JSON line."""
  del argv
  sizes = LEARNERS[:2] if shakespeare.tiny() else LEARNERS
  results = {str(m): shakespeare.run(f"M={m}", shakespeare.config(m, OUTER_STEPS)) for m in sizes}
  loss = {m: round(r["eval_loss"], 4) for m, r in results.items()}
  print(f"\n{'M':>3s} {'eval loss':>10s} {'paper text score':>17s}")
  for m, value in loss.items():
    print(f"{m:>3s} {value:10.4f} {PUBLISHED.get(m, float('nan')):17.1f}")
  common.emit({
      "eval_loss": loss, "virtual_seconds": {m: round(r["virtual_seconds"], 1) for m, r in results.items()},
      "wall_seconds": {m: r["wall_seconds"] for m, r in results.items()}, "published": PUBLISHED})


if __name__ == "__main__":
  app.run(main)

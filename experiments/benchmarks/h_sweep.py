r"""Synchronization period H at equal tokens: synchronous DiLoCo's loss against H (Douillard et al. 2023, Fig. 3).

Every row is synchronous DiLoCo with M = 4 equal learners on tiny Shakespeare (configs/tiny_shakespeare.py
read from the plain file) on the virtual clock, the same inner steps per learner (so the same tokens) split
into rounds of H steps: only how often the learners sync changes. Published shape (150M params, C4, k = 8):
loss rises slowly with H (H = 1000 only 2.9% worse than H = 50) while the bytes each learner sends fall as
1/H. No target: the table is set beside that shape in docs/benchmarks.md.

  python -m experiments.benchmarks.h_sweep [--hs=1,5,20,50] [--steps=200] [--size=tiny]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

from absl import app, flags  # noqa: E402  pylint: disable=g-import-not-at-top

from configs import tiny_shakespeare  # noqa: E402
from decoupled_diloco import experiment  # noqa: E402
from experiments import cli  # noqa: E402
from experiments.benchmarks import shakespeare  # noqa: E402

HS = "1,5,20,50"
TINY_HS, TINY_STEPS = "1,2", 4
BASE = {
    "mode": "diloco",
    "runtime": "sim",
    "eval_every": 1_000_000,
    "eval_batches": 8,  # The final eval only,
    "checkpoint_every": 1_000_000}  # and the final checkpoint: H = 1 would write one every 5 steps.
PUBLISHED = "DiLoCo 150M, k = 8: H = 1000 is 2.9% worse than H = 50; bytes fall as 1/H"
_HS = flags.DEFINE_string("hs", HS, "Comma-separated H values; each must divide --steps.")
_STEPS = flags.DEFINE_integer("steps", 200, "Inner steps per learner, the same in every row (equal tokens).")


def row_config(h: int, steps: int):
  """A row: tiny_shakespeare at the flags' size as synchronous DiLoCo, `steps` inner steps in rounds of H."""
  base = {**BASE, **(shakespeare.TINY_LEARNERS if shakespeare.tiny() else {})}
  config = shakespeare.sized(experiment.with_overrides(tiny_shakespeare.get_config(), base), steps // h)
  config.inner_steps, config.outer_steps = h, steps // h
  config.inner.warmup_steps = min(config.inner.warmup_steps, steps // 4)
  return config


def main(argv) -> None:
  """Runs a row per H, then prints the table and the JSON line."""
  del argv
  hs_flag, steps = (TINY_HS, TINY_STEPS) if shakespeare.tiny() else (_HS.value, _STEPS.value)
  hs = [int(h) for h in hs_flag.split(",")]
  if any(h < 1 or steps % h for h in hs):
    cli.fail(f"--hs={hs_flag!r}: every H must be a positive divisor of --steps={steps} (equal tokens per row)")
  loss, sent, wall = {}, {}, {}
  with common.compile_once():  # Every row compiles the same shapes.
    for h in hs:
      summary, _ = common.simulate(row_config(h, steps))
      loss[str(h)], sent[str(h)], wall[str(h)] = summary["eval_loss"], summary["bytes_sent"], summary["wall_seconds"]
      print(f"H={h}: eval {loss[str(h)]:.4f}, {sent[str(h)] / 1e6:.2f} MB sent ({wall[str(h)]:.0f}s wall)", flush=True)
  first = str(hs[0])
  print(f"\n| H | rounds | eval loss | vs H = {first} | MB sent | x H |\n|---|---|---|---|---|---|")
  for h in hs:
    key = str(h)
    print(f"| {h} | {steps // h} | {loss[key]:.4f} | {100 * (loss[key] / loss[first] - 1):+.2f}% | "
          f"{sent[key] / 1e6:.2f} | {sent[key] * h / 1e6:.2f} |")
  common.emit_keys(
      {
          "eval_loss": {h: round(value, 4) for h, value in loss.items()}, "mb_sent": {
              h: round(value / 1e6, 3) for h, value in sent.items()}, "steps": steps, "wall_seconds": {
                  h: round(value) for h, value in wall.items()}, "published": PUBLISHED}, ("eval_loss",))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

r"""Low-bit outer gradients with and without error feedback, in lockstep and under staleness.

Does error feedback rescue 2-bit pseudo-gradients under staleness as it does in lockstep? Every row trains
the same model on the same tokens (configs/tiny_shakespeare.py from the plain file, 4 learners at relative
speeds 2:2:1:1 on the virtual clock) as synchronous DiLoCo (`sync`: speeds change only the clock) or as
Decoupled DiLoCo (`decoupled`: quorum 1, each learner's residual carried across the merges others made
meanwhile), with a format's error feedback off or on (`_ef`). Each loss is set against fp32 in the same
mode. Published: Decoupled DiLoCo (no error feedback) int4 about lossless, 2-bit and 1-bit collapse;
SparseLoCo and MuLoCo train at 2 bits and 1-3% top-k with error feedback.

  python -m experiments.benchmarks.low_bit [--formats=int4,int2,topk] [--outer_steps=6] [--size=tiny]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

from absl import app, flags  # noqa: E402  pylint: disable=g-import-not-at-top

from configs import tiny_shakespeare  # noqa: E402
from decoupled_diloco import experiment  # noqa: E402
from experiments import cli  # noqa: E402
from experiments.benchmarks import shakespeare  # noqa: E402

FORMATS = {
    "int4": {"compression.format": "int4"}, "int2": {"compression.format": "int2"},
    "topk": {"compression.format": "topk", "compression.topk_fraction": 0.01}}
MODES = {"sync": {"mode": "diloco"}, "decoupled": {"mode": "decoupled"}}
OUTER_STEPS = 6  # Rounds of 25 inner steps (--outer_steps).
BASE = {
    "runtime": "sim", "eval_every": 1_000_000, "eval_batches": 8, "checkpoint_every": 1_000_000,
    "learners.speed": (2.0, 2.0, 1.0, 1.0)}
TINY = {**shakespeare.TINY_LEARNERS, "learners.speed": (2.0, 1.0)}
_FORMATS = flags.DEFINE_string("formats", ",".join(FORMATS), f"Comma-separated formats out of {list(FORMATS)}.")


def row_config(mode: str, overrides: dict):
  """A row: tiny_shakespeare at the flags' size in `mode`, `overrides` (a format and error feedback) on top."""
  base = {**BASE, **MODES[mode], **(TINY if shakespeare.tiny() else {})}
  config = shakespeare.sized(experiment.with_overrides(tiny_shakespeare.get_config(), base), OUTER_STEPS)
  return experiment.with_overrides(config, overrides)


def main(argv) -> None:
  """Runs fp32 and every format with and without error feedback in both modes; prints the table and JSON line."""
  del argv
  formats = _FORMATS.value.split(",")
  if not formats or not set(formats) <= set(FORMATS):
    cli.fail(f"--formats={_FORMATS.value!r}: use names out of {list(FORMATS)}")
  loss = {}
  with common.compile_once():  # Every row compiles the same shapes.
    for mode in MODES:
      rows = {
          "fp32": {}, **{
              f"{f}{ef}": {
                  **FORMATS[f], "compression.error_feedback": ef == "_ef"} for f in formats for ef in ("", "_ef")}}
      for name, overrides in rows.items():
        summary, _ = common.simulate(row_config(mode, overrides))
        loss[mode, name] = summary["eval_loss"]
        print(f"{mode} {name}: eval {loss[mode, name]:.4f} ({summary['wall_seconds']:.0f}s wall)", flush=True)
  ratio = {
      f: {f"{mode}{ef}": round(loss[mode, f + ef] / loss[mode, "fp32"] - 1, 4) for mode in MODES for ef in ("", "_ef")}
      for f in formats}
  print("\n| format | sync | sync + EF | decoupled | decoupled + EF |\n|---|---|---|---|---|")
  print(f"| fp32 (eval loss) | {loss['sync', 'fp32']:.4f} | | {loss['decoupled', 'fp32']:.4f} | |")
  for f in formats:
    print(f"| {f} | " +
          " | ".join(f"{100 * ratio[f][key]:+.2f}%" for key in ("sync", "sync_ef", "decoupled", "decoupled_ef")) + " |")
  common.emit_keys(
      {
          "eval_loss_vs_fp32": ratio, "eval_loss": {
              f"{mode}_{name}": round(value, 4) for (mode, name), value in loss.items()}}, ("eval_loss_vs_fp32",))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

"""What compressing the outer gradients costs in loss, on tiny Shakespeare, with and without streaming.

Every row trains the same model on the same tokens with synchronous DiLoCo on the virtual
clock (4 equal learners, configs/tiny_shakespeare.py read from the plain file), changing
only what the pseudo-gradients look like on the wire: fp32, bf16, blockwise int8 / int4,
ternary int2 and top-k (1%) with error feedback. The streaming rows split the model into 3
strided fragments synced at staggered steps with 1 step of overlap, for fp32, int4 and
top-k. Left out to stay under 20 minutes here: fp4 (E3M0; `--formats=...,fp4` adds it,
+0.05% vs fp32 when last run) and bf16 / int8 streamed (equal to fp32 streamed to 4 decimals). Published
reference (Streaming / Decoupled DiLoCo): int4 within 1% of fp32; 2-bit and below visibly
worse.

  python -m experiments.benchmarks.compression_quality [--formats=fp32,int4,int2] [--outer_steps=6] [--size=tiny]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

from absl import app, flags  # noqa: E402  pylint: disable=g-import-not-at-top

from configs import tiny_shakespeare  # noqa: E402
from decoupled_diloco import experiment  # noqa: E402
from experiments import cli  # noqa: E402
from experiments.benchmarks import shakespeare  # noqa: E402

FORMATS = {
    "fp32": {"compression.format": "fp32"},
    "bf16": {"compression.format": "bf16"},
    "int8": {"compression.format": "int8"},
    "int4": {"compression.format": "int4"},
    "int2": {"compression.format": "int2"},
    "topk_ef": {"compression.format": "topk", "compression.error_feedback": True},
    "fp4": {"compression.format": "fp4"},}
DEFAULT_FORMATS = "fp32,bf16,int8,int4,int2,topk_ef"
STREAMED = ("fp32", "int4", "topk_ef")
STREAMING = {"streaming.num_fragments": 3, "streaming.strategy": "strided", "streaming.overlap_steps": 1}
OUTER_STEPS = 6  # Rounds of 25 inner steps per row (--outer_steps).
BASE = {"mode": "diloco", "runtime": "sim", "eval_every": 100, "eval_batches": 8}
_FORMATS = flags.DEFINE_string("formats", DEFAULT_FORMATS, f"Comma-separated rows out of {list(FORMATS)}.")


def row_config(overrides: dict):
  """A row: tiny_shakespeare at the flags' size, `overrides` on top; tiny keeps a layer per streamed fragment."""
  base = {**BASE, **(shakespeare.TINY_LEARNERS if shakespeare.tiny() else {})}
  config = shakespeare.sized(experiment.with_overrides(tiny_shakespeare.get_config(), base), OUTER_STEPS)
  if shakespeare.tiny():  # 'strided' fragments are whole layers.
    config.model.num_layers = STREAMING["streaming.num_fragments"]
  return experiment.with_overrides(config, overrides)


def main(argv) -> None:
  """Runs every row, then prints the table, the context line and the JSON line."""
  del argv
  formats = _FORMATS.value.split(",")
  if not {"fp32", "int4", "int2"} <= set(formats) <= set(FORMATS):
    cli.fail(f"--formats={_FORMATS.value!r}: use names out of {list(FORMATS)}, with fp32, int4 and int2")
  rows = {(name, False): FORMATS[name] for name in formats}
  rows.update({(name, True): {**FORMATS[name], **STREAMING} for name in STREAMED if name in formats})
  loss, sent = {}, {}
  with common.compile_once():  # Every row compiles the same shapes.
    for (name, streamed), overrides in rows.items():
      key = f"{name}{'_streaming' if streamed else ''}"
      config = row_config(overrides)
      summary, _ = common.simulate(config)
      loss[key], sent[key] = summary["eval_loss"], summary["bytes_sent"]
      print(f"{key}: eval {loss[key]:.4f}, {sent[key] / 1e6:.2f} MB sent ({summary['wall_seconds']:.0f}s wall)",
            flush=True)
  print("\n| format | eval loss | vs fp32 | streaming (P=3, tau=1) | vs fp32 | MB sent |\n|---|---|---|---|---|---|")
  for name in formats:
    streamed = f"{name}_streaming"
    cells = ([f"{loss[streamed]:.4f}", f"{100 * (loss[streamed] / loss['fp32_streaming'] - 1):+.2f}%"]
             if streamed in loss else ["", ""])
    print(f"| {name} | {loss[name]:.4f} | {100 * (loss[name] / loss['fp32'] - 1):+.2f}% | {' | '.join(cells)} "
          f"| {sent[name] / 1e6:.2f} |")
  common.emit_keys(
      {
          "eval_loss": {name: round(loss[name], 4) for name in formats},
          "eval_loss_streaming": {name: round(loss[f"{name}_streaming"], 4) for name in STREAMED if name in formats},
          "int4_vs_fp32": round(loss["int4"] / loss["fp32"] - 1, 4),
          "int2_vs_fp32": round(loss["int2"] / loss["fp32"] - 1, 4),
          "megabytes_sent": {key: round(value / 1e6, 3) for key, value in sent.items()},
          "outer_steps": config.outer_steps,}, ("eval_loss",))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

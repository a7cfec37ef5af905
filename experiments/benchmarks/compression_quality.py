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

  python -m experiments.benchmarks.compression_quality
"""

import tempfile

from experiments.benchmarks import common

common.use_virtual_devices()

import jax  # noqa: E402  pylint: disable=g-import-not-at-top

from configs import tiny_shakespeare  # noqa: E402  pylint: disable=g-import-not-at-top
from decoupled_diloco import experiment  # noqa: E402

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
BASE = {
    "data.source": "text_file", "data.path": "../shared/data/tinyshakespeare.txt", "mode": "diloco", "runtime": "sim",
    "eval_every": 100, "eval_batches": 8}


def main():
  """Runs every row, then prints the table and the JSON line."""
  parser = common.parser(__doc__)
  parser.add_argument("--outer_steps", type=int, default=6, help="Outer rounds of 25 inner steps per row.")
  parser.add_argument("--formats", default=DEFAULT_FORMATS, help=f"Comma-separated rows out of {list(FORMATS)}.")
  args = parser.parse_args()
  formats = args.formats.split(",")
  if not {"fp32", "int4", "int2"} <= set(formats) <= set(FORMATS):
    parser.error(f"--formats={args.formats!r}: use names out of {list(FORMATS)}, with fp32, int4 and int2")
  rows = {(name, False): FORMATS[name] for name in formats}
  rows.update({(name, True): {**FORMATS[name], **STREAMING} for name in STREAMED if name in formats})
  loss, sent = {}, {}
  with tempfile.TemporaryDirectory() as cache:
    # Every row compiles the same shapes: the persistent cache compiles them once.
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    for (name, streamed), overrides in rows.items():
      key = f"{name}{'_streaming' if streamed else ''}"
      config = {**BASE, "outer_steps": args.outer_steps, **overrides}
      summary, _ = common.simulate(experiment.with_overrides(tiny_shakespeare.get_config(), config))
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
  common.emit({
      "eval_loss": {name: round(loss[name], 4) for name in formats},
      "eval_loss_streaming": {name: round(loss[f"{name}_streaming"], 4) for name in STREAMED if name in formats},
      "int4_vs_fp32": round(loss["int4"] / loss["fp32"] - 1, 4),
      "int2_vs_fp32": round(loss["int2"] / loss["fp32"] - 1, 4),
      "megabytes_sent": {key: round(value / 1e6, 3) for key, value in sent.items()},
      "outer_steps": args.outer_steps,})


if __name__ == "__main__":
  main()

"""Compression throughput: jitted quantize + dequantize vs a plain device copy, same run.

A learner compresses every pseudo-gradient it pushes (and, with error feedback, decodes
it again), so a codec must run near memory speed or it eats the bandwidth it saves.
Each format encodes then decodes one large float32 vector through the public
`compression.encode` / `compression.decode`; the baseline is a jitted copy of the same
bytes (x + 1 on a non-donated input: XLA must write a fresh output buffer). Both run in
alternating blocks so they see the same background load. GB/s counts the float32 input
bytes once. Target: ratio = int4 GB/s / copy GB/s >= 0.3.

  python -m experiments.benchmarks.compress_throughput [--size_mb=64] [--blocks=9]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco import compression
from experiments.benchmarks import common

FORMATS = ("int4", "int8", "fp4", "int2", "bf16", "topk")


def parse_args(argv=None) -> argparse.Namespace:
  """Vector size, timing blocks, block size and top-k fraction."""
  parser = common.parser(__doc__)
  parser.add_argument("--size_mb", type=float, default=64.0, help="MiB of float32 to compress.")
  parser.add_argument("--blocks", type=int, default=9, help="Timed calls per runner (median is reported).")
  parser.add_argument("--block_size", type=int, default=64, help="Values per absmax scale.")
  parser.add_argument("--topk_fraction", type=float, default=0.01, help="Share of entries topk sends.")
  return parser.parse_args(argv)


def copy_runner(x):
  """A jitted copy of x that XLA cannot elide: the output is a new buffer with every value written."""
  copy = jax.jit(lambda v: v + 1)
  return lambda: jax.block_until_ready(copy(x))


def codec_runner(codec: compression.Codec, x):
  """One push's compression round trip: encode, then decode what was sent."""
  return lambda: jax.block_until_ready(compression.decode(codec, compression.encode(codec, [x])))


def main(argv=None):
  """Times every format against the copy in alternation and prints GB/s and ratios."""
  args = parse_args(argv)
  size = int(args.size_mb * 2**20) // 4
  x = jnp.asarray(np.random.default_rng(0).standard_normal(size, dtype=np.float32))
  runners = {"copy": copy_runner(x)}
  for fmt in FORMATS:
    codec = compression.Codec(format=fmt, block_size=args.block_size, topk_fraction=args.topk_fraction)
    runners[fmt] = codec_runner(codec, x)
  medians = common.interleaved_medians(runners, args.blocks, warm_up=True)
  gbps = {name: x.nbytes / seconds / 1e9 for name, seconds in medians.items()}
  for name, value in gbps.items():
    print(f"{name:>5}: {value:7.2f} GB/s  ({medians[name] * 1e3:8.2f} ms for {x.nbytes / 2**20:.0f} MiB)")
  figures = {
      "ratio": round(gbps["int4"] / gbps["copy"], 4), "size_mb": args.size_mb, "copy_gbps": round(gbps["copy"], 3)}
  for fmt in FORMATS:
    figures[f"{fmt}_gbps"] = round(gbps[fmt], 3)
    figures[f"{fmt}_ratio"] = round(gbps[fmt] / gbps["copy"], 4)
  common.emit(figures)


if __name__ == "__main__":
  main()

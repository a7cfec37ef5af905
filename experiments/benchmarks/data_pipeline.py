"""Input pipeline throughput per host (byte and SentencePiece, with packing) vs what the inner step consumes.

One learner process's pipeline (a text file memory-mapped into line-aligned documents, shuffled,
tokenized, packed into seq_len + 1 windows with end-of-document tokens, prefetched in a worker
thread) is timed here, next to the tokens per second that a learner's inner step takes on this
machine in the same run. Targets: headroom = SentencePiece pipeline / consumption >= 10;
tpu_host_headroom = SentencePiece pipeline / 57,600 tokens/s (one v6e host: MaxText's ~7.2k
tokens/s/chip x 8 chips) >= 1; rss_growth_mb (peak RSS of a pipeline over a 10x larger corpus
minus over the small one, each in its own process) <= 50.

  python -m experiments.benchmarks.data_pipeline [--small_mb=100] [--batches=300] [--steps=20]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import argparse  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from decoupled_diloco.data import documents, pipeline, tokenizer  # noqa: E402
from experiments import cli  # noqa: E402

TPU_HOST_TOKENS_PER_S = 7_200 * 8
SEQ_LEN, ROWS, CHUNK_BYTES = 1024, 16, 1 << 16


def write_text(path: pathlib.Path, megabytes: int, seed: int = 0) -> None:
  """Zipf-distributed pseudo-English (words, lines, paragraphs), written block by block."""
  rng = np.random.default_rng(seed)
  letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
  words = [bytes(rng.choice(letters, size=rng.integers(1, 9))) for _ in range(20_000)]
  with open(path, "wb") as f:
    block = None
    for index in range(megabytes):
      if index % 16 == 0:  # A fresh 1 MB block now and then; repeats between are fine for timing.
        ids = np.minimum(rng.zipf(1.2, size=200_000), len(words)) - 1
        text = b" ".join(words[i] for i in ids)
        block = text.replace(b" e ", b".\n").replace(b" t ", b".\n\n")[:1 << 20]
      f.write(block)


def pipeline_tokens_per_s(path: str, tok, batches: int) -> float:
  """Tokens per second one learner's packed pipeline delivers, its first batch included.

  Each row's documents hold many windows, so only runs of many batches average over tokenization.
  """
  size = os.path.getsize(path)
  docs = documents.FileDocuments(path, 0, size, CHUNK_BYTES)
  learner = pipeline.PackedBatches(docs, tok, SEQ_LEN, learner_index=0, num_learners=1, batch_size=ROWS, split="iid",
                                   seed=0, prefetch=4)
  begin = time.perf_counter()
  for step in range(batches):
    learner.batch(step)
  seconds = time.perf_counter() - begin
  learner.close()
  return batches * ROWS * SEQ_LEN / seconds


def consumption_tokens_per_s(steps: int) -> float:
  """Tokens per second of `steps` inner steps of a learner group (inner_overhead's benchmark model)."""
  import jax  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top
  from experiments.benchmarks import inner_overhead  # pylint: disable=g-import-not-at-top
  config = inner_overhead.benchmark_config()
  learner = experiment.build(config, devices=jax.devices()[:4]).learners[0]
  for _ in range(3):
    learner.step()
  learner.drain_losses()
  begin = time.perf_counter()
  for _ in range(steps):
    learner.step()
  learner.drain_losses()
  return steps * learner.batches.tokens_per_batch / (time.perf_counter() - begin)


def peak_rss_mb(path: str, model: str, batches: int) -> float:
  """Peak RSS of a fresh process that runs the SentencePiece pipeline over `path` for `batches` batches."""
  code = ("import sys, resource; from experiments.benchmarks import data_pipeline as d; "
          "from decoupled_diloco.data import tokenizer; "
          "d.pipeline_tokens_per_s(sys.argv[1], tokenizer.SentencePieceTokenizer(sys.argv[2]), int(sys.argv[3])); "
          "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
  result = subprocess.run(
      [sys.executable, "-c", code, path, model, str(batches)], capture_output=True, text=True, check=True,
      cwd=pathlib.Path(__file__).resolve().parents[2])
  return int(result.stdout.split()[-1]) / 1024


def main():
  """Generates the corpora, trains a tokenizer on a sample, times everything, prints one JSON line."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--small_mb", type=int, default=100)
  parser.add_argument("--batches", type=int, default=300)
  parser.add_argument("--steps", type=int, default=20, help="Inner steps timed for the consumed tokens/s.")
  args = parser.parse_args()
  if min(args.small_mb, args.batches, args.steps) < 1:
    cli.fail(f"--small_mb={args.small_mb}, --batches={args.batches} and --steps={args.steps} must be >= 1")
  with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    small, large, sample = root / "small.txt", root / "large.txt", root / "sample.txt"
    write_text(small, args.small_mb)
    write_text(large, 10 * args.small_mb)
    write_text(sample, 4, seed=1)
    model = tokenizer.train_sentencepiece(str(sample), 8192, str(root / "sp.model"))
    sp = tokenizer.SentencePieceTokenizer(model)
    byte_rate = pipeline_tokens_per_s(str(small), tokenizer.ByteTokenizer(), args.batches)
    sp_rate = pipeline_tokens_per_s(str(small), sp, args.batches)
    consumed = consumption_tokens_per_s(args.steps)
    rss_small = peak_rss_mb(str(small), model, args.batches)
    rss_large = peak_rss_mb(str(large), model, args.batches)
  print(f"pipeline: byte {byte_rate:,.0f} tokens/s, sentencepiece {sp_rate:,.0f} tokens/s; inner step consumes "
        f"{consumed:,.0f} tokens/s; peak RSS {rss_small:.0f} MB ({args.small_mb} MB corpus) vs "
        f"{rss_large:.0f} MB ({10 * args.small_mb} MB); seq_len {SEQ_LEN}, rows {ROWS}, {os.cpu_count()} CPUs, "
        f"this process's peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
  common.emit({
      "byte_tokens_per_s": round(byte_rate), "sentencepiece_tokens_per_s": round(sp_rate),
      "consumed_tokens_per_s": round(consumed), "headroom": round(sp_rate / consumed, 2),
      "tpu_host_headroom": round(sp_rate / TPU_HOST_TOKENS_PER_S, 2), "rss_growth_mb": round(rss_large - rss_small, 1)})


if __name__ == "__main__":
  main()

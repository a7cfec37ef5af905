"""Shared test helpers: shrunken real configs (the demo's shape, a model and data small enough for CPU),
and waiting for what another thread or process does a moment later."""

import json
import os
import time

from configs import default
from decoupled_diloco import experiment


def quick_compile_env() -> dict:
  """The environment for a benchmark's child process: XLA without LLVM's optimisation passes.

  Toy runs spend most of their CPU compiling; this halves tiny hetero_quality's (and gives the same losses).
  """
  return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()}


def tiny_config(**overrides):
  """The default config with a ~30k-parameter model, short runs and a small synthetic corpus."""
  config = default.get_config()
  config.model.seq_len = 16
  config.model.d_model = 32
  config.model.num_layers = 1
  config.model.num_heads = 2
  config.model.d_ff = 64
  config.data.synthetic.num_tokens = 60_000
  config.learners.devices = (2, 2)
  config.learners.batch_size = (4, 4)
  config.outer_steps = 3
  config.inner_steps = 4
  config.inner.warmup_steps = 2
  config.log_every = 2
  config.eval_batches = 2
  config.eval_batch_size = 8
  config.checkpoint_every = 2
  return experiment.with_overrides(config, overrides)


def read_records(workdir, kind=None) -> list[dict]:
  """A run's metrics.jsonl records (of `kind`, or all) without their wall_time: what two equal runs share."""
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time", None)
  return [r for r in records if kind is None or r["kind"] == kind]


def write_documents(directory, counts=(("train", 200), ("eval", 20))) -> str:
  """Short byte-level documents as ArrayRecord shards (what experiments.prepare_data writes); returns the dir."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  for split, count in counts:
    writer = array_record_module.ArrayRecordWriter(f"{directory}/{split}-00000-of-00001.array_record", "group_size:1")
    for i in range(count):
      writer.write((f"doc {i}: " + "abcab" * (i % 7 + 1) + ".").encode())
    writer.close()
  return str(directory)


def wait_for(condition, seconds: float = 5.0, interval: float = 0.01) -> bool:
  """Whether `condition()` holds within `seconds`, asked every `interval`: for effects another thread or
  process makes a moment later (a loaded machine delays them; a fixed sleep either wastes time or races).
  A condition that reads files of a running cluster is asked less often, so as not to load it."""
  deadline = time.monotonic() + seconds
  while not condition():
    if time.monotonic() >= deadline:
      return False
    time.sleep(interval)
  return True

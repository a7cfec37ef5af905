"""The setting the paper-experiment benchmarks share: tiny Shakespeare on the virtual clock, and their table.

failure_quality, quorum_grace and learners_sweep train the same byte-level model
(configs/tiny_shakespeare.py) on the same text with the same global batch, so their
rows differ only in what each benchmark studies; hetero_quality and compression_quality
take the same flags (`sized`). `--size=tiny` shrinks model and
budget so tests run every benchmark end to end in seconds.
"""

import pathlib

from absl import flags

from configs import tiny_shakespeare
from decoupled_diloco import experiment
from experiments.benchmarks import common

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
_DATA = flags.DEFINE_string("data_path", str(REPO_ROOT / ".." / "shared" / "data" / "tinyshakespeare.txt"),
                            "Plain-text tiny Shakespeare (see ../shared/data/README.md).")
_SIZE = flags.DEFINE_enum("size", "full", ["full", "tiny"], "'tiny': a few steps of a toy model (tests).")
_OUTER = flags.DEFINE_integer("outer_steps", 0, "Rounds of H steps per learner; 0 = the benchmark's own.")

TINY_LEARNERS = {"learners.devices": (1, 1), "learners.batch_size": (16, 16)}  # 2 groups compile 4x faster than 8.
GLOBAL_BATCH = 32  # Sequences per step summed over learners: every row sees the same tokens per step.
INNER_STEPS = 20  # H.


def tiny() -> bool:
  """Whether this is the test-sized run."""
  return _SIZE.value == "tiny"


def config(learners: int, outer_steps: int, **overrides):
  """Decoupled DiLoCo with `learners` groups of one device, GLOBAL_BATCH / M sequences each.

  Quorum 1, polynomial staleness and Delayed Nesterov with one momentum step per M merges
  (the hetero_shakespeare recipe), relative speed 1 on the clock (1 s per step).
  """
  cfg = tiny_shakespeare.get_config()
  cfg.mode, cfg.runtime = "decoupled", "sim"
  cfg.model.seq_len = 64
  cfg.inner_steps = INNER_STEPS
  cfg.learners.devices = (1,) * learners
  cfg.learners.batch_size = (GLOBAL_BATCH // learners,) * learners
  cfg.syncer.quorum = 1
  cfg.outer.optimizer, cfg.outer.buffer_size = "delayed_nesterov", learners
  cfg.eval_every, cfg.eval_batches = 1_000_000, 8  # Only the final evaluation counts here.
  return experiment.with_overrides(sized(cfg, outer_steps), overrides)


def sized(cfg, outer_steps: int):
  """`cfg` reading --data_path for --outer_steps rounds (else `outer_steps`), shrunk by --size=tiny.

  Every tiny Shakespeare benchmark takes these three flags alike, so a test runs each of them end to end.
  """
  cfg.data.source, cfg.data.path = "text_file", _DATA.value
  cfg.outer_steps = _OUTER.value or outer_steps
  if tiny():
    cfg.model.seq_len, cfg.model.d_model, cfg.model.num_layers, cfg.model.d_ff = 32, 32, 1, 64
    cfg.inner_steps, cfg.outer_steps, cfg.inner.warmup_steps, cfg.eval_batches = 4, 2, 2, 2
  return cfg


def run(name: str, cfg) -> dict:
  """Runs one row on the virtual clock and returns its summary (plus `wall_seconds`)."""
  summary, _ = common.simulate(cfg)
  summary["wall_seconds"] = round(summary["wall_seconds"])
  print(
      f"{name}: eval {summary['eval_loss']:.4f}, goodput {summary['goodput']:.3f}, virtual "
      f"{summary['virtual_seconds']:.0f} s, {summary['wall_seconds']} s wall", flush=True)
  return summary


def compare(rows: dict, published_goodput: dict, counts: tuple[str, ...] = ()) -> tuple[dict, dict]:
  """Runs every row and prints one table; returns the summaries and the JSON fields every row has.

  failure_quality and quorum_grace compare rows against their first (the synchronous baseline)
  the same way: eval loss, its ratio to the baseline, goodput next to the paper's, and the
  summary `counts` a benchmark studies (failures, merges), so they share this one table.
  """
  results = {name: run(name, cfg) for name, cfg in rows.items()}
  loss, good = ({n: round(r[k], 4) for n, r in results.items()} for k in ("eval_loss", "goodput"))
  base = next(iter(loss))
  width = max(len(name) for name in rows) + 2
  print(f"\n{'row':{width}s} {'eval loss':>10s} {'vs ' + base:>{len(base) + 4}s} {'goodput':>8s} {'paper':>6s} " +
        "".join(f"{c:>10s} " for c in counts) + f"{'virtual s':>10s}")
  for name, r in results.items():
    print(f"{name:{width}s} {loss[name]:10.4f} {loss[name] / loss[base]:{len(base) + 4}.4f} {good[name]:8.1%} "
          f"{published_goodput[name]:6.0%} " + "".join(f"{r.get(c) or 0:10d} " for c in counts) +
          f"{r['virtual_seconds']:10.0f}")
  return results, {
      "eval_loss": loss, "goodput": good,
      **{c: {n: r.get(c) or 0 for n, r in results.items()} for c in counts}, "virtual_seconds": {
          n: round(r["virtual_seconds"], 1) for n, r in results.items()},
      "wall_seconds": {n: r["wall_seconds"] for n, r in results.items()}}

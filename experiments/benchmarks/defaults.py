"""Out of the box: Decoupled DiLoCo with the defaults against synchronous DiLoCo with the defaults, per config.

A user switches a config to Decoupled DiLoCo with `--config.mode=decoupled --config.runtime=sim`
and sets nothing else; the fields left at 'auto' then take the decoupled recipe
(decoupled_diloco/mode_defaults.py). This benchmark trains each config both ways on the same
token budget and prints the final eval losses side by side. Target: decoupled / sync <= 1.03 for
every config (issue 27).

  python -m experiments.benchmarks.defaults [--size=tiny] [--data_path=...]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import os  # noqa: E402  pylint: disable=g-import-not-at-top
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import app  # noqa: E402

from configs import demo, hetero_v5p_v6e, tiny_shakespeare  # noqa: E402
from decoupled_diloco import experiment  # noqa: E402
from decoupled_diloco.runtime import lockstep, sim  # noqa: E402
from experiments import cli  # noqa: E402
from experiments.benchmarks import shakespeare  # noqa: E402

TARGET = 1.03
CONFIGS = {"demo": demo, "tiny_shakespeare": tiny_shakespeare, "hetero_v5p_v6e": hetero_v5p_v6e}
# The two modes with nothing else set (sync in each config's own runtime).
ROWS = {"sync": {"mode": "diloco"}, "decoupled": {"mode": "decoupled", "runtime": "sim"}}
TINY = {"outer_steps": 3, "inner_steps": 4, "eval_batches": 1, "data.synthetic.num_tokens": 50_000}


def base_config(name: str):
  """The shipped config `name`, reading tiny Shakespeare from --data_path; shrunk with --size=tiny."""
  config = CONFIGS[name].get_config()
  if name == "tiny_shakespeare":
    config = shakespeare.sized(config, config.outer_steps)
  return experiment.with_overrides(config, TINY) if shakespeare.tiny() else config


def train(config) -> float:
  """The final eval loss of `config` trained in a fresh workdir by its runtime."""
  exp = experiment.build(config)
  try:
    with tempfile.TemporaryDirectory() as workdir:
      summary = {"lockstep": lockstep, "sim": sim}[config.runtime].run(exp, os.path.join(workdir, "run"))
  finally:
    for learner in exp.learners:
      learner.batches.close()
  if summary.get("diverged"):
    return float("inf")
  return summary["eval_loss"]


def main(argv) -> None:
  """Trains every config in both modes, prints the table and the JSON line."""
  del argv
  losses, seconds = {}, {}
  with common.compile_once():
    for name in CONFIGS:
      for row, overrides in ROWS.items():
        begin = time.time()
        losses[(name, row)] = train(experiment.with_overrides(base_config(name), overrides))
        seconds[(name, row)] = round(time.time() - begin)
        print(f"{name} {row}: eval {losses[(name, row)]:.4f} ({seconds[(name, row)]} s)", flush=True)
  ratio = {name: round(losses[(name, "decoupled")] / losses[(name, "sync")], 4) for name in CONFIGS}
  print(f"\n{'config':18s} {'sync':>8s} {'decoupled':>10s} {'ratio':>7s}  target <= {TARGET}")
  for name in CONFIGS:
    print(f"{name:18s} {losses[(name, 'sync')]:8.4f} {losses[(name, 'decoupled')]:10.4f} {ratio[name]:7.4f}  "
          f"{'met' if ratio[name] <= TARGET else 'MISSED'}")
  common.emit_keys(
      {
          "loss_ratio": ratio, "eval_loss": {f"{n}/{r}": round(v, 4) for (n, r), v in losses.items()}, "wall_seconds": {
              f"{n}/{r}": s for (n, r), s in seconds.items()}}, ("loss_ratio",))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

r"""Runs every point of a config file's get_sweep() one after another, or prints their commands.

  python -m experiments.sweep --config=configs/diloco_sync.py --workdir=/tmp/dd_sweep
  python -m experiments.sweep --config=configs/diloco_sync.py --workdir=/tmp/dd_sweep --dry_run
  python -m experiments.report /tmp/dd_sweep

Each point trains in WORKDIR/<name> (e.g. `outer.lr=0.5,inner_steps=10`) and one row per
point lands in WORKDIR/results.csv. `--config.k=v` flags apply to every point (a point's
own override of the same key wins). Every point is validated before the first one runs:
a bad sweep prints one `error:` line, exits with status 2 and creates nothing. A rerun
reuses points that already finished with the same config. `--dry_run` prints one
`python -m experiments.train ...` command per point instead, e.g. to launch each on its
own Cloud TPU VM.
"""

import sys

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

from experiments import cli
from experiments import train  # Shares --config and --workdir, the error line and the flag parser.

_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print one launch command per point instead of running them.")


def main(argv: list[str]) -> None:
  """Validates every point, then runs them in order (or prints their commands)."""
  del argv
  train.quiet_library_logs()
  config = train.load_config()
  config_flag = flags.FLAGS["config"]
  config_file, root = config_flags.get_config_filename(config_flag), flags.FLAGS.workdir
  # Imported here so that `--help` and flag errors stay fast.
  from decoupled_diloco.research import report, sweep  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top

  try:
    points = sweep.expand(config, sweep.load_sweep(config_file))
  except ConfigError as error:
    cli.fail(error)
  if _DRY_RUN.value:
    shared = config_flags.get_override_values(config_flag)
    for point in points:
      overrides = {**{k: v for k, v in shared.items() if k not in point.overrides}, **point.overrides}
      print(sweep.launch_command(config_file, f"{root.rstrip('/')}/{point.name}", overrides))
    return
  # Virtual CPU devices for the widest point; must precede JAX's first use of the backend.
  jax.config.update("jax_num_cpu_devices", max(sum(p.config.learners.devices) for p in points))
  rows = sweep.run_sweep(points, root)
  print(report.markdown_table({p.name: row for p, row in zip(points, rows) if row["status"] == "ok"}), end="")
  print(f"results: {root.rstrip('/')}/{sweep.RESULTS_FILE}")
  failed = [p.name for p, row in zip(points, rows) if row["status"] != "ok"]
  if failed:
    sys.stderr.write(f"error: {len(failed)} of {len(points)} sweep points failed ({', '.join(failed)}): "
                     f"see the error column of {sweep.RESULTS_FILE}\n")
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

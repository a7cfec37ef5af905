r"""Writes PNG plots and a markdown summary table (report.md) for runs or whole sweeps.

  python -m experiments.report /tmp/dd_sweep                       # a sweep: one curve per point
  python -m experiments.report /tmp/dd_hetero /tmp/dd_hetero_sync --out=/tmp/dd_compare

Each argument is a run's --workdir or a sweep's (its points' subdirectories). The outputs
go to --out (default: DIR/report under the first argument): loss_vs_tokens.png,
loss_vs_wall_time.png, loss_vs_virtual_time.png, utilization.png, staleness.png (each only
when some run has the records it needs) and report.md. The plotting code lives in
decoupled_diloco.research.report, for notebooks.
"""

import os

from absl import app
from absl import flags

from experiments import cli

_OUT = flags.DEFINE_string("out", None, "Directory for the PNGs and report.md (default: <first DIR>/report).")


def main(argv: list[str]) -> None:
  """Loads the runs under every DIR argument and writes the report."""
  paths = argv[1:]
  if not paths:
    cli.fail("no run given: pass one or more workdirs, e.g. python -m experiments.report /tmp/dd_demo")
  # Imported here so that `--help` and usage errors stay fast.
  from decoupled_diloco.research import report  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top

  try:
    runs = report.load_runs(paths)
  except ConfigError as error:
    cli.fail(error)
  for path in report.write_report(runs, _OUT.value or os.path.join(paths[0], "report")):
    print(path)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

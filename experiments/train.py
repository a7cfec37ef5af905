r"""Trains a language model with DiLoCo (or the ddp baseline) from an ml_collections config.

  python -m experiments.train --config=configs/demo.py --workdir=/tmp/dd_demo
  python -m experiments.train --config=configs/demo.py --config.outer.lr=0.5 --workdir=/tmp/dd_lr05

Bad input (unknown config key, impossible device layout, missing data) prints one line
starting with `error:` and exits with status 2 before anything is written.
"""

import logging as py_logging
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/demo.py", "Experiment config file (a configs/*.py with get_config()).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where metrics.jsonl, TensorBoard events and checkpoints go.")
flags.mark_flag_as_required("workdir")


def fail(message: str) -> None:
  """The one way entry points report bad input: a single line and exit status 2."""
  text = " ".join(str(message).replace("\\n", "\n").split()) or "invalid input"
  sys.stderr.write(f"error: {text}\n")
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, except that bad flags exit 2 with one line instead of 1 with a trace."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as error:
    text = str(error)
    if "Did you mean" in text or isinstance(error.__cause__, KeyError):
      key = text.split("\\n")[0].strip("'\\ ")
      hint = text[text.index("Did you mean"):].rstrip("'") if "Did you mean" in text else ""
      fail(f"unknown config key {key}: fix the --config.* override. {hint}")
    fail(error)


def load_config():
  """The parsed config; a config file that does not load is bad input, not a crash."""
  try:
    config = _CONFIG.value
    config.keys()  # The flag loads lazily: touch it so a broken file fails here.
    return config
  except OSError as error:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    fail(f"cannot load --config ({lines[-1]}): pass an existing configs/*.py with get_config()")


def quiet_library_logs() -> None:
  """Keeps progress lines readable: orbax logs every file it writes at INFO."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname)


def main(argv: list[str]) -> None:
  """Builds the experiment from the config and runs it under the configured runtime."""
  del argv
  quiet_library_logs()
  config = load_config()
  # Virtual CPU devices must be requested before JAX's CPU backend starts; on TPU
  # hosts this only sizes the (unused) CPU backend.
  jax.config.update("jax_num_cpu_devices", max(sum(config.learners.devices), 1))
  # Imported here so that `--help` and flag errors stay fast.
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import lockstep, sim  # pylint: disable=g-import-not-at-top

  try:
    exp = experiment.build(config)
    logging.info("%s: %d learner group(s) on %s devices, %s tokens of data", config.mode,
                 len(exp.learners), tuple(config.learners.devices), f"{len(exp.corpus.train):,}")
    summary = {"lockstep": lockstep, "sim": sim}[config.runtime].run(exp, _WORKDIR.value)
  except ConfigError as error:
    fail(error)
  if summary["eval_loss"] is None:
    print(f"nothing to do: the run in {_WORKDIR.value} is already at outer step {config.outer_steps}")
    return
  message = f"final eval loss {summary['eval_loss']:.4f}"
  if summary["optimal_loss"] is not None:
    message += f" (optimum {summary['optimal_loss']:.4f}, gap {summary['eval_loss'] - summary['optimal_loss']:.4f})"
  if "virtual_seconds" in summary:
    message += (f"; virtual time {summary['virtual_seconds']:.1f}s, goodput {summary['goodput']:.3f}, "
                f"{summary['outer_updates']} outer updates, steps per learner {summary['steps']}, "
                f"idle fraction per learner {summary['idle_fraction']}")
  logging.info(message)
  print(message)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)

r"""Trains a language model with DiLoCo (or the ddp baseline) from an ml_collections config.

  python -m experiments.train --config=configs/demo.py --workdir=/tmp/dd_demo
  python -m experiments.train --config=configs/demo.py --config.outer.lr=0.5 --workdir=/tmp/dd_lr05

As separate processes (the syncer serves gRPC; each learner group is its own process; the
shared token comes from $DD_SYNCER_TOKEN or --config.service.token_file, never a flag):
  python -m experiments.train --config=configs/demo.py --role=syncer --workdir=/tmp/dd_svc
  python -m experiments.train --config=configs/demo.py --role=learner --learner_id=0 \
      --syncer=127.0.0.1:PORT --workdir=/tmp/dd_svc
  python -m experiments.train --config=configs/demo.py --config.service.evaluate_on=evaluator \
      --role=evaluator --syncer=127.0.0.1:PORT --workdir=/tmp/dd_svc
(experiments/launch_local.py starts all of them and reads PORT from <workdir>/syncer_address; the
evaluator, which reads Θ with its own read-only credential, only with service.evaluate_on='evaluator'.)
A learner group over several JAX processes (a multi-host slice) runs the learner command in
each of them, adding --group_coordinator=HOST:PORT --group_processes=N --group_process_id=K
(or --group_coordinator=auto on Cloud TPU, where JAX finds the slice's hosts itself).
A config whose groups need more devices than the process sees is refused in one line naming
the launcher (experiments/startup.py); on Cloud TPU, experiments.launch_tpu starts every process.

Bad input (unknown config key, impossible device layout, missing data) prints one line
starting with `error:` and exits with status 2 before anything is written. A run that
diverges (run/monitor.py) says so at once, stops, and exits with status 3.
"""

import logging as py_logging
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from experiments import cli
from experiments import startup

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py",
                                          "Experiment config file (a configs/*.py with get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Where metrics.jsonl, TensorBoard events and checkpoints go: a "
    "local directory or gs://BUCKET/PATH (docs/storage.md).")
flags.mark_flag_as_required("workdir")
_ROLE = flags.DEFINE_enum(
    "role", "local", ["local", "syncer", "learner", "evaluator"],
    "local: the whole run in this process (config.runtime); syncer / learner / evaluator: "
    "one process of a networked run (runtime 'service'; evaluator: with "
    "service.evaluate_on='evaluator').")
_LEARNER_ID = flags.DEFINE_integer("learner_id", None, "Learner group this process trains (--role=learner).")
_SYNCER = flags.DEFINE_string(
    "syncer", None, "host:port of the syncer service (--role=learner, --role=evaluator); "
    "with service.shards = S, S of them comma-separated, shard 0's first.")
_SHARD = flags.DEFINE_integer("shard", None,
                              "Syncer shard this process serves (--role=syncer with service.shards > 1).")
_GROUP_COORDINATOR = flags.DEFINE_string(
    "group_coordinator", startup.from_env("coordinator", ""), "--role=learner in a multi-process group: HOST:PORT "
    "of the group's process 0 (JAX's coordinator), or 'auto' on Cloud TPU / GKE; '' = this process is the whole "
    "group. Default: $DD_GROUP_COORDINATOR.")
_GROUP_PROCESSES = flags.DEFINE_integer(
    "group_processes", startup.from_env("processes", 1), "Processes of this "
    "learner group (with --group_coordinator=HOST:PORT); they split its devices "
    "evenly. Default: $DD_GROUP_PROCESSES or 1.")
_GROUP_PROCESS_ID = flags.DEFINE_integer(
    "group_process_id", startup.from_env("process_id", 0), "This process's "
    "index in its group, 0..N-1. Default: $DD_GROUP_PROCESS_ID or 0.")


def load_config():
  """The parsed --config; a config file that does not load is bad input, not a crash."""
  return cli.load_config(_CONFIG)


def quiet_library_logs() -> None:
  """Keeps progress lines readable: orbax logs every file it writes at INFO."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname)


def main(argv: list[str]) -> None:
  """Builds the experiment from the config and runs it under the configured runtime."""
  del argv
  quiet_library_logs()
  config = load_config()
  from decoupled_diloco import storage  # pylint: disable=g-import-not-at-top
  try:
    storage.path(_WORKDIR.value)  # A workdir the file-system layer cannot open is refused before any work.
  except ValueError as error:
    cli.fail(error)
  # Virtual CPU devices must be requested before JAX's CPU backend starts; on TPU
  # hosts this only sizes the (unused) CPU backend.
  try:
    jax.config.update(
        "jax_num_cpu_devices",
        startup.process_devices(tuple(config.learners.devices), _ROLE.value, _LEARNER_ID.value,
                                _GROUP_COORDINATOR.value, _GROUP_PROCESSES.value, config.service.evaluator_devices))
  except ValueError as error:  # ConfigError: a group's devices that its processes do not split.
    cli.fail(error)
  # Imported here so that `--help` and flag errors stay fast.
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import lockstep, sim, threads  # pylint: disable=g-import-not-at-top

  if _ROLE.value != "local":
    _run_service_role(config)
    return
  if config.runtime == "service":
    cli.fail("runtime 'service' runs as separate processes: start them with --role=syncer and --role=learner, "
             "all at once on this machine with python -m experiments.launch_local, or on Cloud TPU slices with "
             "python -m experiments.launch_tpu up/start")
  try:
    startup.check_devices(tuple(config.learners.devices), "local", None)
    exp = experiment.build(config)
    logging.info(
        "%s: %d learner group(s) on %s devices, data %s, tokenizer %s; outer %s (buffer %d), quorum %d, "
        "policy %s", config.mode, len(exp.learners), tuple(config.learners.devices), exp.corpus.name,
        exp.corpus.tokenizer.name, config.outer.optimizer, config.outer.buffer_size, config.syncer.quorum,
        config.policy.kind)
    try:
      summary = {"lockstep": lockstep, "sim": sim, "threads": threads}[config.runtime].run(exp, _WORKDIR.value)
    finally:
      for learner in exp.learners:  # Stops the data pipelines' prefetch threads before the interpreter exits.
        learner.batches.close()
  except ConfigError as error:
    cli.fail(error)
  if summary["eval_loss"] is None:
    print(f"nothing to do: the run in {_WORKDIR.value} is already at outer step {config.outer_steps}")
    return
  message = f"final eval loss {summary['eval_loss']:.4f}"
  if summary["optimal_loss"] is not None:
    message += f" (optimum {summary['optimal_loss']:.4f}, gap {summary['eval_loss'] - summary['optimal_loss']:.4f})"
  if summary.get("virtual_seconds") is not None:
    message += (f"; virtual time {summary['virtual_seconds']:.1f}s, goodput {summary['goodput']:.3f}, "
                f"{summary['outer_updates']} outer updates, steps per learner {summary['steps']}, "
                f"idle fraction per learner {summary['idle_fraction']}")
  _report(message, summary)


def _report(message: str, summary: dict) -> None:
  """Prints the run's last line; a diverged run says so and exits DIVERGED_EXIT_STATUS (docs/usage.md)."""
  from decoupled_diloco.run import monitor  # pylint: disable=g-import-not-at-top
  if summary.get("diverged"):
    message = f"DIVERGED: {message}"
  logging.info(message)
  print(message, flush=True)
  if summary.get("diverged"):
    sys.exit(monitor.DIVERGED_EXIT_STATUS)


def _run_service_role(config) -> None:
  """One process of a networked run: the syncer service, learner --learner_id, or the evaluator."""
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import evaluator_main, learner_main, syncer_main  # pylint: disable=g-import-not-at-top

  config.runtime = "service"
  try:
    experiment.validate(config)
    if _ROLE.value == "syncer":
      summary = syncer_main.run(config, _WORKDIR.value, _SHARD.value)
      message = (f"syncer: {summary['outer_updates']} outer updates, {summary['steps_done']} inner steps, "
                 f"final eval loss {summary['eval_loss']}" if summary["done"] else "syncer stopped (SIGTERM); "
                 "restart it with --config.resume=True to continue")
    elif _ROLE.value == "evaluator":
      if not _SYNCER.value:
        raise ConfigError("--role=evaluator needs --syncer=HOST:PORT")
      summary = evaluator_main.run(config, _WORKDIR.value, _SYNCER.value)
      message = f"evaluator: Θ version {summary['evaluated_version']}, final eval loss {summary['eval_loss']}"
    else:
      if _LEARNER_ID.value is None or not _SYNCER.value:
        raise ConfigError("--role=learner needs --learner_id=I and --syncer=HOST:PORT")
      from decoupled_diloco.service import group  # pylint: disable=g-import-not-at-top
      group.initialize(_GROUP_COORDINATOR.value, _GROUP_PROCESSES.value, _GROUP_PROCESS_ID.value)
      startup.check_devices(tuple(config.learners.devices), "learner", _LEARNER_ID.value)
      summary = learner_main.run(config, _WORKDIR.value, _LEARNER_ID.value, _SYNCER.value)
      message = (f"learner {summary['learner']}: {summary['steps']} steps, blocked "
                 f"{100 * summary['blocked_fraction']:.2f}% of {summary['wall_seconds']:.1f}s")
  except ConfigError as error:
    cli.fail(error)
  except ConnectionError as error:  # SyncerUnreachable: retried for service.retry_seconds already.
    sys.stderr.write(f"error: {error}\n")
    sys.exit(1)
  _report(message, summary)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

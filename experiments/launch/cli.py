"""The launch_tpu command line: flags, the dry run, and running the planned steps."""

import functools
import os
import secrets
import shlex
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco.errors import ConfigError
from experiments.launch.deploy import plan
from experiments.launch.hosts import EXAMPLE, SYNCER_IP, Host, Step, parse_slices
from experiments.launch.options import Options, check

def define_flags() -> dict:
  """The CLI's absl flags. Defined only when run as a program, so that tests (and other tools)
  import the planner without claiming flag names such as --config."""
  return {
      "config": config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config file.",
                                                lock_config=True),
      "slices": flags.DEFINE_string("slices", "", f"One slice per learner group: TYPE-SIZE@ZONE,..., {EXAMPLE}."),
      "project": flags.DEFINE_string("project", "", "Google Cloud project."),
      "run_name": flags.DEFINE_string("run_name", "dd-run", "Names the slices (<run_name>-<i>) and the remote "
                                      "directory ~/dd/<run_name>."),
      "dry_run": flags.DEFINE_bool("dry_run", False, "Print every command, run nothing."),
      "reuse": flags.DEFINE_bool("reuse", False, "The slices (and syncer VM) exist already: skip creating them."),
      "syncer_vm": flags.DEFINE_string("syncer_vm", "", "NAME@ZONE of a CPU VM for the syncer ('' = worker 0 of "
                                       "slice 0)."),
      "syncer_machine_type": flags.DEFINE_string("syncer_machine_type", "e2-standard-8",
                                                 "Machine type of --syncer_vm."),
      "port": flags.DEFINE_integer("port", 50051, "Port the syncer serves gRPC on; its data channel takes port + 1."),
      "syncer_address": flags.DEFINE_string("syncer_address", "", "Syncer host learners dial ('' = its internal IP)."),
      "workdir": flags.DEFINE_string("workdir", "", "Workdir of every process, e.g. gs://BUCKET/run ('' = "
                                     "~/dd/<run_name>/work on each host)."),
      "token_file": flags.DEFINE_string("token_file", "", "Local file holding the shared token ('' = "
                                        "~/.config/decoupled_diloco/<run_name>.token, created 0600 if missing)."),
      "token_secret": flags.DEFINE_string("token_secret", "", "Secret Manager secret holding the token, fetched on "
                                          "each host instead of copying a file."),
      "tls_cert": flags.DEFINE_string("tls_cert", "", "Local PEM certificate of the syncer (TLS; learners trust it)."),
      "tls_key": flags.DEFINE_string("tls_key", "", "Local PEM private key of the syncer."),
      "version": flags.DEFINE_string("version", "", "TPU software version ('' = the usual one per slice type)."),
      "spot": flags.DEFINE_bool("spot", False, "Create Spot slices."),
      "insecure": flags.DEFINE_bool("insecure", False, "Serve without TLS: credentials and parameters cross the "
                                    "network in clear. Only for networks you trust entirely."),
  }


def fail(message: str) -> None:
  """Bad input: one line on stderr, exit status 2, nothing created."""
  sys.stderr.write(f"error: {' '.join(str(message).split())}\n")
  sys.exit(2)


def default_token_file(run_name: str) -> str:
  """Where a run's token lives on this machine unless --token_file names one."""
  return os.path.join(os.path.expanduser("~"), ".config", "decoupled_diloco", f"{run_name}.token")


def ensure_token_file(path: str) -> None:
  """Creates a fresh random token readable by this user only, unless the file exists (reruns keep it)."""
  if os.path.exists(path):
    return
  os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
  descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(descriptor, "w", encoding="utf-8") as f:
    f.write(secrets.token_hex(32) + "\n")


def execute(steps: list[Step]) -> None:
  """Runs the steps in order, feeding captured values (the syncer's IP) into later commands."""
  values = {}
  for step in steps:
    argv = [arg.replace(SYNCER_IP, values.get(SYNCER_IP, SYNCER_IP)) for arg in step.argv]
    print(f"# {step.what}", flush=True)
    result = subprocess.run(argv, check=False, text=True, stdout=subprocess.PIPE if step.captures else None)
    if result.returncode:
      sys.stderr.write(f"error: '{step.what}' failed with exit status {result.returncode}: {shlex.join(argv)}\n")
      sys.exit(1)
    if step.captures:
      values[step.captures] = result.stdout.strip()
      if not values[step.captures]:
        sys.stderr.write(f"error: '{step.what}' printed nothing: is the host up? {shlex.join(argv)}\n")
        sys.exit(1)
      print(f"# {step.captures} = {values[step.captures]}", flush=True)


def options_from_flags(f: dict, argv: list[str]) -> Options:
  """The flags as Options; `--config.*` overrides in `argv` are passed on verbatim to every process."""
  token_file = ""
  if not f["token_secret"].value:
    token_file = f["token_file"].value or default_token_file(f["run_name"].value)
    if f["token_file"].value and not os.path.isfile(token_file):
      raise ConfigError(f"--token_file {token_file!r} does not exist: point it at a file holding the token "
                        "(or leave it out to generate one)")
  return Options(config_flags.get_config_filename(flags.FLAGS["config"]),
                 tuple(a for a in argv[1:] if a.startswith("--config.")), tuple(parse_slices(f["slices"].value)),
                 f["project"].value, f["run_name"].value, f["reuse"].value, f["syncer_vm"].value,
                 f["syncer_machine_type"].value, f["port"].value, f["syncer_address"].value, f["workdir"].value,
                 token_file, f["token_secret"].value, f["tls_cert"].value, f["tls_key"].value, f["version"].value,
                 f["spot"].value, os.path.join(tempfile.gettempdir(), f"{f['run_name'].value}_src.tar.gz"),
                 f["insecure"].value, os.path.join(os.path.dirname(default_token_file(f["run_name"].value)),
                                                   f["run_name"].value))


def main(f: dict, argv: list[str]) -> None:
  """Checks the slices and the config locally, then prints (--dry_run) or runs every command."""
  del argv
  try:
    options = options_from_flags(f, sys.argv)
    config = f["config"].value
    # Imported after the cheap checks, so that a bad --slices fails fast.
    from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top
    from decoupled_diloco.service import runconfig  # pylint: disable=g-import-not-at-top
    config.runtime = "service"  # What experiments.train --role=... runs.
    experiment.validate(config)
    runconfig.validate(config)
    check(options, tuple(config.learners.devices))
    steps = plan(options)
  except ConfigError as error:
    fail(error)
  if options.insecure:
    sys.stderr.write("WARNING: --insecure: the syncer serves PLAINTEXT on every interface; learner credentials, "
                     "the run secret's uses and all parameters cross the network unencrypted.\n")
  if f["dry_run"].value:
    for step in steps:
      print(f"# {step.what}" + (f" (prints {step.captures})" if step.captures else ""))
      print(shlex.join(step.argv))
  else:
    if options.token_file:
      ensure_token_file(options.token_file)
    os.makedirs(options.local_dir, mode=0o700, exist_ok=True)
    execute(steps)
  first = Host(f"{options.run_name}-0", options.slices[0].zone, worker="0")
  print(f"# logs: {shlex.join(first.ssh(options.project, 'tail -f dd/' + options.run_name + '/learner_0.log'))}")
  for i, tpu in enumerate(options.slices):
    print(f"# tear down: gcloud compute tpus tpu-vm delete {options.run_name}-{i} --zone={tpu.zone} "
          f"--project={options.project} --quiet")
  if options.syncer_vm:
    name, zone = options.syncer_vm.split("@")
    print(f"# tear down: gcloud compute instances delete {name} --zone={zone} --project={options.project} --quiet")


def run() -> None:
  """The program: flags are defined only here, so importing the launcher claims no flag names."""
  app.run(functools.partial(main, define_flags()))

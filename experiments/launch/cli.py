"""The launch_tpu command line: flags, the dry run, and running the planned steps."""

import dataclasses
import functools
import os
import secrets
import shutil
import sys
import tempfile

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco.errors import ConfigError
from experiments.cli import fail, parse_flags
from experiments.launch import deploy, provision, runner, watch, xpk
from experiments.launch import options as options_lib
from experiments.launch.hosts import EXAMPLE, Slice, Step, parse_slices
from experiments.launch.options import Options, check

VERBS = ("up", "start", "status", "watch", "logs", "down")
STEPPED = ("launch", "up", "start", "logs", "down")  # The verbs that are a list of steps.


def define_flags() -> dict:
  """The CLI's absl flags. Defined only when run as a program, so that tests (and other tools)
  import the planner without claiming flag names such as --config."""
  return {
      "config": config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config file.",
                                                lock_config=True),
      "slices": flags.DEFINE_string("slices", "", f"One slice per learner group: TYPE-SIZE@ZONE,..., {EXAMPLE}."),
      "project": flags.DEFINE_string("project", "", "Google Cloud project."),
      "run_name": flags.DEFINE_string(
          "run_name", "dd-run", "Names the slices (<run_name>-<i>), the syncer VM "
          "(<run_name>-syncer) and the remote directory ~/dd/<run_name>."),
      "dry_run": flags.DEFINE_bool("dry_run", False, "Print every command, run nothing."),
      "reuse": flags.DEFINE_bool("reuse", False, "Without a verb: the slices and the syncer VM exist already, skip "
                                 "`up`."),
      "syncer_vm": flags.DEFINE_string(
          "syncer_vm", "", "NAME@ZONE of the syncer's CPU VM ('' = <run_name>-syncer "
          "in slice 0's zone)."),
      "syncer_on_slice": flags.DEFINE_bool(
          "syncer_on_slice", False, "Run the syncer on worker 0 of slice 0 (off "
          "its TPU, sharing its host) instead of its own CPU VM."),
      "syncer_machine_type": flags.DEFINE_string(
          "syncer_machine_type", "", "Machine type of the syncer VM ('' = "
          "the smallest n2-highmem holding the plan's syncer host bytes)."),
      "port": flags.DEFINE_integer("port", 50051, "Port the syncer serves gRPC on; its data channel takes port + 1."),
      "syncer_address": flags.DEFINE_string("syncer_address", "", "Syncer host learners dial ('' = its internal IP)."),
      "workdir": flags.DEFINE_string(
          "workdir", "", "Workdir of every process, gs://BUCKET/PATH ('' = "
          "gs://<project>-decoupled-diloco/<run_name>, a bucket `up` creates)."),
      "token_file": flags.DEFINE_string(
          "token_file", "", "Local file holding the shared token ('' = "
          "~/.config/decoupled_diloco/<run_name>.token, created 0600 if missing)."),
      "token_secret": flags.DEFINE_string(
          "token_secret", "", "Secret Manager secret holding the token, fetched on "
          "each host instead of copying a file."),
      "tls_cert": flags.DEFINE_string("tls_cert", "", "Local PEM certificate of the syncer (TLS; learners trust it)."),
      "tls_key": flags.DEFINE_string("tls_key", "", "Local PEM private key of the syncer."),
      "version": flags.DEFINE_string("version", "", "TPU software version ('' = hardware.ACCELERATORS' per type)."),
      "spot": flags.DEFINE_bool("spot", False, "Create Spot slices (preemptible; `watch` brings them back)."),
      "queued": flags.DEFINE_bool("queued", False, "Create the slices as queued resources, waiting until granted."),
      "insecure": flags.DEFINE_bool(
          "insecure", False, "Serve without TLS: credentials and parameters cross the "
          "network in clear. Only for networks you trust entirely."),
      "xpk_cluster": flags.DEFINE_string(
          "xpk_cluster", "", "Run the learner slices as XPK workloads on GKE "
          "clusters <xpk_cluster>-<type> ('' = TPU VMs)."),
      "image": flags.DEFINE_string(
          "image", "", "Container image of the XPK mode ('' = "
          "gcr.io/<project>/decoupled-diloco:<run_name>)."),
      "evaluator_slice": flags.DEFINE_string(
          "evaluator_slice", "", "TYPE-SIZE@ZONE of the evaluator's single-host "
          "slice <run_name>-eval (service.evaluate_on='evaluator'; '' = slice "
          "0's type and zone sized to service.evaluator_devices)."),
      "watch_seconds": flags.DEFINE_float("watch_seconds", 60.0, "`watch`: seconds between two looks at the slices."),
      "watch_rounds": flags.DEFINE_integer("watch_rounds", 0, "`watch`: looks before it exits (0 = until stopped)."),
      "lines": flags.DEFINE_integer("lines", 50, "`logs`: lines of each process's log."),}


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


def options_from_flags(f: dict, argv: list[str], verb: str) -> Options:
  """The flags (and what the config decides: the syncer VM's size, the data, the extras) as checked Options;
  `--config.*` overrides in `argv` are passed on verbatim to every process."""
  token_file = ""
  if not f["token_secret"].value:
    token_file = f["token_file"].value or default_token_file(f["run_name"].value)
    if f["token_file"].value and not os.path.isfile(token_file):
      raise ConfigError(f"--token_file {token_file!r} does not exist: point it at a file holding the token "
                        "(or leave it out to generate one)")
  run = f["run_name"].value
  config = f["config"].value
  # Imported after the cheap checks, so that a bad --slices fails fast.
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top
  config.runtime = "service"  # What experiments.train --role=... runs.
  experiment.validate(config)  # The service group too.
  options = Options(
      config_flags.get_config_filename(flags.FLAGS["config"]), tuple(a for a in argv[1:] if a.startswith("--config.")),
      tuple(parse_slices(f["slices"].value)), f["project"].value, run, reuse=f["reuse"].value,
      syncer_vm=f["syncer_vm"].value, port=f["port"].value, syncer_address=f["syncer_address"].value,
      workdir=f["workdir"].value, token_file=token_file, token_secret=f["token_secret"].value,
      tls_cert=f["tls_cert"].value, tls_key=f["tls_key"].value, version=f["version"].value, spot=f["spot"].value,
      archive=os.path.join(tempfile.gettempdir(), f"{run}_src.tar.gz"), insecure=f["insecure"].value,
      local_dir=os.path.join(os.path.dirname(default_token_file(run)),
                             run), syncer_on_slice=f["syncer_on_slice"].value, queued=f["queued"].value,
      xpk_cluster=f["xpk_cluster"].value, image=f["image"].value, syncer_shards=config.service.shards,
      **_data(config.data), evaluator_slice=_evaluator_slice(f["evaluator_slice"].value, config.service,
                                                             parse_slices(f["slices"].value)))
  check(options, tuple(config.learners.devices), tuple(config.learners.hardware or ()))
  if options.xpk_cluster:
    xpk.check(options)
    if verb == "watch":
      raise ConfigError("watch is for TPU VMs: XPK restarts a preempted workload itself (--max-restarts)")
  if verb in ("up", "launch") and not options.syncer_on_slice:
    from decoupled_diloco import plan as plan_lib  # pylint: disable=g-import-not-at-top  (builds abstract params)
    machine = f["syncer_machine_type"].value or provision.syncer_machine_type(plan_lib.syncer_bytes(config))
    options = dataclasses.replace(options, machine_type=machine)
  return options


def _evaluator_slice(spec: str, service_cfg, slices: list) -> Slice | None:
  """The evaluator's slice: --evaluator_slice, or slice 0's type and zone with service.evaluator_devices chips;
  None unless service.evaluate_on='evaluator'. ConfigError when the two disagree or neither sizes it."""
  if service_cfg.evaluate_on != "evaluator":
    if spec:
      raise ConfigError(f"--evaluator_slice={spec} but service.evaluate_on={service_cfg.evaluate_on!r}: set "
                        "--config.service.evaluate_on=evaluator, or drop --evaluator_slice")
    return None
  chips = service_cfg.evaluator_devices
  if spec:
    tpus = parse_slices(spec)
    if len(tpus) != 1:
      raise ConfigError(f"--evaluator_slice={spec}: give one TYPE-SIZE@ZONE, the evaluator's single-host slice")
    tpu = tpus[0]
    if chips and tpu.chips != chips:
      raise ConfigError(f"--evaluator_slice={spec} has {tpu.chips} chips but service.evaluator_devices={chips}: "
                        "make them agree")
    return tpu
  if not chips:
    raise ConfigError("service.evaluate_on='evaluator' needs a slice for the evaluator: pass --evaluator_slice="
                      "TYPE-SIZE@ZONE (one host), or set --config.service.evaluator_devices to its chips")
  return Slice(slices[0].generation, chips * slices[0].spec.cores_per_chip, slices[0].zone)


def _data(data_cfg) -> dict:
  """Options of the run's data: a TFDS set is prepared once into the bucket (or data.tfds_data_dir on GCS);
  other sources are read where data.path says, which every host must see (gs://, or a mount on each)."""
  if data_cfg.source != "tfds":
    return {"extras": "tfds" if data_cfg.source == "array_record" else "", **_tokenizer(data_cfg)}
  if data_cfg.tfds_data_dir and not data_cfg.tfds_data_dir.startswith("gs://"):
    raise ConfigError(f"data.tfds_data_dir={data_cfg.tfds_data_dir!r} is not on GCS: the syncer's VM prepares the "
                      "data there once for every host, point it at gs://BUCKET/tfds (or leave it empty)")
  return {"tfds_name": data_cfg.tfds_name, "data_dir": data_cfg.tfds_data_dir, "extras": "tfds", **_tokenizer(data_cfg)}


def _tokenizer(data_cfg) -> dict:
  """The SentencePiece model every process reads, a file on this machine (validate loaded it): shipped to each host."""
  if data_cfg.tokenizer != "sentencepiece":
    return {}
  return {"tokenizer_path": os.path.expanduser(data_cfg.tokenizer_path)}


def plan(options: Options, verb: str = "launch", lines: int = 50) -> list[Step]:
  """The steps of `verb` ('launch' = up, unless --reuse, then start); pure, so a dry run prints what a run runs."""
  if verb == "launch":
    return ([] if options.reuse else provision.up(options)) + deploy.start(options)
  if verb == "logs":
    return watch.logs(options, lines)
  return {"up": provision.up, "start": deploy.start, "down": provision.down}[verb](options)


def main(f: dict, argv: list[str]) -> None:
  """Checks the verb, the slices and the config locally, then prints (--dry_run) or runs the verb's commands."""
  verb = argv[1] if len(argv) > 1 else "launch"
  if verb not in (*VERBS, "launch") or len(argv) > 2:
    fail(f"unknown verb {' '.join(argv[1:])!r}: use one of {', '.join(VERBS)} (none = up, then start)")
  try:
    options = options_from_flags(f, sys.argv, verb)
    steps = plan(options, verb, f["lines"].value) if verb in STEPPED else []
  except ConfigError as error:
    fail(error)
  if options.insecure and verb in ("start", "launch"):
    sys.stderr.write("WARNING: --insecure: the syncer serves PLAINTEXT on every interface; learner credentials, "
                     "the run secret's uses and all parameters cross the network unencrypted.\n")
  dry = f["dry_run"].value
  xpk_verb = options.xpk_cluster and verb in ("up", "start", "launch", "down")
  tools = ("gcloud", "xpk", "docker") if xpk_verb else ("gcloud",)
  missing = [tool for tool in tools if not dry and shutil.which(tool) is None]
  if missing:
    fail(f"{', '.join(missing)} not found on PATH: install the Google Cloud CLI (and pip install xpk, Docker for "
         "--xpk_cluster), or pass --dry_run to print the commands")
  if verb == "watch" and not dry and options.token_file and not os.path.isfile(options.token_file):
    fail(f"{options.token_file} does not exist: watch restarts learners with the credentials `start` made from it "
         "(pass the same --token_file or --token_secret as start)")
  if verb == "watch" and not dry and options.tls == "generated" and not os.path.isfile(options_lib.ca_file(options)):
    fail(f"{options_lib.ca_file(options)} does not exist: watch gives restarted learners the CA `start` made; "
         "run start first (with the same --run_name)")
  if verb in ("start", "launch", "watch") and not dry:
    if options.token_file:
      ensure_token_file(options.token_file)
    os.makedirs(options.local_dir, mode=0o700, exist_ok=True)
  if verb == "watch" and dry:
    watch.dry_run(options, f["watch_seconds"].value)
  elif verb == "watch":
    watch.watch(options, f["watch_rounds"].value, f["watch_seconds"].value)
  elif verb == "status":
    status = watch.status_steps(options)
    if dry:
      runner.dry_run(status)
    else:
      print(watch.status_table(options, {s.captures: runner.probe(s.argv)[1] for s in status}))
  elif dry:
    runner.dry_run(steps)
  else:
    runner.execute(steps)
  if verb in ("start", "launch"):
    print("# then: python -m experiments.launch_tpu status|watch|logs|down with the same flags")


def run() -> None:
  """The program: flags are defined only here, so importing the launcher claims no flag names."""
  app.run(functools.partial(main, define_flags()), flags_parser=parse_flags)

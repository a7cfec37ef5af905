"""The launcher's options (its flags, parsed), the checks that refuse a plan before anything is created, and the
experiments.train arguments they imply for every process (the same on TPU VMs and in XPK pods)."""

import dataclasses
import os
import re
import shlex

from decoupled_diloco.errors import ConfigError
from experiments.launch.hosts import NAME, ZONE, Host, Slice

CONFIG, TOKENIZER = "config.py", "tokenizer.model"  # The shipped copies' names in a host's run directory.


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything the plan depends on (the flags, parsed)."""
  config_path: str
  overrides: tuple[str, ...]
  slices: tuple[Slice, ...]
  project: str
  run_name: str
  reuse: bool = False
  syncer_vm: str = ""  # NAME@ZONE of the syncer's CPU VM ('' = <run_name>-syncer in slice 0's zone).
  machine_type: str = "n2-highmem-4"  # The syncer VM's; the CLI sizes it from the plan's syncer host bytes.
  port: int = 50051
  syncer_address: str = ""
  workdir: str = ""  # '' = gs://<project>-decoupled-diloco/<run_name>, a bucket `up` creates if missing.
  token_file: str = ""
  token_secret: str = ""
  tls_cert: str = ""
  tls_key: str = ""
  version: str = ""
  spot: bool = False
  archive: str = "/tmp/dd_src.tar.gz"
  insecure: bool = False
  local_dir: str = "/tmp/dd_run"  # This machine's files of the run: learner credentials, tls/.
  syncer_on_slice: bool = False  # The syncer on worker 0 of slice 0 (off its TPU) instead of its own CPU VM.
  queued: bool = False  # Slices through queued resources (capacity granted when available).
  tfds_name: str = ""  # data.tfds_name when data.source='tfds': prepared once into data_dir by `start`.
  data_dir: str = ""  # TFDS data_dir every process reads ('' = <bucket>/tfds).
  extras: str = ""  # setup.py extras the hosts install ('tfds' for TFDS / ArrayRecord data).
  xpk_cluster: str = ""  # GKE cluster of an XPK launch of the learner slices ('' = TPU VMs over gcloud).
  image: str = ""  # Container image of an XPK launch ('' = gcr.io/<project>/decoupled-diloco:<run_name>).
  evaluator_slice: Slice | None = None  # The evaluator's slice (service.evaluate_on='evaluator'), <run_name>-eval.
  syncer_shards: int = 1  # config.service.shards: syncer processes on the syncer's host, gRPC on port + s.
  tokenizer_path: str = ""  # data.tokenizer_path when it is a file on this machine: shipped to every host.

  @property
  def tls(self) -> str:
    """'given' (--tls_cert), 'generated' (the default) or 'none' (--insecure)."""
    return "given" if self.tls_cert else "none" if self.insecure else "generated"

  @property
  def run_workdir(self) -> str:
    """The workdir every process shares (metrics, checkpoints, learner_<i>/): on GCS."""
    return self.workdir or f"gs://{self.project}-decoupled-diloco/{self.run_name}"

  @property
  def bucket(self) -> str:
    """gs://BUCKET of the workdir."""
    return "/".join(self.run_workdir.split("/")[:3])

  @property
  def tfds_dir(self) -> str:
    """Where the TFDS data is prepared once and read by every host."""
    return self.data_dir or f"{self.bucket}/tfds"

  @property
  def remote(self) -> str:
    """Each host's directory of the run (src/, venv/, credentials, logs), as a shell word."""
    return f'"$HOME/dd/{self.run_name}"'

  def slice_hosts(self) -> list[Host]:
    """Every worker of each slice, named <run_name>-<i>: learner group i runs there."""
    return [Host(f"{self.run_name}-{i}", s.zone) for i, s in enumerate(self.slices)]

  def evaluator_host(self) -> Host | None:
    """The evaluator's single-host slice, <run_name>-eval (None: the config evaluates elsewhere or not at all)."""
    return Host(f"{self.run_name}-eval", self.evaluator_slice.zone) if self.evaluator_slice else None

  def tpus(self) -> list[tuple[Host, Slice]]:
    """Every TPU slice `up` creates and `down` deletes: the learners' (index = learner), then the evaluator's."""
    hosts = self.slice_hosts() + ([self.evaluator_host()] if self.evaluator_slice else [])
    return list(zip(hosts, (*self.slices, *([self.evaluator_slice] if self.evaluator_slice else []))))

  def syncer(self) -> Host:
    """The syncer's host: its own CPU VM, or worker 0 of slice 0 with --syncer_on_slice."""
    if self.syncer_on_slice:
      return Host(f"{self.run_name}-0", self.slices[0].zone, worker="0")
    name, zone = (self.syncer_vm or f"{self.run_name}-syncer@{self.slices[0].zone}").split("@")
    return Host(name, zone, tpu=False)


def check(options: Options, learner_groups: tuple[int, ...], hardware: tuple[str, ...] = ()) -> None:
  """Rejects plans that cannot work, before anything is created; `learner_groups` = learners.devices,
  `hardware` = learners.hardware (the chips the plan and the virtual clock assume, one per group)."""
  if not options.project:
    raise ConfigError("--project is required: the Google Cloud project that gets the slices")
  if not NAME.fullmatch(options.run_name):
    raise ConfigError(f"--run_name={options.run_name!r}: use lowercase letters, digits and hyphens, starting "
                      "with a letter (at most 47 characters)")
  if len(options.slices) != len(learner_groups):
    raise ConfigError(f"--slices lists {len(options.slices)} slices but the config has {len(learner_groups)} "
                      "learner groups: give one slice per group (or set --config.learners.devices)")
  for i, (tpu, devices) in enumerate(zip(options.slices, learner_groups)):
    if tpu.chips != devices:
      raise ConfigError(f"slice {i} ({tpu.accelerator}) has {tpu.chips} chips but learners.devices[{i}]={devices}: "
                        f"pass --config.learners.devices with {tpu.chips} for it")
    if i < len(hardware) and hardware[i] != tpu.chip:
      raise ConfigError(f"slice {i} ({tpu.accelerator}) has {tpu.chip} chips but learners.hardware[{i}]="
                        f"{hardware[i]!r}: list the slices in the order of learners.hardware")
  top = 65535 - 2 * options.syncer_shards + 1
  if not 1 <= options.port <= top:
    raise ConfigError(f"--port={options.port} must be in [1, {top}] (the {options.syncer_shards} syncer shard(s) take "
                      f"ports port .. port + {2 * options.syncer_shards - 1}: gRPC, then data channels)")
  if options.syncer_vm and not re.fullmatch(rf"{NAME.pattern}@{ZONE.pattern}", options.syncer_vm):
    raise ConfigError(f"--syncer_vm={options.syncer_vm!r}: expected NAME@ZONE, e.g. dd-syncer@us-central1-a")
  if options.evaluator_slice and options.xpk_cluster:
    raise ConfigError("the evaluator runs on a TPU VM slice, not in XPK: launch without --xpk_cluster, or set "
                      "--config.service.evaluate_on=none")
  if options.syncer_vm and options.syncer_on_slice:
    raise ConfigError("--syncer_vm and --syncer_on_slice contradict each other: pick one place for the syncer")
  if not options.run_workdir.startswith("gs://") or len(options.run_workdir.split("/")) < 4:
    raise ConfigError(f"--workdir={options.workdir!r}: every host must see the run's workdir: use gs://BUCKET/PATH")
  if options.insecure and options.tls_cert:
    raise ConfigError("--insecure and --tls_cert contradict each other: drop --insecure to serve TLS")
  if bool(options.tls_cert) != bool(options.tls_key):
    raise ConfigError("TLS needs both --tls_cert and --tls_key (the syncer's certificate and private key)")
  for path in (options.tls_cert, options.tls_key):
    if path and not os.path.isfile(path):
      raise ConfigError(f"{path!r} does not exist: point --tls_cert/--tls_key at PEM files")


def repo() -> str:
  """This checkout's root, which `start` packs and uploads."""
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ca_file(o: Options) -> str:
  """The run's CA certificate on this machine."""
  return os.path.join(o.local_dir, "tls", "ca.pem")


def fetch_secret(o: Options) -> str:
  """The shell command printing the run secret from Secret Manager (--token_secret), on whichever host runs it."""
  return (f"gcloud secrets versions access latest --secret={shlex.quote(o.token_secret)} "
          f"--project={shlex.quote(o.project)}")


def shipped(o: Options) -> list[tuple[str, str, str]]:
  """(what, this machine's path, name in a host's run directory) of every file each process reads besides the code:
  the config file (it may live outside the packed checkout) and a SentencePiece model. Hosts get them by scp (XPK
  pods from the bucket) and processes are pointed at those copies, never at a path of this machine."""
  files = [("the config", o.config_path, CONFIG)]
  return files + ([("the tokenizer", o.tokenizer_path, TOKENIZER)] if o.tokenizer_path else [])


def train_args(o: Options, home: str = "$D") -> list[str]:
  """What every process of the run gets (shell words; `home` holds the shipped files): the shipped config, the
  overrides, the shipped tokenizer, the GCS workdir and the data."""
  tokenizer = [f"--config.data.tokenizer_path=\"{home}/{TOKENIZER}\""] if o.tokenizer_path else []
  data = [f"--config.data.tfds_data_dir={shlex.quote(o.tfds_dir)}"] if o.tfds_name else []
  return [
      f"--config=\"{home}/{CONFIG}\"", *map(shlex.quote, o.overrides), *tokenizer, *data,
      f"--workdir={shlex.quote(o.run_workdir)}"]


def learner_args(o: Options, index: int, address: str, home: str = "$D") -> list[str]:
  """Learner `index`'s flags on every host of its slice (shell words; `home` holds its CA): --group_coordinator=auto
  makes the slice's hosts one JAX program; with S syncer shards, --syncer lists them, shard 0's first."""
  return ["--role=learner", f"--learner_id={index}", _syncers(o, address), "--group_coordinator=auto", *_trust(o, home)]


def evaluator_args(o: Options, address: str) -> list[str]:
  """The evaluator's flags (shell words): the syncer (every shard), the CA it trusts, and its slice's chips as its
  devices."""
  return [
      "--role=evaluator",
      _syncers(o, address), *_trust(o, "$D"), f"--config.service.evaluator_devices={o.evaluator_slice.chips}"]


def _syncers(o: Options, address: str) -> str:
  """--syncer: the syncer's HOST:PORT, or with S shards every shard's (port + s), shard 0's first."""
  return "--syncer=" + ",".join(f"{shlex.quote(address)}:{o.port + s}" for s in range(o.syncer_shards))


def _trust(o: Options, home: str) -> list[str]:
  """What a process that dials the syncer trusts for its certificate (none with --insecure)."""
  return {
      "given": [f"--config.service.tls_ca=\"{home}/tls.crt\""],
      "generated": [f"--config.service.tls_ca=\"{home}/tls_ca.pem\""], "none": []}[o.tls]

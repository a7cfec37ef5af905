r"""Runs a networked Decoupled DiLoCo job on Cloud TPU VM slices of mixed types (v5p, v6e, ...).

One learner group per slice (all its hosts run the learner process, one multi-host JAX
program), and the syncer service on worker 0 of the first slice (forced onto its CPU) or
on a small CPU VM (--syncer_vm=NAME@ZONE):

  python -m experiments.launch_tpu --config=configs/tpu_1b.py --config.mode=decoupled \
      --slices=v5p-128@us-east5-a,v6e-64@us-east1-d --project=my-project --run_name=dd-1b --dry_run

Steps: create the slices (unless --reuse), upload this checkout and install it in a venv on
every host, deliver the run secret to the syncer's host only and to the hosts of slice i
learner i's own credential (security.learner_credential: derived here from a local 0600
file and copied, or with --token_secret derived on the host from a Secret Manager fetch
that is never stored there), look up the syncer's internal IP, make TLS certificates for
it, start the syncer bound to 0.0.0.0, start learner i on every worker of slice i with
--syncer=IP:PORT (pushes' payloads go to its data channel on PORT + 1). No secret ever
appears on a command line; `--config.*` overrides reach every process. --dry_run prints
each command (one per line, after a `#` line saying what it does) and runs nothing; the
syncer's IP, unknown then, shows as SYNCER_IP.

TLS is on by default: a self-signed CA made once per run on this machine
(~/.config/decoupled_diloco/<run_name>/tls/ca.pem; its key stays here) signs a certificate
naming the syncer's address; learners trust the CA. --tls_cert/--tls_key use your own
certificate instead (it must name the syncer's IP). --insecure serves plaintext, which
sends credentials and parameters in clear over the network: it must be asked for, and the
launcher says so loudly.
"""

import dataclasses
import functools
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco.errors import ConfigError

# TPU type -> (TPU software version for JAX, devices per unit of the type's size).
TPU_TYPES = {"v4": ("tpu-ubuntu2204-base", 0.5), "v5litepod": ("v2-alpha-tpuv5-lite", 1),
             "v5p": ("v2-alpha-tpuv5", 0.5), "v6e": ("v2-alpha-tpuv6e", 1)}
SYNCER_IP = "SYNCER_IP"  # Stands for the address a lookup step prints, until it has run.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,45}[a-z0-9])?")
_ZONE = re.compile(r"[a-z]+-[a-z]+\d+-[a-z]")
_EXAMPLE = "e.g. v5p-32@us-east5-a,v6e-32@us-east1-d"


@dataclasses.dataclass(frozen=True)
class Slice:
  """One TPU slice: its accelerator type (generation-size) and zone."""
  generation: str
  size: int
  zone: str

  @property
  def accelerator(self) -> str:
    """The name gcloud's --accelerator-type takes, e.g. 'v5p-32'."""
    return f"{self.generation}-{self.size}"

  @property
  def chips(self) -> int:
    """JAX devices of the slice (v4/v5p sizes count TensorCores, two per chip)."""
    return int(self.size * TPU_TYPES[self.generation][1])


def parse_slices(spec: str) -> list[Slice]:
  """`v5p-32@us-east5-a,v6e-32@us-east1-d` -> slices; ConfigError naming the bad entry."""
  entries = [e.strip() for e in spec.split(",") if e.strip()]
  if not entries:
    raise ConfigError(f"--slices is empty: list one TYPE-SIZE@ZONE per learner group, {_EXAMPLE}")
  slices = []
  for entry in entries:
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)@(\S+)", entry)
    if not match or match.group(1) not in TPU_TYPES:
      raise ConfigError(f"bad --slices entry {entry!r}: expected TYPE-SIZE@ZONE with TYPE in {tuple(TPU_TYPES)}, "
                        f"{_EXAMPLE}")
    generation, size, zone = match.group(1), int(match.group(2)), match.group(3)
    if not _ZONE.fullmatch(zone):
      raise ConfigError(f"bad zone {zone!r} in --slices entry {entry!r}: expected a zone like us-east5-a")
    if size < 1 or size * TPU_TYPES[generation][1] != int(size * TPU_TYPES[generation][1]):
      raise ConfigError(f"bad size in --slices entry {entry!r}: {generation} sizes count TensorCores, two per "
                        f"chip: use an even size like {generation}-32")
    slices.append(Slice(generation, size, zone))
  return slices


@dataclasses.dataclass(frozen=True)
class Host:
  """Where remote commands run: all workers of a slice, worker 0 of one, or a CPU VM."""
  name: str
  zone: str
  tpu: bool = True
  worker: str = "all"

  def ssh(self, project: str, command: str) -> list[str]:
    """gcloud running the shell `command` on this host (gcloud manages the SSH keys)."""
    if self.tpu:
      return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", self.name, f"--zone={self.zone}",
              f"--project={project}", f"--worker={self.worker}", f"--command={command}"]
    return ["gcloud", "compute", "ssh", self.name, f"--zone={self.zone}", f"--project={project}",
            f"--command={command}"]

  def scp(self, project: str, local: str, remote: str) -> list[str]:
    """gcloud copying a local file to `remote` (relative to the home directory) on this host."""
    if self.tpu:
      return ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{self.name}:{remote}", f"--zone={self.zone}",
              f"--project={project}", f"--worker={self.worker}"]
    return ["gcloud", "compute", "scp", local, f"{self.name}:{remote}", f"--zone={self.zone}", f"--project={project}"]


@dataclasses.dataclass(frozen=True)
class Step:
  """One command; `captures` names what its stdout is (the syncer's IP), if anything."""
  what: str
  argv: tuple[str, ...]
  captures: str = ""


@dataclasses.dataclass(frozen=True)
class Options:
  """Everything the plan depends on (the flags, parsed)."""
  config_path: str
  overrides: tuple[str, ...]
  slices: tuple[Slice, ...]
  project: str
  run_name: str
  reuse: bool = False
  syncer_vm: str = ""
  machine_type: str = "e2-standard-8"
  port: int = 50051
  syncer_address: str = ""
  workdir: str = ""
  token_file: str = ""
  token_secret: str = ""
  tls_cert: str = ""
  tls_key: str = ""
  version: str = ""
  spot: bool = False
  archive: str = "/tmp/dd_src.tar.gz"
  insecure: bool = False
  local_dir: str = "/tmp/dd_run"  # This machine's files of the run: learner credentials, tls/.

  @property
  def tls(self) -> str:
    """'given' (--tls_cert), 'generated' (the default) or 'none' (--insecure)."""
    return "given" if self.tls_cert else "none" if self.insecure else "generated"


def check(options: Options, learner_groups: tuple[int, ...]) -> None:
  """Rejects plans that cannot work, before anything is created; `learner_groups` = learners.devices."""
  if not options.project:
    raise ConfigError("--project is required: the Google Cloud project that gets the slices")
  if not _NAME.fullmatch(options.run_name):
    raise ConfigError(f"--run_name={options.run_name!r}: use lowercase letters, digits and hyphens, starting "
                      "with a letter (at most 47 characters)")
  if len(options.slices) != len(learner_groups):
    raise ConfigError(f"--slices lists {len(options.slices)} slices but the config has {len(learner_groups)} "
                      "learner groups: give one slice per group (or set --config.learners.devices)")
  for i, (tpu, devices) in enumerate(zip(options.slices, learner_groups)):
    if tpu.chips != devices:
      raise ConfigError(f"slice {i} ({tpu.accelerator}) has {tpu.chips} chips but learners.devices[{i}]={devices}: "
                        f"pass --config.learners.devices with {tpu.chips} for it")
  if not 1 <= options.port <= 65534:
    raise ConfigError(f"--port={options.port} must be in [1, 65534] (the data channel takes port + 1)")
  if options.syncer_vm and not re.fullmatch(rf"{_NAME.pattern}@{_ZONE.pattern}", options.syncer_vm):
    raise ConfigError(f"--syncer_vm={options.syncer_vm!r}: expected NAME@ZONE, e.g. dd-syncer@us-central1-a")
  if options.insecure and options.tls_cert:
    raise ConfigError("--insecure and --tls_cert contradict each other: drop --insecure to serve TLS")
  if bool(options.tls_cert) != bool(options.tls_key):
    raise ConfigError("TLS needs both --tls_cert and --tls_key (the syncer's certificate and private key)")
  for path in (options.tls_cert, options.tls_key):
    if path and not os.path.isfile(path):
      raise ConfigError(f"{path!r} does not exist: point --tls_cert/--tls_key at PEM files")


def plan(options: Options) -> list[Step]:
  """Every command of the launch, in order; pure, so a dry run prints exactly what a run runs."""
  o, run = options, options.run_name
  slices = [Host(f"{run}-{i}", s.zone) for i, s in enumerate(o.slices)]
  if o.syncer_vm:
    name, zone = o.syncer_vm.split("@")
    syncer = Host(name, zone, tpu=False)
  else:
    syncer = dataclasses.replace(slices[0], worker="0")
  remote = f'"$HOME/dd/{run}"'  # Each host's directory: src/, venv/, token, logs, work/.
  steps = []
  if not o.reuse:
    for host, tpu in zip(slices, o.slices):
      steps.append(Step(f"create slice {host.name} ({tpu.accelerator})", (
          "gcloud", "compute", "tpus", "tpu-vm", "create", host.name, f"--zone={host.zone}",
          f"--accelerator-type={tpu.accelerator}", f"--version={o.version or TPU_TYPES[tpu.generation][0]}",
          f"--project={o.project}", *(["--spot"] if o.spot else []))))
    if not syncer.tpu:
      steps.append(Step(f"create the syncer VM {syncer.name}", (
          "gcloud", "compute", "instances", "create", syncer.name, f"--zone={syncer.zone}",
          f"--machine-type={o.machine_type}", "--image-family=ubuntu-2204-lts", "--image-project=ubuntu-os-cloud",
          f"--project={o.project}")))
  steps.append(Step("pack this checkout", ("tar", "--exclude=__pycache__", "-czf", o.archive, "-C", _repo(),
                                           "setup.py", "decoupled_diloco", "experiments", "configs")))
  hosts = slices + ([syncer] if not syncer.tpu else [])
  for i, host in enumerate(hosts):
    steps.append(Step(f"make the run directory on {host.name}",
                      tuple(host.ssh(o.project, f"mkdir -p -m 700 {remote}"))))
    steps.append(Step(f"upload the code to {host.name}", tuple(host.scp(o.project, o.archive, f"dd/{run}/src.tar.gz"))))
    if o.tls == "given":  # The syncer serves with it, learners trust it.
      steps.append(Step(f"copy the TLS certificate to {host.name}",
                        tuple(host.scp(o.project, o.tls_cert, f"dd/{run}/tls.crt"))))
    steps.append(Step(f"install into a venv on {host.name}", tuple(host.ssh(o.project, _setup(remote, host.tpu)))))
    if host is not syncer:  # Learner i's credential: it can act as learner i only.
      steps.extend(_credential_steps(o, host, i, remote))
  steps.extend(_secret_steps(o, syncer, remote))
  if o.tls_key:  # The private key goes to the syncer's host only.
    steps.append(Step(f"copy the TLS key to {syncer.name}", tuple(syncer.scp(o.project, o.tls_key,
                                                                             f"dd/{run}/tls.key"))))
  if o.syncer_address:
    address = o.syncer_address
  else:
    address = SYNCER_IP
    steps.append(Step(f"look up the internal IP of {syncer.name}", tuple(_ip_lookup(syncer, o.project)), SYNCER_IP))
  if o.tls == "generated":
    steps.extend(_certificate_steps(o, syncer, hosts, address))
  steps.append(Step(f"start the syncer on {syncer.name} (worker {syncer.worker})" if syncer.tpu else
                    f"start the syncer on {syncer.name}", tuple(syncer.ssh(o.project, _syncer_command(o, remote)))))
  for i, host in enumerate(slices):
    steps.append(Step(f"start learner {i} on every worker of {host.name}",
                      tuple(host.ssh(o.project, _learner_command(o, remote, i, f"{address}:{o.port}")))))
  return steps


def _credential_steps(o: Options, host: Host, index: int, remote: str) -> list[Step]:
  """Learner `index`'s credential into $D/token on `host`: derived here and copied, or derived on the host
  from a Secret Manager fetch piped through (the secret is never stored there)."""
  if o.token_secret:
    derive = (f"D={remote}; umask 077 && cd \"$D/src\" && gcloud secrets versions access latest "
              f"--secret={shlex.quote(o.token_secret)} --project={shlex.quote(o.project)} | \"$D/venv/bin/python\" "
              f"-m experiments.credentials learner --secret_file=- --learner={index} --out=\"$D/token\"")
    return [Step(f"derive learner {index}'s credential on {host.name} from Secret Manager",
                 tuple(host.ssh(o.project, derive)))]
  local = os.path.join(o.local_dir, f"learner_{index}.token")
  return [Step(f"derive learner {index}'s credential", (sys.executable, "-m", "experiments.credentials", "learner",
                                                       f"--secret_file={o.token_file}", f"--learner={index}",
                                                       f"--out={local}")),
          Step(f"copy learner {index}'s credential to {host.name}",
               tuple(host.scp(o.project, local, f"dd/{o.run_name}/token")))]


def _secret_steps(o: Options, syncer: Host, remote: str) -> list[Step]:
  """The run secret into $D/secret on the syncer's host only."""
  if o.token_secret:
    fetch = (f"D={remote}; umask 077 && gcloud secrets versions access latest "
             f"--secret={shlex.quote(o.token_secret)} --project={shlex.quote(o.project)} > \"$D/secret\"")
    return [Step(f"fetch the run secret from Secret Manager on {syncer.name}", tuple(syncer.ssh(o.project, fetch)))]
  return [Step(f"copy the run secret to {syncer.name}", tuple(syncer.scp(o.project, o.token_file,
                                                                          f"dd/{o.run_name}/secret")))]


def _certificate_steps(o: Options, syncer: Host, hosts: list[Host], address: str) -> list[Step]:
  """The run's CA (made once, kept here) signs a certificate naming `address`; the syncer gets it and
  its key, every host the CA."""
  tls = os.path.join(o.local_dir, "tls")
  steps = [Step(f"make the TLS certificate for {address}", (sys.executable, "-m", "experiments.credentials", "certs",
                                                           f"--dir={tls}", f"--host={address}"))]
  for name, target in (("syncer.pem", "tls.crt"), ("syncer.key", "tls.key")):
    steps.append(Step(f"copy {name} to {syncer.name}", tuple(syncer.scp(o.project, os.path.join(tls, name),
                                                                          f"dd/{o.run_name}/{target}"))))
  for host in hosts:
    steps.append(Step(f"copy the run's CA to {host.name}", tuple(host.scp(o.project, os.path.join(tls, "ca.pem"),
                                                                          f"dd/{o.run_name}/tls_ca.pem"))))
  return steps


def _repo() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(remote: str, tpu: bool) -> str:
  """Unpacks the code and installs it (with JAX for TPU on slices) into a Python 3.11 venv."""
  jax = " 'jax[tpu]'" if tpu else ""
  return (f"set -e; D={remote}; rm -rf \"$D/src\"; mkdir -p \"$D/src\"; tar -xzf \"$D/src.tar.gz\" -C \"$D/src\"; "
          "if [ ! -x \"$D/venv/bin/python\" ]; then command -v python3.11 >/dev/null || "
          "(sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 "
          "python3.11-venv); python3.11 -m venv \"$D/venv\"; fi; "
          f"\"$D/venv/bin/pip\" install -q -U pip; \"$D/venv/bin/pip\" install -q -e \"$D/src\"{jax}")


def _train(o: Options, remote: str, log: str, env: str, *args: str, token: str = "token") -> str:
  """A detached `experiments.train` process on a host: its secret by file path, output in its log."""
  workdir = shlex.quote(o.workdir) if o.workdir else '"$D/work"'
  command = ["\"$D/venv/bin/python\" -m experiments.train", shlex.quote(f"--config={o.config_path}"),
             *map(shlex.quote, o.overrides), *args, f"--workdir={workdir}",
             f"--config.service.token_file=\"$D/{token}\""]
  return (f"D={remote}; cd \"$D/src\" && {env}nohup {' '.join(command)} > \"$D/{log}.log\" 2>&1 < /dev/null &")


def _syncer_command(o: Options, remote: str) -> str:
  """The syncer binds every interface (learners come from other slices); on a slice it keeps off the TPU."""
  tls = ["--config.service.tls_cert=\"$D/tls.crt\"", "--config.service.tls_key=\"$D/tls.key\""
         ] if o.tls != "none" else []
  return _train(o, remote, "syncer", "" if o.syncer_vm else "JAX_PLATFORMS=cpu ", "--role=syncer",
                "--config.service.host=0.0.0.0", f"--config.service.port={o.port}",
                f"--config.service.data_port={o.port + 1}", *tls, token="secret")


def _learner_command(o: Options, remote: str, index: int, address: str) -> str:
  tls = {"given": ["--config.service.tls_ca=\"$D/tls.crt\""],
         "generated": ["--config.service.tls_ca=\"$D/tls_ca.pem\""], "none": []}[o.tls]
  # Every worker of the slice runs this; --group_coordinator=auto makes them one JAX program.
  return _train(o, remote, f"learner_{index}", "", "--role=learner", f"--learner_id={index}",
                f"--syncer={shlex.quote(address)}", "--group_coordinator=auto", *tls)


def _ip_lookup(host: Host, project: str) -> list[str]:
  if host.tpu:
    return ["gcloud", "compute", "tpus", "tpu-vm", "describe", host.name, f"--zone={host.zone}",
            f"--project={project}", "--format=value(networkEndpoints[0].ipAddress)"]
  return ["gcloud", "compute", "instances", "describe", host.name, f"--zone={host.zone}", f"--project={project}",
          "--format=value(networkInterfaces[0].networkIP)"]


def define_flags() -> dict:
  """The CLI's absl flags. Defined only when run as a program, so that tests (and other tools)
  import the planner without claiming flag names such as --config."""
  return {
      "config": config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config file.",
                                                lock_config=True),
      "slices": flags.DEFINE_string("slices", "", f"One slice per learner group: TYPE-SIZE@ZONE,..., {_EXAMPLE}."),
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


if __name__ == "__main__":
  app.run(functools.partial(main, define_flags()))

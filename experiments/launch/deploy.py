"""`start`: every command that puts the code, the secrets and the TLS material on the hosts and starts the processes."""

import dataclasses
import os
import shlex
import sys

from experiments.launch.hosts import SYNCER_IP, TPU_TYPES, Host, Step
from experiments.launch.options import Options

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
  """This checkout's root, which `start` packs and uploads."""
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


"""`start`: the commands that put the code, the secrets, the TLS material and the data in place and start the processes.

The syncer gets the run secret; the hosts of slice i only learner i's credential, the evaluator's slice
(service.evaluate_on='evaluator') only the evaluator's read-only one
(security.learner_credential: derived here from a local 0600 file and copied, or derived on the
host from a Secret Manager fetch that is never stored there). TLS is on unless --insecure: the
run's CA (made once on this machine, its key never leaves it) signs a certificate naming the
syncer's internal address; every learner slice gets the CA like it gets its credential. No secret ever
appears on a command line. A TFDS dataset is prepared once, by the syncer's host, into the run's
bucket, and every process reads it from there.
"""

import os
import shlex
import sys

from experiments.launch import options as options_lib
from experiments.launch import xpk
from experiments.launch.hosts import SYNCER_IP, Host, Step
from experiments.launch.options import Options, evaluator_args, learner_args, train_args


def start(o: Options) -> list[Step]:
  """Every command of `start`, in order; pure, so a dry run prints exactly what a run runs."""
  syncer = o.syncer()
  slices = [] if o.xpk_cluster else o.slice_hosts()  # XPK pods get their code from the image.
  steps = [_pack(o)] + (xpk.build(o) + xpk.publish_files(o) if o.xpk_cluster else [])
  for i, host in enumerate(slices):
    steps.extend(_host_steps(o, host, i))
  evaluator = o.evaluator_host()
  if evaluator is not None:
    steps.extend(_host_steps(o, evaluator, None) + _credential_steps(o, evaluator, None))
    slices = slices + [evaluator]  # It trusts the syncer's certificate like the learners.
  if not syncer.tpu:
    steps.extend(_host_steps(o, syncer, None))
  steps.extend(_secret_steps(o, syncer))
  if o.tls_key:  # The private key goes to the syncer's host only.
    steps.append(_copy(o, syncer, "the TLS key", o.tls_key, "tls.key"))
  steps, address = _address(o, steps)
  if o.tls == "generated":
    steps.extend(_certificate_steps(o, syncer, address))
    steps.extend(_ca_step(o, host) for host in slices)
    steps.extend([xpk.publish_ca(o)] if o.xpk_cluster else [])
  if o.tfds_name:
    prepare = (f"D={o.remote}; \"$D/venv/bin/tfds\" build {shlex.quote(o.tfds_name)} "
               f"--data_dir={shlex.quote(o.tfds_dir)} --file_format=array_record")
    steps.append(
        Step(f"prepare {o.tfds_name} once into {o.tfds_dir} on {syncer.name} (skipped if it is there)",
             tuple(syncer.ssh(o.project, prepare))))
  where = f"{syncer.name} (worker {syncer.worker})" if syncer.tpu else syncer.name
  steps.extend(
      Step(f"start the syncer{f' shard {s}' if o.syncer_shards > 1 else ''} on {where}",
           tuple(syncer.ssh(o.project, _syncer_command(o, syncer.tpu, s)))) for s in range(o.syncer_shards))
  start_learner = xpk.start_learner if o.xpk_cluster else _learner_step
  steps += [start_learner(o, i, address) for i in range(len(o.slices))]
  if evaluator is not None:
    steps.append(_evaluator_step(o, evaluator, address))
  return steps


def restart(o: Options, index: int) -> list[Step]:
  """What recreated slice `index` (Options.tpus: a learner's, or the evaluator's last) needs to run its process
  again (code, shipped files, credential, CA, the same learner id); a learner rejoins from its checkpoint in the
  workdir, the evaluator from the syncer's newest Θ. Nothing else of the run is touched."""
  host = o.tpus()[index][0]
  learner = index if index < len(o.slices) else None
  setup = _host_steps(o, host, learner) + ([] if learner is not None else _credential_steps(o, host, None))
  steps, address = _address(o, [_pack(o), *setup])
  if o.tls == "generated":
    steps.append(_ca_step(o, host))
  return steps + [_learner_step(o, index, address) if learner is not None else _evaluator_step(o, host, address)]


def _pack(o: Options) -> Step:
  return Step("pack this checkout", ("tar", "--exclude=__pycache__", "-czf", o.archive, "-C", options_lib.repo(),
                                     "setup.py", "decoupled_diloco", "experiments", "configs"))


def _file(o: Options, name: str) -> str:
  """A file of the run's directory on a host, as scp names it (relative to the home directory)."""
  return f"dd/{o.run_name}/{name}"


def _copy(o: Options, host: Host, what: str, local: str, name: str) -> Step:
  """`local` copied to the run's directory on `host` as `name`, the way every file reaches a host."""
  return Step(f"copy {what} to {host.name}", tuple(host.scp(o.project, local, _file(o, name))))


def _host_steps(o: Options, host: Host, index: int | None) -> list[Step]:
  """The run directory, the code in a venv and (for learner `index`'s slice) its credential on `host`."""
  steps = [
      Step(f"make the run directory on {host.name}", tuple(host.ssh(o.project, f"mkdir -p -m 700 {o.remote}"))),
      _copy(o, host, "the code", o.archive, "src.tar.gz"),
      *(_copy(o, host, what, local, name) for what, local, name in options_lib.shipped(o))]
  if o.tls == "given":  # The syncer serves with it, learners trust it.
    steps.append(_copy(o, host, "the TLS certificate", o.tls_cert, "tls.crt"))
  steps.append(Step(f"install into a venv on {host.name}", tuple(host.ssh(o.project, _setup(o, host.tpu)))))
  return steps + ([] if index is None else _credential_steps(o, host, index))


def _address(o: Options, steps: list[Step]) -> tuple[list[Step], str]:
  """The syncer's address learners dial: given, or its internal IP looked up by a step appended here."""
  if o.syncer_address:
    return steps, o.syncer_address
  syncer = o.syncer()
  return steps + [Step(f"look up the internal IP of {syncer.name}", tuple(syncer.internal_ip(o.project)), SYNCER_IP)
                 ], SYNCER_IP


def _credential_steps(o: Options, host: Host, index: int | None) -> list[Step]:
  """Learner `index`'s credential (None: the evaluator's) into $D/token on `host`: derived here and copied, or
  derived on the host from a Secret Manager fetch piped through (the secret is never stored there)."""
  who, command, which, name = ((f"learner {index}", "learner", [f"--learner={index}"],
                                f"learner_{index}") if index is not None else
                               ("the evaluator", "evaluator", [], "evaluator"))
  if o.token_secret:
    derive = (f"D={o.remote}; umask 077 && cd \"$D/src\" && {options_lib.fetch_secret(o)} | \"$D/venv/bin/python\" "
              f"-m experiments.credentials {' '.join([command, '--secret_file=-', *which])} --out=\"$D/token\"")
    return [Step(f"derive {who}'s credential on {host.name} from Secret Manager", tuple(host.ssh(o.project, derive)))]
  local = os.path.join(o.local_dir, f"{name}.token")
  return [
      Step(f"derive {who}'s credential", (sys.executable, "-m", "experiments.credentials", command,
                                          f"--secret_file={o.token_file}", *which, f"--out={local}")),
      _copy(o, host, f"{who}'s credential", local, "token")]


def _secret_steps(o: Options, syncer: Host) -> list[Step]:
  """The run secret into $D/secret on the syncer's host only."""
  if o.token_secret:
    fetch = f"D={o.remote}; umask 077 && {options_lib.fetch_secret(o)} > \"$D/secret\""
    return [Step(f"fetch the run secret from Secret Manager on {syncer.name}", tuple(syncer.ssh(o.project, fetch)))]
  return [_copy(o, syncer, "the run secret", o.token_file, "secret")]


def _certificate_steps(o: Options, syncer: Host, address: str) -> list[Step]:
  """The run's CA (made once, kept here) signs a certificate naming `address`; the syncer gets it and its key."""
  tls = os.path.join(o.local_dir, "tls")
  steps = [
      Step(f"make the TLS certificate for {address}",
           (sys.executable, "-m", "experiments.credentials", "certs", f"--dir={tls}", f"--host={address}"))]
  for name, target in (("syncer.pem", "tls.crt"), ("syncer.key", "tls.key")):
    steps.append(_copy(o, syncer, name, os.path.join(tls, name), target))
  return steps


def _ca_step(o: Options, host: Host) -> Step:
  """The run's CA to `host`, like its credential: what learners verify the syncer's certificate against."""
  return _copy(o, host, "the run's CA", options_lib.ca_file(o), "tls_ca.pem")


def _setup(o: Options, tpu: bool) -> str:
  """Unpacks the code and installs it (with JAX for TPU on slices) into a Python 3.11 venv."""
  package = f"$D/src[{o.extras}]" if o.extras else "$D/src"
  jax = " 'jax[tpu]'" if tpu else ""
  return (f"set -e; D={o.remote}; rm -rf \"$D/src\"; mkdir -p \"$D/src\"; tar -xzf \"$D/src.tar.gz\" -C \"$D/src\"; "
          "if [ ! -x \"$D/venv/bin/python\" ]; then command -v python3.11 >/dev/null || "
          "(sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 "
          "python3.11-venv); python3.11 -m venv \"$D/venv\"; fi; "
          f"\"$D/venv/bin/pip\" install -q -U pip; \"$D/venv/bin/pip\" install -q -e \"{package}\"{jax}")


def _train(o: Options, log: str, env: str, *args: str, token: str = "token") -> str:
  """A detached `experiments.train` process on a host: its secret by file path, output in its log, and its
  files that need fsync and flock (the syncer's write-ahead log, every process's lock) on the host's own disk,
  since the workdir is a gs:// bucket (storage.local_dir refuses a remote one). Only the process itself is put in
  the background: a backgrounded `cd && nohup ...` list would be a subshell holding the ssh session's output open,
  and `gcloud ssh` would not return until the run ended (tests/test_launch_roundtrip.py caught that)."""
  command = [
      "\"$D/venv/bin/python\" -m experiments.train", *train_args(o), *args,
      f"--config.service.token_file=\"$D/{token}\"", "--config.service.local_dir=\"$D/local\""]
  return (f"D={o.remote}; cd \"$D/src\" || exit 1; {env}nohup {' '.join(command)} > \"$D/{log}.log\" 2>&1 "
          "< /dev/null &")


def _syncer_command(o: Options, on_tpu: bool, shard: int = 0) -> str:
  """The syncer binds every interface (learners come from other hosts); on a slice it keeps off the TPU; its
  write-ahead log stays on local disk (`_train`) while checkpoints and metrics go to the workdir.
  Shard s of S binds port + s and its data channel port + S + s (service/shardrun.py adds the s)."""
  tls = ["--config.service.tls_cert=\"$D/tls.crt\"", "--config.service.tls_key=\"$D/tls.key\""
        ] if o.tls != "none" else []
  sharded = [f"--shard={shard}"] if o.syncer_shards > 1 else []
  return _train(o, f"syncer_{shard}" if sharded else "syncer", "JAX_PLATFORMS=cpu " if on_tpu else "", "--role=syncer",
                *sharded, "--config.service.host=0.0.0.0", f"--config.service.port={o.port}",
                f"--config.service.data_port={o.port + o.syncer_shards}", *tls, token="secret")


def _evaluator_step(o: Options, host: Host, address: str) -> Step:
  return Step(f"start the evaluator on {host.name}",
              tuple(host.ssh(o.project, _train(o, "evaluator", "", *evaluator_args(o, address)))))


def _learner_step(o: Options, index: int, address: str) -> Step:
  host = o.slice_hosts()[index]
  return Step(f"start learner {index} on every worker of {host.name}",
              tuple(host.ssh(o.project, _train(o, f"learner_{index}", "", *learner_args(o, index, address)))))

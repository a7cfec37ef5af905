r"""Starts a syncer and one process per learner group on this machine (and the evaluator, with
service.evaluate_on='evaluator'); optionally kills them on a schedule.

  python -m experiments.launch_local --config=configs/demo.py --workdir=/tmp/dd_local
  python -m experiments.launch_local --config=configs/demo.py --workdir=/tmp/dd_chaos \
      --chaos_seed=0 --kill_every_seconds=20
  python -m experiments.launch_local --config=configs/demo.py --workdir=/tmp/dd_multi --processes_per_group=2

`--config.*` overrides are passed on to every process. The run secret is
$DD_SYNCER_TOKEN if set (or the config's service.token_file), else a fresh random one; the
syncer gets it and each learner only its own credential derived from it
(security.learner_credential), both through their environment, never on a command line; the evaluator gets
its read-only credential (security.evaluator_credential) the same way. The launcher picks a
free port (or takes service.port), so the learners start with the syncer and retry until it
serves; a restarted syncer gets the same port and --config.resume=True. Logs: <workdir>/logs/<process>.log. The launcher
exits 0 once the syncer and every learner exited 0.

Chaos: every --kill_every_seconds a seeded choice among the running learners (and the syncer,
with --chaos_syncer) that have been up --min_uptime_seconds (so that every incarnation gets
past start-up and trains) is SIGKILLed and restarted --restart_delay_seconds later, until
--max_kills kills have happened (0 = no limit). A budget keeps a chaos run finite on a slow
machine: when a restart takes longer than the time between kills, unbounded chaos can keep
every learner down and the run never ends.

On a GPU machine each learner group gets its own GPUs (CUDA_VISIBLE_DEVICES; groups share GPUs, each
preallocating its share of their memory, when there are fewer GPUs than the groups need) and the syncer and
evaluator run on CPU only (experiments/gpu_placement.py, docs/scale.md).

--processes_per_group=N runs each learner group as N JAX processes (gloo collectives, a
fresh coordinator port per start) named learner_<i>.p<k>; a group is killed and restarted
as a whole, like a slice that lost a host.
"""

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from decoupled_diloco.service import security, shardrun
from experiments import cli, gpu_placement
from experiments.chaos_schedule import Chaos

_CONFIG = config_flags.DEFINE_config_file("config", "configs/demo.py", "Experiment config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Shared workdir of the syncer and learners.")
flags.mark_flag_as_required("workdir")
_CHAOS_SEED = flags.DEFINE_integer("chaos_seed", None, "Seed of the kill/restart schedule (None = no chaos).")
_KILL_EVERY = flags.DEFINE_float("kill_every_seconds", 0.0, "Seconds between SIGKILLs of a chaos run.")
_RESTART_DELAY = flags.DEFINE_float("restart_delay_seconds", 2.0, "Seconds a killed process stays down.")
_CHAOS_SYNCER = flags.DEFINE_bool("chaos_syncer", False, "Chaos may also kill (and restart) the syncer.")
_MIN_UPTIME = flags.DEFINE_float("min_uptime_seconds", 15.0, "Chaos kills only processes up at least this long.")
_MAX_KILLS = flags.DEFINE_integer("max_kills", 0, "Chaos stops after this many kills (0 = no limit).")
_TIMEOUT = flags.DEFINE_float("timeout_seconds", 3600.0, "Kill everything and fail after this long.")
_PROCESSES_PER_GROUP = flags.DEFINE_integer(
    "processes_per_group", 1, "JAX processes per learner group (each "
    "gets an equal share of the group's devices).")
_SYNCER_SHARDS = flags.DEFINE_integer(
    "syncer_shards", None, "Syncer shards (processes syncer, syncer_1, ...): sets "
    "--config.service.shards (docs/syncer-shards.md).")

TOKEN_ENV = "DD_SYNCER_TOKEN"


class LocalCluster:
  """The syncer and learner processes of one run: start, kill, restart, wait."""

  def __init__(self, config_path: str, workdir: str, overrides: list[str], num_learners: int, env: dict | None = None,
               host: str = "127.0.0.1", port: int = 0, group_processes: tuple[int, ...] = (), evaluator: bool = False,
               shards: int = 1, group_devices: tuple[int, ...] = (), gpu_ids: tuple[str, ...] = ()):
    self.config_path, self.workdir, self.overrides = config_path, os.path.abspath(workdir), list(overrides)
    self.shards = shards  # Syncer shards: processes 'syncer' (shard 0, which keeps the budget), 'syncer_<s>'.
    self.num_learners, self.host, self.port = num_learners, host, port
    self.group_processes = tuple(group_processes) or (1,) * num_learners  # JAX processes per learner group.
    self.evaluator = evaluator  # Whether an evaluator process reads Θ (service.evaluate_on='evaluator').
    self.group_devices, self.gpu_ids = tuple(group_devices), tuple(gpu_ids)  # learners.devices; GPUs to hand out.
    self.env = dict(os.environ if env is None else env)
    self.env.pop("XLA_FLAGS", None)  # Each process sizes its own CPU backend (jax_num_cpu_devices).
    self.env.setdefault(TOKEN_ENV, secrets.token_hex(16))
    self.processes: dict[str, subprocess.Popen] = {}
    self.stopped_after_end: set[str] = set()  # Learner processes still running end_grace_seconds after the run ended.
    self.address: str | None = None
    self.starts: dict[str, int] = {}
    self.started_at: dict[str, float] = {}  # Syncer or learner group -> time.monotonic() of its last start.
    os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)

  def _command(self, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "experiments.train", f"--config={self.config_path}", *self.overrides,
        f"--workdir={self.workdir}", *args]

  def _env(self, role: str, index: int = 0) -> dict:
    """A child's environment: its own GPUs for a learner group, CPU only for the others (gpu_placement)."""
    return gpu_placement.child_env(self.env, role, index, self.group_devices, self.gpu_ids)

  def _spawn(self, name: str, command: list[str], env: dict | None = None) -> subprocess.Popen:
    self.starts[name] = self.starts.get(name, 0) + 1
    self.started_at[_unit(name)] = time.monotonic()
    log = open(os.path.join(self.workdir, "logs", f"{name}.log"), "ab")  # pylint: disable=consider-using-with
    log.write(f"=== start {self.starts[name]}: {' '.join(command)}\n".encode())
    log.flush()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or self.env,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log.close()
    self.processes[name] = process
    return process

  def start_syncer(self, wait: bool = True, timeout: float = 300.0, shard: int = 0) -> str:
    """Starts (or restarts, resuming) the syncer (shard `shard`) on a fixed port; returns the run's address(es).

    The ports are picked here (free now) rather than by the syncers, so learners can start at
    the same time (they retry until it serves) and a restart keeps the address; shard s binds
    the base port + s (service/shardrun.py). `wait`: return only once the syncer serves.
    """
    name = "syncer" if shard == 0 else f"syncer_{shard}"
    workdir = self.workdir if self.shards == 1 else shardrun.shard_workdir(self.workdir, shard)
    address_file = os.path.join(workdir, "syncer_address")
    args = ["--role=syncer", *([f"--shard={shard}"] if self.shards > 1 else [])]
    if self.address is None:
      base = self.port or free_port(self.host, self.shards)
      self.address = ",".join(f"{self.host}:{base + s}" for s in range(self.shards))
    if self.starts.get(name):  # A restart: resume from the checkpoint and the log.
      args.append("--config.resume=True")
    args.append(f"--config.service.port={self.address.split(',')[0].rsplit(':', 1)[1]}")
    if os.path.exists(address_file):
      os.remove(address_file)
    process = self._spawn(name, self._command(*args), self._env("syncer"))
    deadline = time.monotonic() + timeout
    while wait and not os.path.exists(address_file):
      if process.poll() is not None:
        log = os.path.join(self.workdir, "logs", f"{name}.log")
        with open(log, errors="replace") as text:
          tail = "".join(text.readlines()[-15:])
        raise RuntimeError(f"the syncer exited with {process.returncode} before serving; the end of {log}:\n{tail}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"the syncer did not publish its address within {timeout:.0f}s")
      time.sleep(0.1)
    return self.address

  def start_learner(self, index: int) -> None:
    """Starts (or restarts) learner group `index` against the syncer: one process, or several."""
    args = ("--role=learner", f"--learner_id={index}", f"--syncer={self.address}")
    env = {**self._env("learner", index), TOKEN_ENV: security.learner_credential(self.env[TOKEN_ENV], index)}
    count = self.group_processes[index]
    if count == 1:
      self._spawn(f"learner_{index}", self._command(*args), env)
      return
    coordinator = f"127.0.0.1:{free_port('127.0.0.1')}"
    for k in range(count):
      self._spawn(
          f"learner_{index}.p{k}",
          self._command(*args, f"--group_coordinator={coordinator}", f"--group_processes={count}",
                        f"--group_process_id={k}"), env)

  def start_evaluator(self) -> None:
    """Starts (or restarts) the evaluator against the syncer, with its read-only credential."""
    env = {**self._env("evaluator"), TOKEN_ENV: security.evaluator_credential(self.env[TOKEN_ENV])}
    self._spawn("evaluator", self._command("--role=evaluator", f"--syncer={self.address}"), env)

  def start(self) -> None:
    """The syncer (every shard), every learner and the evaluator (if any), all at once."""
    for shard in range(self.shards):
      self.start_syncer(wait=False, shard=shard)
    for index in range(self.num_learners):
      self.start_learner(index)
    if self.evaluator:
      self.start_evaluator()

  def kill(self, name: str) -> None:
    """SIGKILL of a process, or of every process of a learner group: no handler runs, like a lost machine."""
    for member in [n for n in self.processes if _unit(n) == name or n == name]:
      process = self.processes[member]
      if process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait()

  def restart(self, name: str) -> None:
    """Starts a killed process again (a syncer resumes from its checkpoint and log)."""
    if name.startswith("syncer"):
      self.start_syncer(shard=int(name.split("_")[1]) if "_" in name else 0)
    elif name == "evaluator":
      self.start_evaluator()
    else:
      self.start_learner(int(name.split("_")[1]))

  def running(self) -> list[str]:
    """Names of the syncer and learner groups with a process alive now."""
    return sorted({_unit(name) for name, p in self.processes.items() if p.poll() is None})

  def wait(self, timeout: float, chaos: "Chaos | None" = None, end_grace_seconds: float = 60.0,
           watch=None) -> dict[str, int]:
    """Waits for the syncer to finish and the learners to exit; returns each one's exit code.

    A learner that has not exited `end_grace_seconds` after the syncer did is stopped
    (SIGTERM) and named in `stopped_after_end`: e.g. one restarted after its previous
    incarnation heard the run was over, which finds no syncer to tell it again. `watch()` runs
    about once a second meanwhile (the console's progress lines).
    """
    watched = 0.0
    deadline = time.monotonic() + timeout
    while self.processes["syncer"].poll() is None or (chaos and chaos.down):
      if time.monotonic() > deadline:
        self.stop()
        raise TimeoutError(f"the run did not finish within {timeout:.0f}s: see {self.workdir}/logs")
      if chaos is not None:
        chaos.step(self, time.monotonic())
      if watch is not None and time.monotonic() - watched >= 1.0:
        watch()
        watched = time.monotonic()
      failed = [
          n for n, p in self.processes.items()
          if p.poll() not in (None,
                              0) and n != "syncer" and not (chaos and _unit(n) in set(chaos.down) | chaos.abandoned)]
      if failed:
        self.stop()
        raise RuntimeError(f"{', '.join(failed)} failed: see {self.workdir}/logs")
      time.sleep(0.1)
    if self.processes["syncer"].returncode:  # It failed: no syncer is left to tell the learners to stop.
      self.stop()
    grace_end = min(deadline, time.monotonic() + end_grace_seconds)
    for name, process in self.processes.items():
      try:
        process.wait(timeout=max(1.0, grace_end - time.monotonic()))
      except subprocess.TimeoutExpired:
        logging.warning("%s still running %.0fs after the syncer finished: terminating it", name, end_grace_seconds)
        process.terminate()
        process.wait()
        self.stopped_after_end.add(name)
    return {name: p.returncode for name, p in self.processes.items()}

  def stop(self) -> None:
    """Kills every process still running."""
    for name in self.running():
      self.kill(name)


def _unit(process_name: str) -> str:
  """What fails and restarts as one: the syncer, or a learner group (all its processes)."""
  return process_name.split(".")[0]


def error_lines(workdir: str, names) -> list[str]:
  """What failed children said: each one's last `error:` line from its log, once per distinct line."""
  said: dict[str, list[str]] = {}
  for name in names:
    path = os.path.join(workdir, "logs", f"{name}.log")
    if os.path.exists(path):
      with open(path, encoding="utf-8", errors="replace") as log:
        lines = [line.strip() for line in log if line.startswith("error:")]
      if lines:
        said.setdefault(lines[-1], []).append(name)
  return [f"{', '.join(who)}: {line}" for line, who in said.items()]


def _validate(config) -> None:
  """The checks the syncer and learner processes make, made once here before anything starts or is written."""
  from decoupled_diloco import experiment  # pylint: disable=g-import-not-at-top  (keeps --help fast)
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top

  config.runtime = "service"  # What --role does in each child.
  try:
    experiment.validate(config)  # With runtime='service': the service group too.
  except ConfigError as error:
    cli.fail(error)
  if _PROCESSES_PER_GROUP.value < 1:
    cli.fail(f"--processes_per_group={_PROCESSES_PER_GROUP.value} must be >= 1")
  gpus = gpu_placement.visible_gpus()
  if gpus:
    if _PROCESSES_PER_GROUP.value > 1:
      cli.fail(f"--processes_per_group={_PROCESSES_PER_GROUP.value} on a GPU machine: a group's processes would "
               "share its GPUs; run one process per group here (multi-host groups: docs/launch.md)")
    try:
      gpu_placement.assign_gpus(config.learners.devices, len(gpus))
    except ConfigError as error:
      cli.fail(error)
  workdir = _WORKDIR.value
  if os.path.isdir(workdir) and any(os.scandir(workdir)) and not config.resume:
    cli.fail(f"workdir {workdir} already holds files (a run?): pass --config.resume=True to continue it, or pick a "
             "new --workdir")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    cli.fail(f"workdir {workdir} is a file: pick a new --workdir")
  from decoupled_diloco.service import runconfig  # pylint: disable=g-import-not-at-top
  try:
    runconfig.check_ports_free(config.service.host, *_fixed_ports(config))
  except ConfigError as error:
    cli.fail(error)


def _fixed_ports(config) -> list[int]:
  """The ports a run's syncer shards will bind when service.port / data_port are set (0: any free one)."""
  shards = range(config.service.shards)
  return [port + s for port in (config.service.port, config.service.data_port) if port > 0 for s in shards]


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
  """A port free now (the first of `count` consecutive free ones: syncer shards bind port + s), chosen below the
  OS's ephemeral range so it stays free until bound.

  A port the OS hands out for `bind(0)` comes from the ephemeral range, which every outgoing
  connection and every `port=0` server on the machine also draws from: in the seconds between
  picking it and a child process binding it, another process can take it (a test run once lost
  its syncer to that). Ports below the range are only ever taken on purpose.
  """
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
      ephemeral_low = int(ports.read().split()[0])
  except (OSError, ValueError, IndexError):
    ephemeral_low = 32768
  for candidate in random.SystemRandom().sample(range(10000, max(ephemeral_low - count + 1, 10001)), 64):
    probes = [socket.socket() for _ in range(count)]
    try:
      for offset, probe in enumerate(probes):
        probe.bind((host, candidate + offset))
    except OSError:
      continue
    finally:
      for probe in probes:
        probe.close()
    return candidate
  if count > 1:
    raise RuntimeError(f"found no {count} consecutive free ports below {ephemeral_low}: set --config.service.port")
  with socket.socket() as probe:  # Everything sampled was busy: let the OS choose.
    probe.bind((host, 0))
    return probe.getsockname()[1]


def main(argv: list[str]) -> None:
  """Launches the run, applies the chaos schedule, and exits with the run's status."""
  del argv
  config = cli.load_config(_CONFIG)
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  if _SYNCER_SHARDS.value is not None:
    config.service.shards = _SYNCER_SHARDS.value
    overrides.append(f"--config.service.shards={_SYNCER_SHARDS.value}")
  _validate(config)
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  cluster = LocalCluster(config_path, _WORKDIR.value, overrides, len(config.learners.devices),
                         host=config.service.host if config.service.host not in ("0.0.0.0", "::") else "127.0.0.1",
                         port=config.service.port,
                         group_processes=(_PROCESSES_PER_GROUP.value,) * len(config.learners.devices),
                         evaluator=config.service.evaluate_on == "evaluator", shards=config.service.shards,
                         group_devices=tuple(config.learners.devices), gpu_ids=gpu_placement.visible_gpus())
  chaos = None
  if _CHAOS_SEED.value is not None and _KILL_EVERY.value > 0:
    chaos = Chaos(_CHAOS_SEED.value, _KILL_EVERY.value, _RESTART_DELAY.value, _CHAOS_SYNCER.value, _MIN_UPTIME.value,
                  _MAX_KILLS.value)
  signal.signal(signal.SIGTERM, lambda *_: (cluster.stop(), sys.exit(143)))
  from decoupled_diloco.run import monitor as monitor_lib  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service.console import RunConsole  # pylint: disable=g-import-not-at-top
  console = RunConsole(config, cluster.workdir)
  try:
    cluster.start()
    print(f"syncer at {cluster.address}; logs in {cluster.workdir}/logs", flush=True)
    codes = cluster.wait(_TIMEOUT.value, chaos, watch=console.poll)
  except (RuntimeError, TimeoutError) as error:
    cluster.stop()
    said = error_lines(cluster.workdir, cluster.processes)
    sys.stderr.write(f"error: {error}" + "".join(f"; {line}" for line in said) + "\n")
    sys.exit(1)
  if chaos is not None:
    print(f"chaos events (seconds after the first): "
          f"{[(round(t - chaos.events[0][0], 1), e, n) for t, e, n in chaos.events]}")
  # Under chaos, a learner killed after it heard the run was over may be restarted into a finished run.
  abandoned = chaos.abandoned | cluster.stopped_after_end if chaos is not None else set()
  print(f"exit codes: {codes}" + (f" (killed or stopped at the end: {sorted(abandoned)})" if abandoned else ""))
  for line in console.closing_lines():
    print(line, flush=True)
  if console.diverged:
    sys.exit(monitor_lib.DIVERGED_EXIT_STATUS)
  failed = [name for name, code in codes.items() if code and name not in abandoned]
  for line in error_lines(cluster.workdir, failed):
    sys.stderr.write(f"error: {line}\n")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

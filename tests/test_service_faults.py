"""A real syncer process under real faults: SIGKILL restarts, frozen peers, call floods, a full log disk.

Each test starts `experiments.train --role=syncer` (tests/service_config.py) and drives it as
learners do, with the project's client and each learner's own credential, from this process;
attackers run in processes of their own (a frozen peer is a SIGSTOPped process). See
docs/service-durability.md (incarnations, fail-stop) and docs/security.md (keepalive, the call cap).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import datachannel, durable, runconfig, security, wire
from experiments.launch_local import LocalCluster
from tests.helpers import wait_for
from tests.test_durability import _fill
from tests.test_service_units import _delta, params  # pylint: disable=unused-import

CONFIG = "tests/service_config.py"
SECRET = "f" * 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Real processes (each syncer start imports JAX and builds the model): not in the fast subset.
pytestmark = pytest.mark.slow


def _cluster(workdir, *overrides):
  return LocalCluster(CONFIG, str(workdir), ["--config.syncer.min_learners_to_start=1", *overrides], 2,
                      env=dict(os.environ, DD_SYNCER_TOKEN=SECRET))


def _client(address, learner, retry_seconds=60.0):
  return client_lib.SyncerClient(address, security.learner_credential(SECRET, learner), learner, chunk_bytes=64 << 10,
                                 timeout_seconds=20, retry_seconds=retry_seconds)


def _push(client, params, seq, base_version):
  return client.push(seq, _delta(params), base_version=base_version, tokens=64, local_steps=1, compute_seconds=0.1)


def _incarnation_file(workdir):
  with open(os.path.join(workdir, durable.INCARNATION_FILE), encoding="utf-8") as f:
    return int(f.read())


def _syncer_pushes(workdir):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if r["kind"] == "push"]


def test_each_syncer_start_is_a_new_incarnation_that_learners_notice_and_a_stale_one_is_fenced(params, tmp_path):
  cluster = _cluster(tmp_path)
  try:
    address = cluster.start_syncer()
    learner = _client(address, 0)
    status, _ = learner.join()
    assert status["syncer_incarnation"] == 1 == _incarnation_file(tmp_path)
    for seq, incarnation in ((0, 2), (1, 3)):
      assert _push(learner, params, seq, status["version"])["status"] == "applied"
      cluster.kill("syncer")  # SIGKILL: its next start resumes from the checkpoint and the log.
      cluster.start_syncer()
      reply = _push(learner, params, seq, status["version"])  # The same push again, as after a lost ack.
      assert reply["status"] == "duplicate" and reply["acked_seq"] == seq  # The ack survived, not applied twice.
      assert reply["syncer_incarnation"] == incarnation == _incarnation_file(tmp_path)
      assert learner.syncer_restarts == incarnation - 1 and learner.syncer_incarnation == incarnation
    # A learner that heard from a newer syncer never acts on this (older) one's replies: a replaced process.
    fenced = _client(address, 1, retry_seconds=2.0)
    fenced.syncer_incarnation = 4
    with pytest.raises(client_lib.SyncerUnreachable, match="older than incarnation 4"):
      fenced.heartbeat()
  finally:
    cluster.stop()


@pytest.fixture(scope="module")
def tight_syncer(tmp_path_factory):
  """(address, max payload bytes) of a syncer with 1 s keepalive and the smallest call cap 2 learners allow."""
  workdir = tmp_path_factory.mktemp("tight")
  cap = runconfig.bulk_workers(2) + 4  # + server.CONTROL_WORKERS: the least runconfig.validate accepts.
  cluster = _cluster(workdir, "--config.service.keepalive_seconds=1", "--config.service.keepalive_timeout_seconds=1",
                     f"--config.service.max_concurrent_rpcs={cap}")
  address = cluster.start_syncer()
  yield address
  cluster.stop()


def _attacker(code: str) -> subprocess.Popen:
  """A Python process running `code` with the attack loops imported (experiments/benchmarks/attacks.py)."""
  prelude = "import collections, json, sys, threading, time\nfrom experiments.benchmarks import attacks\n"
  return subprocess.Popen([sys.executable, "-c", prelude + code], stdout=subprocess.PIPE, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _busy(client) -> bool:
  """Whether `client`'s learner has all its bulk slots held now (its pull refused 'busy', not retried long)."""
  try:
    client.pull(-1)
  except client_lib.SyncerUnreachable as error:
    assert "no bulk slot free for learner" in str(error)
    return True
  return False


def test_a_frozen_peer_holding_streams_loses_its_slots_to_keepalive_long_before_their_deadline(tight_syncer, params):
  address = tight_syncer
  payload_bytes = runconfig.max_payload_bytes(params)
  deadline = datachannel.transfer_seconds(payload_bytes)  # What would free the slots without keepalive.
  credential = security.learner_credential(SECRET, 1)
  # Learner 1's credential opens both of its bulk slots as Push streams that send a header, then nothing.
  attacker = _attacker(f"stop = threading.Event()\nfor _ in range(2):\n"
                       f"  threading.Thread(target=attacks.stalled_push, args=({address!r}, {credential!r}, 1, stop),"
                       f" kwargs=dict(payload_bytes={payload_bytes}), daemon=True).start()\n"
                       "print('holding', flush=True)\ntime.sleep(600)\n")
  try:
    assert attacker.stdout.readline().strip() == "holding"
    streams_from = time.monotonic()  # The streams opened after this: their deadlines end after streams_from + deadline.
    honest = _client(address, 1, retry_seconds=0.1)
    while not _busy(honest):  # Until both stalled streams hold their slot.
      assert time.monotonic() < streams_from + 30, "the stalled streams never took learner 1's slots"
    attacker.send_signal(signal.SIGSTOP)  # Frozen: its kernel still ACKs, but nothing answers gRPC's pings.
    frozen_at = time.monotonic()
    wait_for(lambda: not _busy(honest), 60, 0.2)
    freed = time.monotonic() - frozen_at
    # Keepalive frees them ~2 s after the freeze (a 1 s ping, a 1 s timeout), later on a loaded machine; without
    # it, at their deadline. The bound is that deadline's: a fixed one only measured the machine's load.
    assert frozen_at + freed < streams_from + deadline - 2.0, (freed, frozen_at - streams_from, deadline)
  finally:
    attacker.kill()
    attacker.wait()


def test_calls_beyond_the_cap_are_refused_at_once_while_an_honest_learner_gets_through(tight_syncer, params):
  address = tight_syncer
  credential = security.learner_credential(SECRET, 1)
  # 16 threads of learner 1's credential, each keeping 32 heartbeats in flight, for 12 s.
  attacker = _attacker("import grpc\nfrom decoupled_diloco.service import security, server, wire\n"
                       f"channel = grpc.insecure_channel({address!r})\n"
                       "beat = channel.unary_unary(f'/{server.SERVICE}/Heartbeat')\n"
                       "outcomes, lock, end = collections.Counter(), threading.Lock(), time.monotonic() + 12\n"
                       "def flood():\n"
                       "  while time.monotonic() < end:\n"
                       "    calls = [beat.future(wire.pack_header({'learner': 1}), timeout=20, "
                       f"metadata=security.call_metadata({credential!r})) for _ in range(32)]\n"
                       "    for call in calls:\n"
                       "      with lock:\n"
                       "        outcomes['OK' if call.exception() is None else call.exception().code().name] += 1\n"
                       "threads = [threading.Thread(target=flood) for _ in range(16)]\n"
                       "[t.start() for t in threads]\nprint('flooding', flush=True)\n[t.join() for t in threads]\n"
                       "print(json.dumps(outcomes), flush=True)\n")
  try:
    assert attacker.stdout.readline().strip() == "flooding"
    honest = _client(address, 0)
    begin = time.monotonic()
    status = honest.heartbeat()
    reply = _push(honest, params, status["acked_seq"] + 1, status["version"])
    honest_seconds = time.monotonic() - begin
    outcomes = json.loads(attacker.stdout.readline())
  finally:
    attacker.kill()
    attacker.wait()
  assert reply["status"] == "applied" and honest_seconds < 30, (reply, honest_seconds)
  assert outcomes.get("RESOURCE_EXHAUSTED", 0) > 0 and outcomes.get("OK", 0) > 0, outcomes


def test_a_full_log_disk_stops_the_syncer_process_and_its_restart_loses_nothing(params, tmp_path):
  """Real ENOSPC: the syncer's workdir is on an 8 MiB tmpfs that fills up (skipped where mounting needs root)."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
    pytest.skip("mounting a tmpfs needs root")
  workdir = disk / "run"
  workdir.mkdir()
  (tmp_path / "logs").mkdir()
  os.symlink(tmp_path / "logs", workdir / "logs")  # Its log lines must survive the full disk.
  cluster = _cluster(workdir)
  try:
    address = cluster.start_syncer()
    learners = [_client(address, m, retry_seconds=5.0) for m in range(2)]
    versions = [learner.join()[0]["version"] for learner in learners]
    acked = {}
    for seq in range(3):
      for m, learner in enumerate(learners):
        reply = _push(learner, params, seq, versions[m])
        assert reply["status"] == "applied"
        acked[m], versions[m] = seq, reply["version"]
    filler = _fill(str(workdir), leave_bytes=wire.encoded_size(wire.encode(_delta(params))) // 2)  # < one push.
    with pytest.raises(client_lib.SyncerUnreachable):  # UNAVAILABLE ('stopped'), then no syncer: retried, in vain.
      _push(learners[0], params, 3, versions[0])
    assert cluster.processes["syncer"].wait(timeout=30) == 1  # Fail-stop: exit 1.
    with open(tmp_path / "logs" / "syncer.log", encoding="utf-8") as f:
      assert re.search(r"error: the syncer stopped serving: .*No space left on device", f.read())
    os.remove(filler)  # The operator frees the disk and restarts it.
    cluster.start_syncer()
    for m, learner in enumerate(learners):
      status = learner.heartbeat()
      assert status["acked_seq"] == acked[m] and status["syncer_incarnation"] == 2  # Every ack kept.
    assert _push(learners[0], params, 3, versions[0])["status"] == "applied"  # The refused push, sent again.
    applied = [(r["learner"], r["seq"]) for r in _syncer_pushes(workdir) if r["accepted"]]
    assert sorted(applied) == sorted(set(applied)) and (0, 3) in applied  # Nothing applied twice.
  finally:
    cluster.stop()
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _errors(log_path) -> tuple[list[str], str]:
  """The `error:` lines of a process's log, and the whole log."""
  with open(log_path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  return [line for line in text.splitlines() if line.startswith("error:")], text


def test_a_learner_refused_for_good_leaves_a_diloco_run_that_merges_on_and_a_full_checkpoint_disk_costs_one_line(
    tmp_path):
  """Synchronous DiLoCo, 2 learners. Learner 1 (inner lr 1e30: every Δ overflows, every push refused) leaves the
  quorum at its first refusal and its process stops after service.max_refusals_in_a_row = 3 with one line, exit 1;
  learner 0 merges alone: the run's outer updates are the run's without learner 1 (its budget in H-step rounds).
  Before: learner 1 stayed in the quorum while it heartbeated, 1 outer update instead of 10, every exit 0.
  Learner 0's checkpoint disk is full (a tmpfs): each failed save costs it one line and it trains to the end;
  before, its first save crashed it in 46 lines of tracebacks."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
    pytest.skip("mounting a tmpfs needs root")
  workdir = tmp_path / "run"
  (workdir / "learner_0").mkdir(parents=True)
  os.symlink(disk, workdir / "learner_0" / "checkpoints")
  filler = _fill(str(disk), leave_bytes=8 << 10)
  cluster = _cluster(workdir, "--config.mode=diloco", "--config.outer.optimizer=sgd", "--config.outer.buffer_size=1",
                     "--config.syncer.quorum=0", "--config.syncer.min_learners_to_start=2", "--config.outer_steps=5",
                     "--config.service.max_refusals_in_a_row=3", "--config.service.linger_seconds=10")
  try:
    cluster.start_syncer(wait=False)
    cluster.start_learner(0)
    args = ("--role=learner", "--learner_id=1", f"--syncer={cluster.address}", "--config.inner.lr=1e30")
    cluster._spawn(  # pylint: disable=protected-access
        "learner_1",
        cluster._command(*args),  # pylint: disable=protected-access
        {**cluster.env, "DD_SYNCER_TOKEN": security.learner_credential(SECRET, 1)})
    assert cluster.processes["learner_1"].wait(timeout=600) == 1
    assert cluster.processes["syncer"].wait(timeout=600) == 0 and cluster.processes["learner_0"].wait(timeout=60) == 0
  finally:
    cluster.stop()
    os.remove(filler)
    subprocess.run(["umount", "-l", str(disk)], check=False)
  errors, log = _errors(workdir / "logs" / "learner_1.log")
  assert len(errors) == 1 and "refused its last 3 pushes in a row" in errors[0] and "Traceback" not in log, log[-3000:]
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  merges = [r for r in records if r["kind"] == "outer"]
  summary = [r for r in records if r["kind"] == "summary"][0]
  budget = 5 * 4 * 2  # outer_steps × H × M (tests/service_config.py: H = 4).
  assert summary["outer_updates"] == len(merges) == budget // 4 and all(r["learners"] == [0] for r in merges)
  _, log = _errors(workdir / "logs" / "learner_0.log")
  failed = [line for line in log.splitlines() if "checkpoint at step" in line and "failed" in line]
  assert len(failed) == budget // 4 // 3 and "Traceback" not in log, log[-3000:]  # learner_checkpoint_every = 3.


def test_a_replaced_learner_process_exits_at_once_in_one_line(tmp_path):
  """A learner process frozen (SIGSTOP) while its replacement joins wakes up fenced: before, it pushed on for good
  (216 refused pushes in 30 s); now its next push stops it with one line, exit 1, and the run ends with the
  replacement (its own local disk: another workdir, as on another machine). Learner 0 never starts (its lease
  runs out), so nothing spends the budget while learner 1's first process is frozen."""
  cluster = _cluster(tmp_path / "run", "--config.service.linger_seconds=10")  # Learner 0 never hears the end.
  elsewhere = tmp_path / "elsewhere"
  replacement = None
  try:
    cluster.start_syncer()
    cluster.start_learner(1)
    acks = tmp_path / "run" / "learner_1" / "metrics.jsonl"
    assert wait_for(lambda: acks.exists() and '"kind": "ack"' in acks.read_text(), 300, interval=0.5)
    zombie = cluster.processes["learner_1"]
    zombie.send_signal(signal.SIGSTOP)
    args = ("--role=learner", "--learner_id=1", f"--syncer={cluster.address}")
    command = cluster._command(*args)  # pylint: disable=protected-access
    replacement = subprocess.Popen(  # pylint: disable=consider-using-with
        [f"--workdir={elsewhere}" if arg.startswith("--workdir=") else arg for arg in command],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        env={**cluster.env, "DD_SYNCER_TOKEN": security.learner_credential(SECRET, 1)})
    joined = elsewhere / "learner_1" / "metrics.jsonl"
    assert wait_for(lambda: joined.exists() and '"kind": "ack"' in joined.read_text(), 300, interval=0.5)
    zombie.send_signal(signal.SIGCONT)
    assert zombie.wait(timeout=120) == 1
    assert replacement.wait(timeout=600) == 0 and cluster.processes["syncer"].wait(timeout=120) == 0
  finally:
    cluster.stop()
    if replacement is not None and replacement.poll() is None:
      replacement.kill()
  errors, log = _errors(tmp_path / "run" / "logs" / "learner_1.log")
  assert len(errors) == 1 and "learner 1 stops" in errors[0] and "has joined since" in errors[0], log[-3000:]
  assert "Traceback" not in log

"""The syncer service under hostile input: a real syncer process attacked over loopback.

The module starts one `experiments.train --role=syncer` process (tests/service_config.py,
bf16 pushes and a bf16 downlink) and drives it with the project's client and wire code and
with raw sockets, as a compromised learner (holding its own credential) or a stranger
would. Every attack must be refused, counted under its reason in the syncer's log, leave
the syncer's state as it was, and leave honest learners' calls unaffected. A few checks
of the same rules run on an in-process core where they need its insides (the quorum).
"""

import collections
import json
import os
import re
import socket
import threading
import time

import grpc
import jax
import ml_dtypes
import numpy as np
import pytest

from decoupled_diloco import compression
from decoupled_diloco import model as model_lib
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import datachannel, security, server as server_lib, wire
from experiments.benchmarks import attacks
from experiments.launch_local import LocalCluster
from tests import service_config
from tests.helpers import wait_for
from tests.test_datachannel import _serving
from tests.test_service_units import TOKEN, _core, _delta, _header, _push

CONFIG = "tests/service_config.py"
SECRET = "h" * 32


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
  """(address, log path, LocalCluster) of a real syncer process; stopped after the module."""
  workdir = str(tmp_path_factory.mktemp("hostile"))
  cluster = LocalCluster(CONFIG, workdir, [
      "--config.compression.format=bf16", "--config.compression.downlink_format=bf16", "--config.service.data_port=0",
      "--config.syncer.min_learners_to_start=1"], 2, env=dict(os.environ, DD_SYNCER_TOKEN=SECRET))
  address = cluster.start_syncer()
  yield address, os.path.join(workdir, "logs", "syncer.log"), cluster
  cluster.stop()


@pytest.fixture(scope="module")
def params():
  config = service_config.get_config()
  return jax.device_get(model_lib.build_model(config.model, config.seed)[1])


def _client(address, learner, token=None, **options):
  return client_lib.SyncerClient(address, token or security.learner_credential(SECRET, learner), learner,
                                 chunk_bytes=64 << 10, timeout_seconds=20, retry_seconds=30, **options)


def _state(address):
  """What the syncer holds, as the run secret sees it: version(s), each learner's acked seq, steps left, Θ."""
  statuses = [_client(address, m, SECRET).join() for m in range(2)]
  (first, theta), (second, _) = statuses
  leaves = [np.asarray(x) for x in jax.tree.leaves(theta)]
  return (first["version"], tuple(first["versions"]), first["acked_seq"], second["acked_seq"],
          first["steps_left"]), leaves


def _same_state(before, after):
  return before[0] == after[0] and all(np.array_equal(a, b) for a, b in zip(before[1], after[1]))


def _refusals(log):
  """How many refusals of each reason the syncer has logged so far."""
  with open(log, encoding="utf-8", errors="replace") as f:
    return collections.Counter(re.findall(r"refused \((\w+)\)", f.read()))


def _bf16_push(client, params, seq, base_version, steps=1):
  client.incarnation = client.heartbeat()["incarnation"]  # _state's joins start new incarnations.
  delta = jax.tree.leaves(_delta(params, 0.01))
  packed = compression.encode(compression.Codec("bf16"), delta)
  packed = packed._replace(leaves=jax.device_get(packed.leaves))
  return client.push(seq, packed, base_version=base_version, tokens=64 * steps, local_steps=steps, compute_seconds=0.1)


def _next_seq(address, learner):
  return _client(address, learner, SECRET).heartbeat()["acked_seq"] + 1


def _port_of_data(address):
  """The data channel's port (the syncer picked it): a ticket says."""
  return attacks.ticket(address, attacks.push_header(0, 8), SECRET)["port"]


def test_bf16_pushes_apply_and_theta_comes_back_in_bf16(syncer, params):
  address, _, _ = syncer
  honest = _client(address, 0, data_channel=True)
  status, _ = honest.join()
  reply = _bf16_push(honest, params, _next_seq(address, 0), status["version"])
  assert reply["status"] == "applied" and reply["version"] == status["version"] + 1
  with grpc.insecure_channel(address, options=server_lib.message_options(64 << 10)) as channel:
    replies = channel.unary_stream(f"/{server_lib.SERVICE}/Pull")(wire.pack_header({
        "learner": 0, "fragment": 0, "have_version": -1}), timeout=20, metadata=security.call_metadata(SECRET))
    header = wire.parse_header(next(replies), client_lib.STATUS_SCHEMA)
    theta = wire.decode(wire.assemble(replies, header["payload_bytes"], 1 << 30, 64 << 10))
  fp32_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
  assert all(x.dtype == ml_dtypes.bfloat16 for x in jax.tree.leaves(theta))
  assert header["payload_bytes"] < 0.6 * fp32_bytes  # Half the bytes (plus the skeleton).
  _, widened = honest.pull(-1)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(widened))
  assert all(np.array_equal(a.astype(np.float32), b) for a, b in zip(jax.tree.leaves(theta), jax.tree.leaves(widened)))


def _refused(call, code, text=""):
  with pytest.raises(grpc.RpcError) as error:
    call()
  assert error.value.code() == code and text in error.value.details(), (error.value.code(), error.value.details())


def test_a_learner_credential_acts_for_its_learner_only(syncer, params):
  address, log, _ = syncer
  before, counted = _state(address), _refusals(log)
  mallory = _client(address, 1)  # Learner 1's own credential, naming learner 0.
  as_zero = client_lib.SyncerClient(address, security.learner_credential(SECRET, 1), 0, chunk_bytes=64 << 10,
                                    timeout_seconds=20, retry_seconds=5)
  _refused(as_zero.heartbeat, grpc.StatusCode.PERMISSION_DENIED, "learner 1 cannot act as learner 0")
  _refused(as_zero.join, grpc.StatusCode.PERMISSION_DENIED)
  _refused(lambda: _bf16_push(as_zero, params, before[0][2] + 1, before[0][0]), grpc.StatusCode.PERMISSION_DENIED)
  data_as_zero = client_lib.SyncerClient(address, security.learner_credential(SECRET, 1), 0, chunk_bytes=64 << 10,
                                         timeout_seconds=20, retry_seconds=5, data_channel=True)
  _refused(lambda: _bf16_push(data_as_zero, params, before[0][2] + 1, before[0][0]), grpc.StatusCode.PERMISSION_DENIED)
  _refused(lambda: _client(address, 0, token="w" * 64).heartbeat(), grpc.StatusCode.UNAUTHENTICATED)
  assert mallory.heartbeat()["acked_seq"] == before[0][3]  # Its own calls still work.
  assert _same_state(before, _state(address))
  now = _refusals(log)
  assert now.get("impersonation", 0) - counted.get("impersonation", 0) == 4
  assert now.get("unauthenticated", 0) - counted.get("unauthenticated", 0) == 1


@pytest.mark.parametrize("fields, text", [({"tokens": 2**62}, "tokens="), ({"tokens": 65}, "batch × seq_len"),
                                          ({"local_steps": 10**12}, "steps it can have taken"),
                                          ({"budget_steps": 10**12}, "budget_steps="), ({"seq": 2**62}, "beyond"),
                                          ({"seq": 65}, "beyond")])
def test_header_values_beyond_their_bounds_are_refused_before_anything_is_applied(syncer, params, fields, text):
  address, log, _ = syncer
  before, counted = _state(address), _refusals(log)
  seq = before[0][3] + 1
  header = attacks.push_header(1, 8, seq=seq)
  header.update({"seq": seq + fields["seq"]} if "seq" in fields else fields)
  credential = security.learner_credential(SECRET, 1)
  _refused(lambda: attacks.ticket(address, header, credential), grpc.StatusCode.INVALID_ARGUMENT, text)
  with grpc.insecure_channel(address) as channel:
    push = channel.stream_unary(f"/{server_lib.SERVICE}/Push")
    _refused(
        lambda: push(iter([wire.pack_header(header), bytes(8)]), metadata=security.call_metadata(credential), timeout=20
                    ), grpc.StatusCode.INVALID_ARGUMENT, text)
  assert _same_state(before, _state(address))
  assert _refusals(log)["out_of_bounds"] - counted.get("out_of_bounds", 0) == 2
  # Learner 1's honest next push is applied, not taken for a duplicate.
  assert _bf16_push(_client(address, 1), params, seq, before[0][0])["status"] == "applied"


def test_shapes_that_overflow_int64_are_invalid_argument_and_counted(syncer):
  address, log, _ = syncer
  before, counted = _state(address), _refusals(log)
  payload = attacks.overflowing_payload()
  header = attacks.push_header(0, len(payload), seq=before[0][2] + 1)
  with grpc.insecure_channel(address) as channel:
    push = channel.stream_unary(f"/{server_lib.SERVICE}/Push")
    _refused(
        lambda: push(iter([wire.pack_header(header), payload]), metadata=security.call_metadata(
            security.learner_credential(SECRET, 0)), timeout=20), grpc.StatusCode.INVALID_ARGUMENT, "needs")
  assert _refusals(log)["malformed"] - counted.get("malformed", 0) == 1
  assert _same_state(before, _state(address))


def test_floods_trickles_and_stalled_streams_leave_honest_pushes_and_heartbeats_alone(syncer, params):
  address, log, _ = syncer
  data_port = _port_of_data(address)
  host = address.rsplit(":", 1)[0]
  credential = security.learner_credential(SECRET, 1)  # The attacker is learner 1, gone bad.
  honest = _client(address, 0, data_channel=True)
  beat = _client(address, 0)
  beat.heartbeat(retry=False)  # Connected before the attack: what is timed below is the syncer's answer.
  stop = threading.Event()
  results = {}

  def attack(name, function):
    results.setdefault(name, []).append(function())

  threads = [
      threading.Thread(target=attack, args=("flood", lambda: attacks.reconnect_flood(host, data_port, stop)))
      for _ in range(8)]
  threads += [
      threading.Thread(target=attack,
                       args=("idle", lambda: attacks.reconnect_flood(host, data_port, stop, hold_seconds=30)))
      for _ in range(8)]
  trickle = threading.Thread(
      target=attack,
      args=("trickle", lambda: attacks.slow_sender(address, data_port, credential, 1, stop, max_count=1)))
  threads.append(trickle)
  threads += [
      threading.Thread(
          target=attack,
          args=("stalled",
                lambda: attacks.stalled_push(address, credential, 1, stop, payload_bytes=8 << 10, max_count=3)))
      for _ in range(6)]
  for thread in threads:
    thread.start()
  try:
    time.sleep(1.0)
    heartbeat_seconds, push_seconds = [], []
    for _ in range(3):
      begin = time.monotonic()
      beat.heartbeat(retry=False)
      heartbeat_seconds.append(time.monotonic() - begin)
      status, _ = honest.join()
      begin = time.monotonic()
      assert _bf16_push(honest, params, _next_seq(address, 0), status["version"])["status"] == "applied"
      push_seconds.append(time.monotonic() - begin)
    # Past the trickle's and the stalled streams' whole-call deadlines (~10 s from when each got its slot,
    # later on a loaded machine): attackers stopped earlier end their streams themselves, which is not
    # what this test checks. The trickle's thread ends once the syncer has cut it (max_count=1).
    wait_for(lambda: not trickle.is_alive() and _refusals(log).get("too_slow", 0) >= 2, 45.0, 0.5)
  finally:
    stop.set()
    for thread in threads:
      thread.join(timeout=60)
  # A heartbeat queued behind the stalled streams would wait for their ~10 s deadlines; the attackers'
  # 23 threads share this process's GIL with the timed calls, hence the margin.
  assert max(heartbeat_seconds) < 4.0 and max(push_seconds) < 10.0, (heartbeat_seconds, push_seconds)
  refused = _refusals(log)
  assert refused.get("too_slow", 0) >= 2 and refused.get("busy", 0) >= 1 and refused.get("evicted", 0) >= 1, refused
  assert sum(r["CLOSED"] for r in results["trickle"]) == 1  # Cut off by its deadline, not left to hang.


def test_a_refused_push_neither_renews_the_lease_nor_readmits_an_excluded_learner(params, tmp_path):
  core = _core(params, tmp_path, quorum=2, lease=30.0)
  start = time.time()
  core.tick(start + 31.0)  # Both silent: nobody is excluded while every learner is.
  core.last_seen[0] = start + 40.0
  core.tick(start + 62.0)  # Learner 1 silent for over the lease: excluded.
  assert core.syncer.learners == {0} and core.syncer.quorum == 1
  seen = core.last_seen[1]
  nan = jax.tree.map(lambda x: np.full(x.shape, np.nan, np.float32), _delta(params))
  payload = bytearray(b"".join(wire.encode(nan)))
  for header in (_header(learner=1, payload_bytes=len(payload)),
                 _header(learner=1, local_steps=4, tokens=64, payload_bytes=len(payload), base_version=5)):
    with pytest.raises(Exception, match="NaN|future"):
      core.push(header, payload, start + 63.0)
    assert core.syncer.learners == {0} and core.last_seen[1] == seen and core.syncer.quorum == 1
  assert _push(core, params, 1, 0)["status"] == "applied" and core.syncer.learners == {0, 1}
  core.close()


def test_a_learner_streams_over_grpc_when_the_data_channel_keeps_failing(params, tmp_path):
  core = _core(params, tmp_path)
  with _serving(core) as (server, address):
    server.data.stop()  # Tickets are still issued; their connections are refused.
    learner = client_lib.SyncerClient(address, TOKEN, 0, chunk_bytes=1 << 16, timeout_seconds=10, retry_seconds=20,
                                      data_channel=True)
    reply = learner.push(0, _delta(params), base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
    assert reply["status"] == "applied" and learner.retries == client_lib.DATA_FAILURES_BEFORE_STREAMING
  core.close()


def test_idle_connections_are_evicted_oldest_first_and_a_ticketed_push_gets_through(params, tmp_path):
  core = _core(params, tmp_path)
  with _serving(core) as (server, address):
    data = ("127.0.0.1", server.data.port)
    idle = [socket.create_connection(data, timeout=5) for _ in range(server.data.per_source + 1)]
    assert idle[0].recv(1) == b""  # The oldest was shut when one too many came from this source.
    client = client_lib.SyncerClient(address, TOKEN, 0, chunk_bytes=1 << 16, timeout_seconds=10, retry_seconds=20,
                                     data_channel=True)
    assert client.push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                       compute_seconds=0.1)["status"] == "applied" and client.retries == 0
    assert server.rejections["evicted"] >= 1 and "truncated" not in server.rejections
    for connection in idle:
      connection.close()
  core.close()


def test_a_trickled_payload_is_cut_off_by_its_transfer_deadline(params, tmp_path, monkeypatch):
  monkeypatch.setattr(datachannel, "HANDSHAKE_SECONDS", 1.0)
  core = _core(params, tmp_path)
  with _serving(core) as (server, address):
    granted = attacks.ticket(address, _header(payload_bytes=1 << 10), TOKEN)
    begin = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.data.port), timeout=30) as connection:
      connection.sendall(bytes.fromhex(granted["ticket"]))
      with pytest.raises(OSError):
        for _ in range(100):
          connection.sendall(b"\0")
          time.sleep(0.1)
        raise AssertionError("a trickle of 1 byte / 0.1 s was never cut off")
    assert time.monotonic() - begin < datachannel.transfer_seconds(1 << 10) + 3
    assert server.rejections["too_slow"] == 1 and core.acked == {0: -1, 1: -1}
  core.close()


def test_a_stalled_grpc_push_is_cut_off_by_its_deadline_and_logs_nothing(params, tmp_path, monkeypatch):
  """The gRPC fallback streams a push into the spool as the data channel does: a stream that stalls after its
  header is cancelled at its whole-call deadline, counted as too_slow, and neither logged nor applied."""
  monkeypatch.setattr(datachannel, "HANDSHAKE_SECONDS", 1.0)
  core = _core(params, tmp_path)
  log_dir = os.path.join(str(tmp_path), "wal")
  before = {name: os.path.getsize(os.path.join(log_dir, name)) for name in os.listdir(log_dir)}
  stop = threading.Event()
  with _serving(core) as (server, address):
    begin = time.monotonic()
    try:
      outcomes = attacks.stalled_push(address, TOKEN, 0, stop, payload_bytes=8 << 10, max_count=1)
    finally:
      stop.set()
    assert time.monotonic() - begin < datachannel.transfer_seconds(8 << 10) + 3
    assert sum(outcomes.values()) == 1 and "OK" not in outcomes, outcomes
    # The client hears of the cancel before the handler's thread counts it.
    wait_for(lambda: server.rejections["too_slow"], 5.0, 0.05)
    assert server.rejections["too_slow"] == 1 and core.acked == {0: -1, 1: -1}
  assert {name: os.path.getsize(os.path.join(log_dir, name)) for name in os.listdir(log_dir)} == before
  core.close()


def _environment_after_exec(pid, seconds=30):
  """The process's environment once it runs its own program (right after fork it is still the parent's)."""
  deadline = time.monotonic() + seconds
  while True:
    with open(f"/proc/{pid}/environ", "rb") as f:
      environment = dict(entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry)
    if b"DD_SYNCER_TOKEN" in environment or time.monotonic() > deadline:
      return environment
    time.sleep(0.05)


def test_real_learners_with_their_own_credentials_finish_the_bf16_run_after_the_attacks(syncer):
  """Last: learner processes (bf16 pushes, bf16 Θ, each with its own credential from launch_local) spend the
  budget on the syncer the attacks above hit; every push they saw acknowledged was applied."""
  address, log, cluster = syncer
  for index in range(2):
    cluster.start_learner(index)
    environment = _environment_after_exec(cluster.processes[f"learner_{index}"].pid)
    assert environment[b"DD_SYNCER_TOKEN"].decode() == security.learner_credential(SECRET, index) != SECRET
  codes = cluster.wait(400)
  assert codes == {"syncer": 0, "learner_0": 0, "learner_1": 0}, codes
  records = [json.loads(line) for line in open(os.path.join(cluster.workdir, "metrics.jsonl"), encoding="utf-8")]
  summary, = [r for r in records if r["kind"] == "summary"]
  assert summary["done"] and summary["steps_done"] >= 80
  for index in range(2):
    with open(os.path.join(cluster.workdir, f"learner_{index}", "metrics.jsonl"), encoding="utf-8") as f:
      acks = [json.loads(line) for line in f if '"ack"' in line]
    assert acks and all(a["status"] != "refused" for a in acks), acks
  logged = _refusals(log)  # Each kind below was refused fewer than 20 times a minute: logged one by one.
  assert {k: summary["refused_calls"].get(k, 0) for k in ("impersonation", "out_of_bounds", "malformed")
         } == {k: logged.get(k, 0) for k in ("impersonation", "out_of_bounds", "malformed")}

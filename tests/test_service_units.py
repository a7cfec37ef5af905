"""The service's parts in one process: wire format, write-ahead log, exactly-once core, TLS."""

import datetime
import ipaddress
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import grpc
import jax
import numpy as np
import pytest

from decoupled_diloco import compression, fragments, model as model_lib, outer
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import server as server_lib
from decoupled_diloco.service import security, wal, wire
from decoupled_diloco.push import PushRejected
from decoupled_diloco.syncer import Settings, Syncer
from tests import service_config

TOKEN = "t" * 32


@pytest.fixture(scope="module")
def params():
  return model_lib.build_model(service_config.get_config().model, 0)[1]


def _header(**fields):
  base = {
      "learner": 0, "seq": 0, "base_version": 0, "fragment": 0, "tokens": 64, "local_steps": 4, "budget_steps": 4,
      "budget_tokens": 64, "compute_seconds": 0.1, "payload_bytes": 0, "incarnation": 0}
  return {**base, **fields}


def _core(params, directory, quorum=2, lease=30.0, every=2, emit=None):
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=quorum))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(directory), checkpoint_every_merges=every,
                             lease_seconds=lease, metadata={}, emit=emit)
  core.start(time.time())
  return core


def _delta(params, value=0.01):
  return jax.tree.map(lambda x: np.full(x.shape, value, np.float32), params)


def _push(core, params, learner, seq, value=0.01, base=None, incarnation=0):
  payload = bytearray(b"".join(wire.encode(_delta(params, value))))
  header = _header(learner=learner, seq=seq, base_version=core.syncer.version if base is None else base,
                   payload_bytes=len(payload), incarnation=incarnation)
  return core.push(header, payload, time.time())


def _leaves_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_wire_round_trips_trees_and_compressed_payloads(params):
  tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": {"c": np.zeros((0,), np.int8), "d": None}}
  parts = wire.encode(tree)
  data = b"".join(wire.chunks(parts, 7))
  assert len(data) == wire.encoded_size(parts)
  back = wire.decode(wire.assemble(iter(wire.chunks(parts, 7)), len(data), 1 << 20, 7))
  assert back["b"]["d"] is None and np.array_equal(back["a"], tree["a"]) and back["b"]["c"].dtype == np.int8
  codec = compression.Codec("int8")
  packed = compression.encode(codec, jax.tree.leaves(params))
  again = wire.decode(b"".join(wire.encode(packed)))
  assert isinstance(again, compression.Compressed) and again.shapes == packed.shapes
  assert all(_leaves_equal(x, y) for x, y in zip(compression.decode(codec, again), compression.decode(codec, packed)))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d[:3], "shorter than its length prefix"),
        (lambda d: d + b"x", "array bytes"),
        (lambda d: d[:-1], "needs"),
        (lambda d: b"\xff\xff\x00\x00" + d[4:], "skeleton length"),
        (lambda d: d[:63] + b"\x01" + d[64:], "zero padding"),  # Bytes hidden between skeleton and arrays.
    ])
def test_wire_rejects_malformed_payloads(mutate, message):
  data = b"".join(wire.encode({"w": np.ones((4, 4), np.float32)}))
  with pytest.raises(wire.WireError, match=message):
    wire.decode(mutate(data))


def test_wire_rejects_bad_streams_and_headers():
  with pytest.raises(wire.PayloadTooLarge):
    wire.assemble(iter([]), 10, 5, 4)
  with pytest.raises(wire.WireError, match="ended after 4"):
    wire.assemble(iter([b"abcd"]), 8, 100, 4)
  with pytest.raises(wire.WireError, match="more than"):
    wire.assemble(iter([b"abcd", b"ef"]), 5, 100, 4)
  with pytest.raises(wire.PayloadTooLarge):
    wire.assemble(iter([b"abcdef"]), 6, 100, 4)
  with pytest.raises(wire.WireError, match="fields"):
    wire.parse_header(wire.pack_header({"learner": 0}), {"learner": int, "seq": int})
  with pytest.raises(wire.WireError, match="expected int"):
    wire.parse_header(wire.pack_header({"learner": True}), {"learner": int})
  with pytest.raises(wire.WireError, match="not msgpack"):
    wire.parse_header(b"\xc1", {"learner": int})
  with pytest.raises(wire.WireError, match="cannot go on the wire"):
    wire.encode({"x": np.zeros(2, np.complex64)})


def test_log_drops_a_torn_tail(tmp_path):
  log = wal.Log(str(tmp_path), 0)
  log.append({"type": "push", "n": 1}, b"payload")
  log.append({"type": "push", "n": 2}, b"more")
  log.close()
  path = wal.segment_path(str(tmp_path), 0)
  with open(path, "ab") as f:
    f.write(b"\x05\x00\x00")  # A crash mid-append.
  assert [r["n"] for r, _ in wal.read_segment(path)] == [1, 2]
  log = wal.Log(str(tmp_path), 0)
  log.append({"type": "push", "n": 3})
  log.close()
  records = wal.read_segment(path)
  assert [r["n"] for r, _ in records] == [1, 2, 3] and bytes(records[0][1]) == b"payload"


def test_core_applies_each_push_once_and_replays_exactly_after_a_crash(params, tmp_path):
  records = []
  core = _core(params, tmp_path, emit=records.append)
  for seq in range(3):  # 3 merges (quorum 2): checkpoints at versions 0 and 2, the rest in the log.
    assert _push(core, params, 0, seq)["status"] == "applied"
    assert _push(core, params, 1, seq, value=0.02)["status"] == "applied"
    assert core.store.checkpointer.latest_step() == 2 * (seq // 2)  # Due after 2 merges, but not taken by a push...
    core.tick(time.time())  # ...the service's next tick takes it.
  assert _push(core, params, 0, 3)["status"] == "applied"  # Pending at the crash.
  assert _push(core, params, 0, 3)["status"] == "duplicate"
  assert core.counts["duplicates"] == 1
  before, version, acked, steps = jax.device_get(core.syncer.params), core.syncer.version, dict(core.acked), \
      core.steps_done
  core.store.log.close()  # SIGKILL: no checkpoint, only what the log holds.
  core.store.checkpointer.close()
  kept = [r for r in records if r["outer_step"] <= 2]  # What the restarted writer keeps (checkpoint 2).
  again = _core(params, tmp_path, emit=kept.append)
  assert (again.syncer.version, again.acked, again.steps_done) == (version, acked, steps) == (3, {0: 3, 1: 2}, 28)
  assert _leaves_equal(before, again.syncer.params)
  assert len(again.syncer.pending) == 1
  assert _push(again, params, 0, 3)["status"] == "duplicate"
  reply = _push(again, params, 1, 3, value=0.02)  # Completes the pending merge.
  assert reply["status"] == "applied" and reply["version"] == 4
  pushes = sorted((r["learner"], r["seq"]) for r in kept if r["kind"] == "push")
  assert pushes == [(m, s) for m in range(2) for s in range(4)]  # Every applied push recorded once.
  assert [r["outer_step"] for r in kept if r["kind"] == "outer"] == [1, 2, 3, 4]
  again.close()


def test_core_reports_the_fastest_other_learners_measured_speed(params, tmp_path):
  core = _core(params, tmp_path)
  assert core.status(0)["max_speed"] == 0.0  # Nobody has pushed: no measurement yet.
  for seq in range(4):  # 4 local steps in 0.1 compute-seconds: 40 steps/s, the median of the last three (the first
    _push(core, params, 0, seq)  # compiles: service/pace.py).
  assert core.status(1)["max_speed"] == pytest.approx(40.0)  # DyLU's reference for learner 1...
  assert core.status(0)["max_speed"] == 0.0  # ...but not for learner 0, who knows its own speed.
  core.close()


def test_core_remembers_across_restarts_who_heard_the_run_is_over(params, tmp_path):
  core = _core(params, tmp_path)
  core.budget_steps = 8
  _push(core, params, 0, 0)
  _push(core, params, 1, 0)  # Spends the budget: the run is done, but a push's reply does not count as heard
  core.pull(1, 0, -1, time.time())  # (learner 1 may have final pushes on their way); its pull after them does.
  assert core.done and core.told_done == {1} and not core.all_told_done()
  core.heartbeat(0, time.time())  # A side thread's heartbeat does not count...
  assert core.told_done == {1}
  core.pull(0, 0, -1, time.time())  # ...the learner's own call does.
  core.store.log.close()
  core.store.checkpointer.close()
  again = _core(params, tmp_path)
  assert again.done and again.all_told_done()
  again.close()


def test_core_rejects_bad_pushes_without_touching_state(params, tmp_path):
  core = _core(params, tmp_path)
  before = jax.device_get(core.syncer.params)
  with pytest.raises(PushRejected, match="NaN"):
    _push(core, params, 0, 0, value=np.nan)
  with pytest.raises(PushRejected, match="future"):
    _push(core, params, 0, 0, base=5)
  with pytest.raises(core_lib.UnknownLearner):
    _push(core, params, 9, 0)
  bad = bytearray(b"".join(wire.encode({"not": np.zeros(3, np.float32)})))
  with pytest.raises(PushRejected, match="structure"):
    core.push(_header(payload_bytes=len(bad)), bad, time.time())
  assert core.counts["rejected"] == 4 and core.acked == {0: -1, 1: -1} and core.syncer.version == 0
  assert _leaves_equal(before, core.syncer.params)
  core.close()


def test_core_lease_excludes_a_silent_learner_and_it_rejoins(params, tmp_path):
  core = _core(params, tmp_path, quorum=2, lease=1.0)
  _push(core, params, 0, 0)
  assert core.syncer.version == 0  # Waiting for learner 1.
  now = time.time()
  core.last_seen[0], core.last_seen[1] = now, now - 5.0  # Learner 0 just called; learner 1 is silent.
  core.tick(now)  # The quorum shrinks to learner 0, whose push merges.
  assert core.syncer.version == 1 and core.syncer.learners == {0} and core.counts["excluded"] == 1
  core.heartbeat(1, time.time())
  assert core.syncer.learners == {0, 1} and core.syncer.quorum == 2
  core.close()


def _self_signed(directory):
  """A certificate for 127.0.0.1 / localhost, made here with `cryptography`."""
  x509 = pytest.importorskip("cryptography.x509", reason="TLS test needs the cryptography package")
  from cryptography.hazmat.primitives import hashes, serialization  # pylint: disable=g-import-not-at-top
  from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=g-import-not-at-top
  from cryptography.x509.oid import NameOID  # pylint: disable=g-import-not-at-top
  key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key()).serial_number(
      x509.random_serial_number()).not_valid_before(now - datetime.timedelta(
          minutes=1)).not_valid_after(now + datetime.timedelta(days=1)).add_extension(
              x509.SubjectAlternativeName([
                  x509.DNSName("localhost"),
                  x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
              False).add_extension(x509.BasicConstraints(ca=True, path_length=None),
                                   critical=True).sign(key, hashes.SHA256()))
  cert_file, key_file = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
  with open(cert_file, "wb") as f:
    f.write(cert.public_bytes(serialization.Encoding.PEM))
  with open(key_file, "wb") as f:
    f.write(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
  return cert_file, key_file


def test_tls_serves_trusting_clients_and_refuses_plaintext(params, tmp_path):
  cert_file, key_file = _self_signed(str(tmp_path))
  core = _core(params, tmp_path / "run")
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16,
                                   max_payload_bytes=1 << 24,
                                   credentials=security.server_credentials(cert_file, key_file))
  port = server.start()
  try:
    trusted = client_lib.SyncerClient(f"127.0.0.1:{port}", TOKEN, 0, chunk_bytes=1 << 16, timeout_seconds=10,
                                      retry_seconds=5, credentials=security.channel_credentials(cert_file))
    status, theta = trusted.join()
    assert status["version"] == 0 and _leaves_equal(theta, params)
    assert trusted.push(0, _delta(params), base_version=0, tokens=64, local_steps=4,
                        compute_seconds=0.1)["status"] == "applied"
    plain = client_lib.SyncerClient(f"127.0.0.1:{port}", TOKEN, 1, chunk_bytes=1 << 16, timeout_seconds=2,
                                    retry_seconds=0.5)
    with pytest.raises((client_lib.SyncerUnreachable, grpc.RpcError)):
      plain.heartbeat()
    wrong = client_lib.SyncerClient(f"127.0.0.1:{port}", "w" * 32, 1, chunk_bytes=1 << 16, timeout_seconds=10,
                                    retry_seconds=5, credentials=security.channel_credentials(cert_file))
    with pytest.raises(grpc.RpcError) as refused:
      wrong.heartbeat()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.rejections["unauthenticated"] == 1
  finally:
    server.stop()
    core.close()


SERVICE_BENCHMARKS = {  # Flags of a toy run, and the keys: exactly the last line's.
    "transport": (["--megabytes=2", "--chunk_bytes=262144", "--blocks=1"], {"ratio", "pull_ratio"}),
    "merge_throughput": (["--params=80000", "--blocks=1"], {"ratio"}),
    "learner_blocking": (["--outer_steps=1", "--inner_steps=2"], {"blocked_fraction"}),}


@pytest.mark.slow
@pytest.mark.parametrize("benchmark", list(SERVICE_BENCHMARKS))
def test_service_benchmarks_run_end_to_end(benchmark):
  """Tiny sizes: the benchmark's own client, server, syncer and learner processes still fit together."""
  flags, keys = SERVICE_BENCHMARKS[benchmark]
  result = subprocess.run([sys.executable, "-m", f"experiments.benchmarks.{benchmark}", *flags],
                          cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  context, last = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")][-2:]
  assert set(last) == keys
  if benchmark == "learner_blocking":  # Two learners' accounting; the budget's 4 steps are 2 rounds of H = 2.
    assert 0 <= last["blocked_fraction"] <= 1 and len(context["rounds"]) == 2 and sum(context["rounds"]) >= 2, context
  else:
    assert context["benchmark"] == benchmark and last["ratio"] >= 0 and context["bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("transport, params", [("data", 8_000_000), ("grpc", 1_000_000)])
def test_a_push_is_never_whole_in_the_syncers_memory(transport, params):
  """syncer_memory at 8M params (32 MB pushes in 3.2 MB tensors) in child processes: the peak is Θ + momentum +
  sums + about one tensor (~12.4 B/param), not the 16 B/param of a whole receive buffer. Over gRPC
  (service.data_port=-1) at a toy size, only that every push is applied and merges: its ~40 MB of 4 MB messages in
  flight are 40 B/param at 1M params (the benchmark's figure at 100M is 12.6, docs/syncer-memory.md)."""
  result = subprocess.run([
      sys.executable, "-m", "experiments.benchmarks.syncer_memory", f"--params={params}", "--counts=2",
      f"--transport={transport}"], cwd=pathlib.Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  context, last = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")][-2:]
  assert set(last) == {"host_bytes_per_param"} and set(context["int4_host_bytes_per_param"]) == {"2"}, last
  if transport == "data":
    # 15, not 14: at 8M params 1 B/param is 8 MB of the process's own noise (int4 read 14.88 once in five runs).
    assert last["host_bytes_per_param"]["2"] < 15 and context["int4_host_bytes_per_param"]["2"] < 15, (last, context)
    # A checkpoint's save holds Θ and momentum, no copy (orbax's zstd added ~7 B/param at 100M).
    assert context["checkpoint_bytes_per_param"]["2"] < 11, context


def test_a_restarted_syncer_keeps_the_grace_window_estimates(params, tmp_path):
  """ξ_step / ξ_quorum / ξ_sync are checkpointed with the syncer (docs/syncer.md, "Grace window"):
  a restart from a checkpoint that carries no push does not start learning them from zero."""
  core = _core(params, tmp_path, quorum=0, every=1)
  _push(core, params, 0, 0)
  _push(core, params, 1, 0)  # Both learners: a merge, then a checkpoint with nothing carried.
  core.syncer.observe_sync_seconds(0.25)
  core.tick(time.time())  # The due checkpoint.
  estimates = core.syncer.estimates
  core.close()
  assert estimates["step"] == pytest.approx(0.1 / 4) and estimates["sync"] == 0.25
  restarted = _core(params, tmp_path, quorum=0)
  assert restarted.syncer.version == 1 and restarted.syncer.estimates == estimates
  restarted.close()


def test_after_the_budget_a_push_of_counted_steps_is_merged_and_one_of_uncounted_steps_is_late(params, tmp_path):
  """P = 2: the budget counts each push's budget_steps; a push that arrives after the end with none (the
  progress on fragment 1 of steps an earlier push counted) is merged, not dropped as late."""
  assignment = fragments.partition(params, 2, "balanced")
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=2),
                  assignment=assignment)
  core = core_lib.SyncerCore(syncer, 2, budget_steps=8, directory=str(tmp_path), checkpoint_every_merges=10,
                             lease_seconds=30.0, metadata={})
  core.start(time.time())

  def push(learner, seq, fragment, budget_steps=4):
    payload = bytearray(b"".join(wire.encode(fragments.select(_delta(params), assignment, fragment))))
    header = _header(learner=learner, seq=seq, fragment=fragment, base_version=core.syncer.versions[fragment],
                     payload_bytes=len(payload), budget_steps=budget_steps, budget_tokens=64 * budget_steps // 4)
    return core.push(header, payload, time.time())["status"]

  assert [push(0, 0, 0), push(1, 0, 0)] == ["applied", "applied"]  # 8 steps: the budget is spent.
  assert core.done and core.syncer.versions == (1, 0)
  assert push(1, 1, 1, budget_steps=0) == "applied" and core.syncer.versions == (1, 1)  # Merged at once.
  assert push(0, 1, 1) == "late" and core.counts["late"] == 1
  core.close()


@pytest.mark.parametrize("timeout, joining, timed_out", [(30.0, [0, 1], 0), (3.0, [0], 1)])
def test_joins_wait_at_the_start_barrier_until_enough_learners_or_the_timeout(params, tmp_path, timeout, joining,
                                                                              timed_out):
  """syncer.min_learners_to_start: no learner starts before the others joined (docs/syncer.md), or until
  the timeout, which is reported in a 'start' record."""
  records = []
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=2))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(tmp_path), checkpoint_every_merges=10,
                             lease_seconds=30.0, metadata={}, emit=records.append, min_learners_to_start=2,
                             start_timeout_seconds=timeout)
  core.start(time.time())
  returned = {}
  threads = [
      threading.Thread(target=lambda m=m: returned.setdefault(m, (core.join(m, time.time()), time.time())))
      for m in joining]
  threads[0].start()
  time.sleep(0.3)
  assert not returned and not core.barrier.started  # Learner 0 waits at the barrier.
  for thread in threads[1:]:
    thread.start()
  for thread in threads:
    thread.join(timeout=10)
  assert sorted(returned) == joining and core.barrier.started
  starts = [r for r in records if r["kind"] == "start"]
  assert len(starts) == 1 and starts[0]["learners"] == joining and starts[0]["timed_out"] == timed_out
  core.close()

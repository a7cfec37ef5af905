r"""Syncer host memory: peak bytes per parameter at the syncer while M pushes arrive for one merge.

  python -m experiments.benchmarks.syncer_memory [--params=100000000] [--counts=1,2,4,8,16] [--transport=data|grpc]
      [--merge_rule=mean|rda|clip]

For each push format (fp32, int4) and M, a fresh child process runs the syncer service
(`SyncerCore`: write-ahead log on disk, pull cache; `SyncerServer` with its data channel on
loopback) over N float32 parameters in 10 tensors, M learners, quorum M, outer Nesterov SGD:
a pull of Θ (as every learner does after a merge), then M pushes one after the other, the last
one merging, then a pull of the new Θ. Each push arrives as the service receives it: a data
ticket, then the payload over a loopback socket into the data channel's own handler (spooled,
checked, logged, folded), sent from the payload file 256 KB at a time (the sender's memory is
in the child too, but tiny). With --transport=grpc the syncer has no data channel and each push arrives as a
learner with `service.data_port=-1` sends it: a Push stream of chunk messages (the header, then the payload in
`chunk_bytes` = 4 MB messages read from the file one at a time: the sender holds one message) through the real gRPC
server on loopback, whose handler spools them as the data channel does. The child's peak RSS over that phase (VmHWM,
reset through /proc/self/clear_refs after the setup, whose orbax checkpoint at version 0
is not part of a merge) minus the idle process's, per parameter, is the figure. The idle
process is the same child with a 10,000-parameter model (imports, JAX, compiled merges,
orbax, the log, the servers: everything but the parameters); its peak RSS is reported beside the figure
(`idle_rss_mb`).
After the merge the same process saves Θ and the outer state as a syncer checkpoint does, into a side
directory: `checkpoint_bytes_per_param`, that save's peak RSS minus the idle process's, per parameter.
Then a second fresh process restarts the syncer in that workdir (no checkpoint since version 0): it
restores the checkpoint and replays the M pushes from the log (`watch_replay` splits the two); a text
line gives each phase's peak RSS minus the idle process's, per parameter.
Last line: host_bytes_per_param {M: B/param} (fp32 pushes; target <= 16). The line before:
int4_host_bytes_per_param, steady_bytes_per_param (after the merge and pull, fp32), checkpoint_bytes_per_param
(fp32), idle_rss_mb.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import grpc
import msgpack
import numpy as np

from experiments import cli
from experiments.benchmarks import common

_PARAMS = flags.DEFINE_integer("params", 100_000_000, "N: parameters of Θ (split into 10 tensors).")
_COUNTS = flags.DEFINE_list("counts", ["1", "2", "4", "8", "16"], "M: pushes per merge (= learners, quorum).")
_CHILD = flags.DEFINE_string("child", "", "Internal: run one measurement, FORMAT:M with payload file --payload.")
_PAYLOAD = flags.DEFINE_string("payload", "", "Internal: the payload file of the child.")
_TRANSPORT = flags.DEFINE_enum("transport", "data", ["data", "grpc"],
                               "How pushes arrive: the data channel, or gRPC's Push stream (service.data_port=-1).")
_MERGE_RULE = flags.DEFINE_enum("merge_rule", "mean", ["mean", "rda", "clip"],
                                "syncer.merge_rule of the measured syncer (trimmed_mean is refused by the service).")
_CHUNK_BYTES = 4 << 20  # service.chunk_bytes: gRPC's message size (the syncer's receive chunk too).
_TOKEN = "benchmark-secret"
_LEAVES = 10
_IDLE_PARAMS = 10_000  # The idle process's model: the syncer without (nearly any) parameters.


def _shapes(n: int) -> dict:
  return {f"block_{i}": {"w": (n // _LEAVES,)} for i in range(_LEAVES)}


def _write_payload(path: str, fmt: str, n: int) -> int:
  """One push's payload (a random Δ of N params, `fmt`) written to `path`; returns its bytes."""
  import jax  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import compression  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import wire  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  leaves = [
      rng.standard_normal(shape, dtype=np.float32) * 1e-3
      for shape in jax.tree.leaves(_shapes(n), is_leaf=lambda x: isinstance(x, tuple))]
  if fmt == "fp32":
    payload = jax.tree.unflatten(jax.tree.structure(_shapes(n), is_leaf=lambda x: isinstance(x, tuple)), leaves)
  else:
    payload = compression.encode(compression.Codec(format=fmt), leaves)
    payload = payload._replace(leaves=tuple(jax.tree.map(np.asarray, payload.leaves)))
  size = 0
  with open(path, "wb") as f:
    for part in wire.encode(payload):
      size += f.write(part)
  return size


def _file_chunks(path: str, chunk_bytes: int = 256 << 10):
  """The file's bytes as memoryviews of one reused buffer: the sender holds 256 KB, not the push."""
  buffer = memoryview(bytearray(chunk_bytes))
  with open(path, "rb", buffering=0) as f:
    while size := f.readinto(buffer):
      yield buffer[:size]


def _sender(transport: str, server, path: str):
  """`send(header)`: one push of the payload file at `path` as a learner sends it over `transport`; the syncer's
  reply. Either way the sender streams the file and holds one chunk of it, not the push."""
  from decoupled_diloco.service import datachannel, security, wire  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import server as server_lib  # pylint: disable=g-import-not-at-top
  if transport == "data":
    return lambda header: datachannel.send_push(
        ("127.0.0.1", server.data.port), server.data.ticket(header), _file_chunks(path), timeout=600)
  channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=server_lib.message_options(_CHUNK_BYTES))
  push = channel.stream_unary(f"/{server_lib.SERVICE}/Push")

  def send(header: dict) -> bytes:
    messages = itertools.chain([wire.pack_header(header)], map(bytes, _file_chunks(path, _CHUNK_BYTES)))
    return push(messages, timeout=600, metadata=security.call_metadata(_TOKEN))

  return send


def _core(fmt: str, count: int, n: int, directory: str):
  """The service's `SyncerCore` over N params in `directory` (M learners, quorum M), not started; glibc maps
  large blocks from here on, as in the syncer process."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from ml_collections import ConfigDict  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import compression, outer  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import core as core_lib  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.syncer import Settings, Syncer, map_large_blocks  # pylint: disable=g-import-not-at-top
  map_large_blocks()
  params = jax.tree.map(lambda shape: jnp.full(shape, 0.01, jnp.float32), _shapes(n),
                        is_leaf=lambda x: isinstance(x, tuple))
  optimizer = outer.outer_optimizer(ConfigDict({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}))
  syncer = Syncer(optimizer, params, range(count),
                  Settings(quorum=count, token_weighting="tokens", merge_rule=_MERGE_RULE.value),
                  codec=compression.Codec(format=fmt))
  return core_lib.SyncerCore(syncer, count, budget_steps=10**9, directory=directory, checkpoint_every_merges=10**6,
                             lease_seconds=1e9, metadata={})


def _child(fmt: str, count: int, path: str, n: int, transport: str) -> dict:
  """One measurement in this (fresh) process (peak and final RSS in KiB): see the module docstring. Its workdir is
  left for `_restart_child`."""
  import jax  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import server as server_lib  # pylint: disable=g-import-not-at-top
  from experiments.launch_local import free_port  # pylint: disable=g-import-not-at-top
  core = _core(fmt, count, n, f"{path}.{count}.workdir")
  core.syncer.warm_up()  # As the service does: nothing is compiled during the measured phase.
  size = os.path.getsize(path)
  core.start(time.time())
  server = server_lib.SyncerServer(core, _TOKEN, host="127.0.0.1", port=free_port(), chunk_bytes=_CHUNK_BYTES,
                                   max_payload_bytes=size, data_port=free_port() if transport == "data" else -1)
  server.start()
  send = _sender(transport, server, path)
  core.pull(0, 0, -1, time.time())  # Θ encoded for pulls, as after every merge.
  common.reset_peak_kb()
  seconds = []
  for learner in range(count):
    header = {
        "learner": learner, "seq": 0, "base_version": 0, "fragment": 0, "tokens": 1024 * (learner + 1),
        "local_steps": 16, "budget_steps": 16, "budget_tokens": 1024, "compute_seconds": 1.0, "payload_bytes": size,
        "incarnation": 0}
    begin = time.perf_counter()
    reply = msgpack.unpackb(send(header))
    seconds.append(time.perf_counter() - begin)
    assert reply["status"] == "applied", reply
  assert core.syncer.version == 1, "the M-th push must merge"
  core.pull(0, 0, 0, time.time())
  jax.block_until_ready(core.syncer.params)
  time.sleep(0.2)  # XLA lets go of the replaced Θ asynchronously, within 50 ms here (no reference cycle holds it).
  peak_kb, steady_kb = common.status_kb("VmHWM"), common.status_kb("VmRSS")
  save_peak_kb = _save_peak_kb(core, f"{path}.{count}.saved")
  server.stop()
  core.close()
  return {
      "format": fmt, "pushes": count, "payload_bytes": size, "peak_kb": peak_kb, "steady_kb": steady_kb,
      "save_peak_kb": save_peak_kb, "push_seconds": round(sum(seconds) / count, 3)}


def _save_peak_kb(core, directory: str) -> int:
  """Peak RSS (KiB) while the merged Θ and outer state are saved as the syncer's checkpoints are (the same
  `Checkpointer.save`, the same trees), into a side directory: the restart must still replay from version 0."""
  from decoupled_diloco import checkpoint  # pylint: disable=g-import-not-at-top
  common.reset_peak_kb()
  with checkpoint.Checkpointer(directory) as side:
    side.save(1, {"params": core.syncer.state.params, "opt_state": core.syncer.state.opt_state}, {})
  peak_kb = common.status_kb("VmHWM")
  shutil.rmtree(directory)
  return peak_kb


def _restart_child(fmt: str, count: int, path: str, n: int) -> dict:
  """A restart in `_child`'s workdir, in a fresh process: a new syncer restores the checkpoint at version 0 and
  replays the M pushes from the log, the last one merging. The peak RSS (KiB) of each phase; the workdir goes."""
  directory = f"{path}.{count}.workdir"
  core = _core(fmt, count, n, directory)
  restore = watch_replay(core.store)
  common.reset_peak_kb()
  core.start(time.time())
  assert core.syncer.version == 1, "the replay must merge"
  replay_kb = common.status_kb("VmHWM")
  core.close()
  shutil.rmtree(directory)
  return {"restore_peak_kb": restore[0][0], "replay_peak_kb": replay_kb}


def watch_replay(store) -> list[tuple[int, int]]:
  """A list that gets (peak RSS, RSS) in kB at a restart's first read of its log in `store`, the peak reset there:
  what the restart needed to restore its checkpoint, and where its replay starts (its peak: VmHWM after it)."""
  peaks, records_from = [], store.records_from

  def first_read_marked(first_segment: int):
    peaks.append((common.status_kb("VmHWM"), common.reset_peak_kb()))
    yield from records_from(first_segment)

  store.records_from = first_read_marked
  return peaks


def _run_child(fmt: str, count: int, path: str, n: int) -> dict:
  """The live measurement, then the restart's, each in a fresh process (both results in one dict)."""
  return {**_run(f"{fmt}:{count}", path, n), **_run(f"{fmt}:{count}:restart", path, n)}


def _run(child: str, path: str, n: int) -> dict:
  command = [
      sys.executable, "-m", "experiments.benchmarks.syncer_memory", f"--child={child}", f"--payload={path}",
      f"--params={n}", f"--transport={_TRANSPORT.value}", f"--merge_rule={_MERGE_RULE.value}"]
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode:
    raise RuntimeError(f"child {child} failed:\n{result.stderr[-3000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv) -> None:
  """Measures every (format, M) in its own process; one JSON line at the end."""
  del argv
  n = _PARAMS.value
  if _CHILD.value:
    fmt, count, *restart = _CHILD.value.split(":")
    args = (fmt, int(count), _PAYLOAD.value, n)
    print(json.dumps(_restart_child(*args) if restart else _child(*args, _TRANSPORT.value)))
    return
  rows, idle_kb = {}, {}
  if _TRANSPORT.value == "grpc":
    print("transport: gRPC Push streams of 4 MB chunk messages (service.data_port=-1)", flush=True)
  with tempfile.TemporaryDirectory() as directory:
    for fmt in ("fp32", "int4"):
      for size in (_IDLE_PARAMS, n):
        _write_payload(os.path.join(directory, f"{fmt}_{size}.payload"), fmt, size)
      for count in map(int, _COUNTS.value):
        idle = _run_child(fmt, count, os.path.join(directory, f"{fmt}_{_IDLE_PARAMS}.payload"), _IDLE_PARAMS)
        idle_kb[fmt, count] = idle["peak_kb"]
        row = _run_child(fmt, count, os.path.join(directory, f"{fmt}_{n}.payload"), n)
        print(
            f"{fmt} M={count}, a restart: restoring the checkpoint peaks at "
            f"{(row.pop('restore_peak_kb') - idle['restore_peak_kb']) * 1024 / n:.2f} B/param, replaying the "
            f"{count} pushes and their merge at {(row.pop('replay_peak_kb') - idle['replay_peak_kb']) * 1024 / n:.2f} "
            f"(idle process {idle['restore_peak_kb'] / 1024:.1f} / {idle['replay_peak_kb'] / 1024:.1f} MB)", flush=True)
        rows[fmt, count] = {
            **row, "idle_rss_mb": round(idle_kb[fmt, count] / 1024, 1), "peak_bytes_per_param": round(
                (row["peak_kb"] - idle_kb[fmt, count]) * 1024 / n, 2), "steady_bytes_per_param": round(
                    (row["steady_kb"] - idle_kb[fmt, count]) * 1024 / n, 2), "checkpoint_bytes_per_param": round(
                        (row["save_peak_kb"] - idle["save_peak_kb"]) * 1024 / n, 2)}
        print(json.dumps(rows[fmt, count]), flush=True)
  common.emit_keys(
      {
          "benchmark": "syncer_memory", "params": n, "merge_rule": _MERGE_RULE.value, "host_bytes_per_param": {
              m: r["peak_bytes_per_param"] for (f, m), r in rows.items() if f == "fp32"}, "int4_host_bytes_per_param": {
                  m: r["peak_bytes_per_param"] for (f, m), r in rows.items() if f == "int4"}, "steady_bytes_per_param": {
                      m: r["steady_bytes_per_param"] for (f, m), r in rows.items() if f == "fp32"
                  }, "checkpoint_bytes_per_param": {
                      m: r["checkpoint_bytes_per_param"] for (f, m), r in rows.items() if f == "fp32"},
          "idle_rss_mb": max(r["idle_rss_mb"] for r in rows.values()), "payload_bytes": {
              f: r["payload_bytes"] for (f, m), r in rows.items()}, "load_average": round(os.getloadavg()[0], 1)},
      ("host_bytes_per_param",))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

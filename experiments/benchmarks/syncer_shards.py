r"""Syncer shards: merge throughput and host memory per shard with S = 1 and S = 2 shard processes.

  python -m experiments.benchmarks.syncer_shards [--params=250000000] [--fragments=4] [--rounds=3]

A model of N float32 parameters in 16 equal tensors, P fragments ('balanced'), 4 learners, quorum
4, outer Nesterov SGD. For S in (1, 2), S fresh child processes each build their shard's
syncer as the service does (`shards.build`: a `Syncer` over the leaves of the fragments
the shard owns), compile it (`warm_up`), wait at a common start line, then take `rounds`
rounds: every learner pushes every fragment the shard owns (the payload read from a file into
the aligned buffer the service receives into and decoded without a copy, as `SyncerCore.push`
does), the 4th push of a fragment merging it. No network and no write-ahead log: the figure
is the shard's own merge path, which sharding splits. Per shard: outer steps (fragment merges)
per second and pushed bytes per second over its loop, and its peak RSS (VmHWM) minus the idle
process's (the same child over a 10,000-parameter model: imports, JAX, compiled merges).
Keys: `throughput_ratio` = outer steps per second of all S = 2 shards together / S = 1's
(target >= 0.9; the shards share this machine's cores), `memory_per_shard_ratio` = the larger
S = 2 shard's peak bytes / the S = 1 syncer's, idle RSS subtracted (target <= 0.55), on the
last line; per-S rows with the raw figures on the line before.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

from experiments.benchmarks import common

_PARAMS = flags.DEFINE_integer("params", 250_000_000, "N: parameters of Θ (16 tensors).")
_FRAGMENTS = flags.DEFINE_integer("fragments", 16, "P: fragments of the model (streaming.num_fragments, <= 16).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds: every learner pushes every fragment once per round.")
_CHILD = flags.DEFINE_string("child", "", "Internal: run shard S:s over the payloads in --payloads.")
_PAYLOADS = flags.DEFINE_string("payloads", "", "Internal: the directory of the fragments' payload files.")
_LEAVES, _LEARNERS, _CHUNK, _IDLE_PARAMS = 16, 4, 4 << 20, 10_000


def _params(n: int):
  """Θ: 16 equal tensors of N / 16, as views of one number: a shard's process allocates only the leaves
  its syncer copies in."""
  return {f"block_{i}": {"w": np.broadcast_to(np.float32(0.01), (n // _LEAVES,))} for i in range(_LEAVES)}


def _assignment(params, num_fragments: int) -> tuple[int, ...]:
  from decoupled_diloco import fragments  # pylint: disable=g-import-not-at-top
  return fragments.partition(params, num_fragments, "balanced")


def _write_payloads(directory: str, n: int, num_fragments: int) -> None:
  """One fp32 push per fragment (a random Δ of its leaves), as the wire carries it, in `directory`."""
  import jax  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import fragments  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import wire  # pylint: disable=g-import-not-at-top
  params = _params(n)
  assignment, rng = _assignment(params, num_fragments), np.random.default_rng(0)
  for p in range(num_fragments):
    delta = jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32) * 1e-3,
                         fragments.select(params, assignment, p))
    with open(os.path.join(directory, f"{n}_{p}.payload"), "wb") as f:
      for part in wire.encode(delta):
        f.write(part)


def _receive(path: str):
  """A push's payload as the service holds it: read into an aligned receive buffer, decoded without a copy."""
  from decoupled_diloco.service import wire  # pylint: disable=g-import-not-at-top
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    payload = wire.assemble(iter(lambda: f.read(_CHUNK), b""), size, size, _CHUNK)
  payload.flags.writeable = False
  return wire.decode(payload), size


def _child(num_shards: int, shard: int, directory: str, n: int, num_fragments: int, rounds: int) -> dict:
  """Shard `shard` of `num_shards`: build, compile, wait for the start line on stdin, run the rounds."""
  import jax  # pylint: disable=g-import-not-at-top
  from ml_collections import ConfigDict  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import outer, shards  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.push import Push  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.syncer import Settings, Syncer  # pylint: disable=g-import-not-at-top
  params = _params(n)
  assignment = _assignment(params, num_fragments)
  optimizer = outer.outer_optimizer(ConfigDict({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}))
  make = lambda part, part_assignment: Syncer(optimizer, part, range(_LEARNERS), Settings(quorum=_LEARNERS), assignment=
                                              part_assignment)
  syncer = shards.build(make, params, assignment, num_shards, shard)
  owned = shards.ShardMap.of(params, assignment, num_shards).owned(shard)
  del params
  syncer.warm_up()
  print("ready", flush=True)
  sys.stdin.readline()  # The start line: every shard's loop runs at the same time.
  merges, pushed, begin = 0, 0, time.perf_counter()
  for _ in range(rounds):
    for local, fragment in enumerate(owned):
      for learner in range(_LEARNERS):
        delta, size = _receive(os.path.join(directory, f"{n}_{fragment}.payload"))
        _, report = syncer.receive(Push(learner, delta, syncer.fragments[local].version, 1024, 16, 1.0, local, size),
                                   time.time())
        del delta
        merges, pushed = merges + (report is not None), pushed + size
  jax.block_until_ready(syncer.params)
  seconds = time.perf_counter() - begin
  return {
      "shard": shard, "fragments": len(owned), "merges": merges, "seconds": seconds,
      "outer_steps_per_second": merges / seconds, "bytes_per_second": pushed / seconds,
      "peak_kb": common.status_kb("VmHWM")}


def _run_shards(num_shards: int, directory: str, n: int, num_fragments: int, rounds: int) -> list[dict]:
  """S children started together; released at once when all are ready; their rows."""
  children = [
      subprocess.Popen([
          sys.executable, "-m", "experiments.benchmarks.syncer_shards", f"--child={num_shards}:{s}",
          f"--payloads={directory}", f"--params={n}", f"--fragments={num_fragments}", f"--rounds={rounds}"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for s in range(num_shards)]
  for child in children:
    if child.stdout.readline().strip() != "ready":
      raise RuntimeError(f"a shard child of S={num_shards} failed before it was ready (see its stderr above)")
  for child in children:
    child.stdin.write("go\n")
    child.stdin.flush()
  rows = []
  for child in children:
    out, _ = child.communicate()
    if child.returncode:
      raise RuntimeError(f"a shard child of S={num_shards} exited with {child.returncode}")
    rows.append(json.loads(out.strip().splitlines()[-1]))
  return rows


def measure(n: int, num_fragments: int, rounds: int) -> dict:
  """Both shard counts (and the idle process) on payloads written once; the figures (see the module doc)."""
  with tempfile.TemporaryDirectory() as directory:
    for size in (_IDLE_PARAMS, n):
      _write_payloads(directory, size, num_fragments)
    idle_kb = _run_shards(1, directory, _IDLE_PARAMS, num_fragments, 1)[0]["peak_kb"]
    runs = {s: _run_shards(s, directory, n, num_fragments, rounds) for s in (1, 2)}
  steps = {s: sum(r["merges"] for r in rows) / max(r["seconds"] for r in rows) for s, rows in runs.items()}
  net = {s: max(r["peak_kb"] for r in rows) - idle_kb for s, rows in runs.items()}
  return {
      "benchmark": "syncer_shards", "params": n, "fragments": num_fragments, "learners": _LEARNERS, "rounds": rounds,
      "idle_rss_mb": round(idle_kb / 1024, 1), "outer_steps_per_second": {s: round(v, 3) for s, v in steps.items()},
      "per_shard": {
          s: [{
              "outer_steps_per_second": round(r["outer_steps_per_second"],
                                              3), "bytes_per_second": round(r["bytes_per_second"]),
              "fragments": r["fragments"], "rss_mb": round(r["peak_kb"] / 1024, 1)}
              for r in rows] for s, rows in runs.items()}, "memory_per_shard_ratio": round(net[2] / net[1], 3),
      "throughput_ratio": round(steps[2] / steps[1], 3), "load_average": round(os.getloadavg()[0], 1)}


def main(argv) -> None:
  """A child measures one shard; the parent runs S = 1, S = 2 and prints the figures, then the keys."""
  del argv
  if _CHILD.value:
    num_shards, shard = map(int, _CHILD.value.split(":"))
    print(json.dumps(_child(num_shards, shard, _PAYLOADS.value, _PARAMS.value, _FRAGMENTS.value, _ROUNDS.value)))
    return
  common.emit_keys(measure(_PARAMS.value, _FRAGMENTS.value, _ROUNDS.value),
                   ("memory_per_shard_ratio", "throughput_ratio"))


if __name__ == "__main__":
  app.run(main)

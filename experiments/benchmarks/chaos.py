r"""Chaos benchmark: SIGKILL learners and the syncer at seeded points of training; nothing acknowledged is lost.

  python -m experiments.benchmarks.chaos               # the demo's run, ~15 min on 2 shared cores
  python -m experiments.benchmarks.chaos --size=tiny   # the end-to-end test's size

Real processes on loopback (experiments.launch_local) run what users run with the service: the
demo's 4 learner groups and budget, Delayed Nesterov, quorum 1, DyLU with measured speeds, a syncer
that checkpoints every few merges. Delayed Nesterov buffers N = M arrivals per momentum step
(outer.buffer_size; with 1, every stale arrival took a full Nesterov step and the undisturbed runs
diverged: train loss 2.7 -> 7..16, a 15% spread). `--seeds` undisturbed runs (config seeds 0..n-1), then one run of
seed 0 under a seeded schedule that kills learners and the syncer at seeded syncer versions after
the first merges (ProgressChaos: the same points of training on any host), so a restarted syncer
restores a checkpoint and replays its log. The last line is one JSON object
with exactly the keys of issue 13:

  kills             {learner, syncer}: SIGKILLs that happened.
  acked_lost        pushes a learner saw acknowledged ('applied', 'dropped', 'duplicate') that the final
                    syncer's records (after every replay) lack.
  applied_twice     (learner, seq) pairs in those records more than once.
  loss_ratio        final eval loss with chaos / without (seed 0, same token budget).
  undisturbed_spread  (max - min) / mean of the undisturbed runs' final eval losses.
  rejoin_seconds    from a learner's restart to the syncer's first accepted push of it: {p50, max}, split
                    where its first step had compiled and run into `startup` (process start, imports, Join,
                    restore, the warm-up of a push's and a landing's programs, the step's compilation or its
                    loading from the learner's XLA cache, its first run) and `rest`
                    (the rest of its first round and the push; target: at most one round of H steps, which a log line
                    gives for each rejoin from the other learners' rounds over the same seconds), each {p50, max}.
  syncer_recovery_seconds  from a syncer's restart to the first call it served (a heartbeat this
                    benchmark sends): {p50, max}; target 10 s. Split by the restarted syncer's
                    'syncer_start' record into `imports` (process start, imports), `restore` (model
                    shapes, syncer, checkpoint), `replay` (the log) and `serve` (server up, first
                    call answered), each {p50, max}.
Log lines before it give what the targets are measured against: each rejoin's `rest` beside a round of H steps
of the other learners over the same seconds (median seconds per step between a learner's pushes, times H; the
load moves it more than the target's margin from one run to the next), the same in the undisturbed seed-0 run,
the pushes the restarted syncers replayed, the load average, and for each run its final eval loss, the
staleness of its pushed steps (mean and histogram) and learner 0's train loss along the run. Why: while a
learner is down the others' pushes are fresher, and at this budget the runs are still leaving a plateau of the
loss, so the final loss moves with how soon a run left it (docs/service-durability.md#chaos-benchmark).
"""

import collections
import math
import os
import random
import shutil
import statistics
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import grpc

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import security
from experiments.benchmarks import common
from experiments.chaos_schedule import Chaos
from experiments.launch_local import LocalCluster

_SIZE = flags.DEFINE_enum("size", "demo", ["demo", "tiny"], "Model and budget: the demo's, or the test's.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Undisturbed runs (config seeds 0..n-1) for the spread.")
_PLAN = flags.DEFINE_list("plan", ["learner", "syncer", "learner"], "Kinds of the successive victims.")
# launch_local's --workdir (where the runs go; each run's folder is replaced) and --chaos_seed (the
# schedule's seed: the kill versions and which learner dies; default 0) apply too.
flags.FLAGS.set_default("workdir", os.path.join(tempfile.gettempdir(), "dd_chaos"))

# What users run with the service, at two sizes: the demo's (its 4 learner groups, here of 1 device each, and
# its budget of 30 rounds of 25 steps) and the end-to-end test's. N = M: N arrivals make one Nesterov step on
# their mean, a synchronous round's (N = 2 with 4 learners doubled it; the undisturbed loss rose after ~200 steps).
_COMMON = ("--config.mode=decoupled", "--config.outer.optimizer=delayed_nesterov", "--config.syncer.quorum=1",
           "--config.policy.kind=dylu", "--config.policy.speed_source=measured", "--config.eval_every=100000",
           "--config.service.checkpoint_every_merges=4", "--config.service.lease_seconds=10.0",
           "--config.service.retry_seconds=300.0")
_SIZES = {
    "demo": {
        "learners": 4, "overrides": ("--config.learners.devices=(1,1,1,1)", "--config.outer.buffer_size=4"),
        "timeout": 900.0},
    "tiny": {
        "learners": 2, "overrides":
            ("--config.learners.devices=(1,1)", "--config.learners.batch_size=(4,4)", "--config.outer.buffer_size=2",
             "--config.model.seq_len=16", "--config.model.d_model=32", "--config.model.num_layers=1",
             "--config.model.num_heads=2", "--config.model.d_ff=64", "--config.outer_steps=150",
             "--config.inner_steps=20", "--config.data.synthetic.num_tokens=30000"), "timeout": 600.0},}


class TimedCluster(LocalCluster):
  """A LocalCluster that notes when each restart began and, for the syncer, when it served its first call."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.restarts: list[tuple[str, float, float]] = []  # (name, began, returned or first served) in time.time()

  def restart(self, name: str) -> None:
    began = time.time()
    super().restart(name)  # A syncer's returns once it published its address.
    if name == "syncer":
      self._first_served_call()
    self.restarts.append((name, began, time.time()))

  def _first_served_call(self) -> None:
    """Returns once the syncer answered a heartbeat (the run secret's, as learner 0; single attempts)."""
    probe = client_lib.SyncerClient(self.address, self.env[security.TOKEN_ENV], 0, chunk_bytes=64 << 10,
                                    timeout_seconds=5.0, retry_seconds=1.0)
    try:
      while True:
        try:
          probe.heartbeat(retry=False)
          return
        except grpc.RpcError:
          time.sleep(0.05)
    finally:
      probe.close()


class ProgressChaos(Chaos):
  """Chaos timed by the run's progress, not the clock: kill i comes once the syncer's version reached
  `versions[i]` (seeded) and the previous victim is back (a learner: finished a round since its restart), so
  one seed kills at the same points of training on an idle or a loaded machine, and recoveries never overlap."""

  def __init__(self, seed: int, plan: tuple[str, ...], versions: list[int], delay: float):
    super().__init__(seed, every=0.0, delay=delay, include_syncer=True, plan=plan)
    self.versions = versions
    self.back: list[tuple[str, float]] = []  # (victim, time.time() of its restart)

  def step(self, cluster: LocalCluster, now: float) -> None:
    down = set(self.down)
    kills = sum(event == "kill" for _, event, _ in self.events)
    self.next_kill = now if kills < len(self.versions) and self._due(cluster, kills) else math.inf
    super().step(cluster, now)
    self.back += [(name, time.time()) for name in down - set(self.down)]

  def _due(self, cluster: LocalCluster, kills: int) -> bool:
    if self.down or syncer_version(cluster.workdir) < self.versions[kills]:
      return False
    if not self.back or self.back[-1][0] == "syncer":
      return True
    name, restarted = self.back[-1]
    return any(r["unix_time"] > restarted
               for r in _records(os.path.join(cluster.workdir, name, "metrics.jsonl"), "first_round"))


def kill_versions(seed: int, kills: int, final_version: int) -> list[int]:
  """Seeded, increasing syncer versions to kill at: after the first merges (so a restarted syncer restores a
  checkpoint and replays its log) and before 60% of the undisturbed run's `final_version` (so a killed
  learner is back well before the budget is spent and the run trains with both learners again)."""
  low, high = max(4, final_version // 6), max(5, final_version * 3 // 5)
  step = (high - low) / kills
  rng = random.Random(seed)
  return [int(low + step * (i + rng.random())) for i in range(kills)]


def syncer_version(workdir: str) -> int:
  """The newest version the syncer's 'outer' records reached (a restarted syncer rewrites what it replays)."""
  return max((r["outer_step"] for r in _records(os.path.join(workdir, "metrics.jsonl"), "outer")), default=0)


def _run(workdir: str, overrides: list[str], size: dict, chaos: Chaos | None) -> TimedCluster:
  """One run to the end of its budget; raises if a process failed for another reason than a kill."""
  cluster = TimedCluster("configs/demo.py", workdir, [*_COMMON, *size["overrides"], *overrides], size["learners"])
  common.run_to_end(cluster, size["timeout"], chaos)
  return cluster


def _records(path: str, kind: str) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(path) if r["kind"] == kind] if os.path.exists(path) else []


def _final_loss(workdir: str) -> float:
  summary, = _records(os.path.join(workdir, "metrics.jsonl"), "summary")
  return summary["eval_loss"]


def exactly_once(workdir: str, learners: int) -> tuple[int, int]:
  """(acked_lost, applied_twice): learners' acknowledged pushes against the final syncer's push records."""
  held = collections.Counter((r["learner"], r["seq"]) for r in _records(os.path.join(workdir, "metrics.jsonl"), "push"))
  acked = {(m, r["seq"]) for m in range(learners)
           for r in _records(os.path.join(workdir, f"learner_{m}", "metrics.jsonl"), "ack")
           if r["status"] in ("applied", "dropped", "duplicate")}
  return sum(key not in held for key in acked), sum(count > 1 for count in held.values())


def _spread(values: list[float]) -> dict:
  return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)} if values else {}


def rejoin_seconds(cluster: TimedCluster) -> dict:
  """From each learner restart to the syncer's first accepted push of it, split where its first step had compiled
  (or loaded from the XLA cache) and run: start-up before, the rest of its first round and the push after."""
  checkpoints = os.path.join(cluster.workdir, "checkpoints")
  with checkpoint_lib.Checkpointer(checkpoints) as checkpointer:
    start_time = checkpointer.restore_metadata(checkpointer.latest_step())["start_time"]
  pushes = [r for r in _records(os.path.join(cluster.workdir, "metrics.jsonl"), "push") if r["accepted"]]
  total, startup = [], []
  for name, began, _ in cluster.restarts:
    if name == "syncer":
      continue
    learner = int(name.split("_")[1])
    accepted = [
        start_time + r["wall_time"] for r in pushes if r["learner"] == learner and start_time + r["wall_time"] > began]
    rounds = [
        r["compiled_unix_time"] for r in _records(os.path.join(cluster.workdir, name, "metrics.jsonl"), "first_round")
        if r["unix_time"] > began]
    if accepted and rounds:  # Else restarted into a run that was over.
      total.append(min(accepted) - began)
      startup.append(min(rounds) - began)
      window = (min(rounds) - start_time, min(accepted) - start_time)
      logging.info(
          "%s rejoined: startup %.2fs, rest %.2fs against %.2fs for a round of H steps of the other learners "
          "over the same seconds", name, startup[-1], total[-1] - startup[-1],
          h_round_seconds(cluster.workdir, window, learner))
  return {**_spread(total), "startup": _spread(startup), "rest": _spread([t - s for t, s in zip(total, startup)])}


def syncer_recovery_seconds(cluster: TimedCluster) -> dict:
  """From each syncer restart to its first served call, split at the phases its 'syncer_start' record gives."""
  starts = [
      r["unix_times"] for r in _records(os.path.join(cluster.workdir, "metrics.jsonl"), "syncer_start")
      if r["start"]["restored_step"] is not None]
  restarts = [(began, served) for name, began, served in cluster.restarts if name == "syncer"]
  phases = collections.defaultdict(list)
  for began, served in restarts:
    times = min((t for t in starts if t["entered"] > began), key=lambda t: t["entered"], default=None)
    if times is not None:
      marks = [began, times["entered"], times["restored"], times["replayed"], served]
      for phase, start, end in zip(("imports", "restore", "replay", "serve"), marks, marks[1:]):
        phases[phase].append(end - start)
  return {
      **_spread([served - began for began, served in restarts]),
      **{phase: _spread(values) for phase, values in phases.items()}}


def staleness(workdir: str) -> tuple[float, dict[int, int]]:
  """The mean staleness of a run's accepted pushes, weighted by their steps, and the pushes by staleness."""
  pushes = [r for r in _records(os.path.join(workdir, "metrics.jsonl"), "push") if r["accepted"]]
  mean = sum(r["staleness"] * r["local_steps"] for r in pushes) / max(1, sum(r["local_steps"] for r in pushes))
  return round(mean, 2), dict(sorted(collections.Counter(r["staleness"] for r in pushes).items()))


def h_round_seconds(workdir: str, window: tuple[float, float] = (0.0, math.inf), exclude: int = -1) -> float:
  """Seconds of a round of H steps: the median time per step between two pushes of one learner, times H (the
  longest round: every learner's first is H, DyLU never exceeds it), as the `rest` target counts it.

  `window` (seconds since the run began): only rounds that overlap it; `exclude`: a learner left out. A rejoin's
  `rest` is held against the other learners' rounds over its own seconds: the host's load moves step times
  by more than the target's margin between one run and the next.
  """
  pushes = _records(os.path.join(workdir, "metrics.jsonl"), "push")
  per_step = []
  for learner in {r["learner"] for r in pushes} - {exclude}:
    mine = sorted((r["wall_time"], r["local_steps"]) for r in pushes if r["learner"] == learner)
    per_step += [(b - a) / steps for (a, _), (b, steps) in zip(mine, mine[1:]) if b > window[0] and a < window[1]]
  return round(statistics.median(per_step) * max(r["local_steps"] for r in pushes), 2) if per_step else 0.0


def loss_curve(workdir: str, points: int = 5) -> list[tuple[int, float]]:
  """Learner 0's train loss at `points` evenly spaced steps: where on its curve the run's budget ends."""
  train = _records(os.path.join(workdir, "learner_0", "metrics.jsonl"), "train")
  picks = [train[(len(train) - 1) * (i + 1) // points] for i in range(points)] if train else []
  return [(r["inner_step"], round(r["loss"], 2)) for r in picks]


def main(argv: list[str]) -> None:
  del argv
  size = _SIZES[_SIZE.value]
  root = flags.FLAGS.workdir
  for name in [*(f"undisturbed_{seed}" for seed in range(_SEEDS.value)), "chaos"]:
    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
  losses = [
      _final_loss(_run(os.path.join(root, f"undisturbed_{seed}"), [f"--config.seed={seed}"], size, None).workdir)
      for seed in range(_SEEDS.value)]
  seed = flags.FLAGS.chaos_seed or 0
  versions = kill_versions(seed, len(_PLAN.value), syncer_version(os.path.join(root, "undisturbed_0")))
  logging.info("chaos plan: %s at syncer versions %s", _PLAN.value, versions)
  chaos = ProgressChaos(seed, tuple(_PLAN.value), versions, delay=2.0)
  chaotic = _run(os.path.join(root, "chaos"), ["--config.seed=0"], size, chaos)
  kills = collections.Counter(
      "syncer" if name == "syncer" else "learner" for _, event, name in chaos.events if event == "kill")
  lost, twice = exactly_once(chaotic.workdir, size["learners"])
  replayed = sum(r.get("replayed", 0) for r in _records(os.path.join(chaotic.workdir, "metrics.jsonl"), "push"))
  logging.info(
      "size %s: a round of H steps takes %.2fs (undisturbed seed 0); the restarted syncers replayed %d "
      "pushes; load average %s", _SIZE.value, h_round_seconds(os.path.join(root, "undisturbed_0")), replayed,
      os.getloadavg())
  for name in [*(f"undisturbed_{seed}" for seed in range(_SEEDS.value)), "chaos"]:  # What the two loss keys compare.
    workdir = os.path.join(root, name)
    logging.info(
        "%s: final eval loss %.4f; staleness of the pushed steps, mean and pushes by staleness %s; learner "
        "0's train loss by step %s", name, _final_loss(workdir), staleness(workdir), loss_curve(workdir))
  common.emit({
      "kills": {"learner": kills["learner"], "syncer": kills["syncer"]},
      "acked_lost": lost,
      "applied_twice": twice,
      "loss_ratio": round(_final_loss(chaotic.workdir) / losses[0], 4),
      "undisturbed_spread": round((max(losses) - min(losses)) / statistics.mean(losses), 4),
      "rejoin_seconds": rejoin_seconds(chaotic),
      "syncer_recovery_seconds": syncer_recovery_seconds(chaotic),})


if __name__ == "__main__":
  app.run(main)

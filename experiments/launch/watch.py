"""Looking after a running run: `status`, `logs` and `watch`.

The syncer writes one 'push' record per pseudo-gradient it receives into <workdir>/metrics.jsonl
(learner, seq, local steps, the version it merged into, staleness, seconds since the syncer
started). `status` reads that file from the bucket and the state of every slice, and prints
one line per learner: inner steps merged, last version, staleness of its last push and how
long before the newest record that push came. It is as fresh as the syncer's last flush.

`watch`: every --watch_seconds it asks gcloud for each slice's state (the learners' and the
evaluator's). A slice that is PREEMPTED, TERMINATED, FAILED or SUSPENDED (a queued Spot slice),
or gone, is deleted (if it is still listed), created again like `up` did, and gets learner i's
code, credential and CA and the same learner command with the same --learner_id: the learner
restores its checkpoint from the workdir and rejoins (the evaluator's slice gets the evaluator
again, which evaluates the syncer's newest Θ); the syncer never stopped. Healthy slices, their
processes and the syncer are left alone.
"""

import dataclasses
import json
import time

from experiments.launch import deploy, provision, runner
from experiments.launch.hosts import Step
from experiments.launch.options import Options

# States after which a slice runs nothing until it is recreated (TPU VM and queued-resource states).
LOST = frozenset({"PREEMPTED", "TERMINATED", "FAILED", "SUSPENDED"})


def recover(o: Options, index: int, listed: bool) -> list[Step]:
  """Slice `index` (Options.tpus) deleted (if still `listed`), created again, and its process restarted on it."""
  delete = [provision.delete_slice(o, index)] if listed else []
  create = [dataclasses.replace(step, unless=()) for step in provision.create_slice(o, index)]  # Known gone now.
  return delete + create + deploy.restart(o, index)


def _process(o: Options, index: int) -> str:
  """What runs on slice `index` (Options.tpus), as `watch` names it."""
  return f"learner {index}" if index < len(o.slices) else "the evaluator"


def lost(o: Options) -> list[tuple[int, bool]]:
  """(index, still listed) of every slice that needs recovering now. A slice whose state gcloud cannot tell
  counts as gone only when the zone's list of slices, read successfully, lacks it: a transient gcloud failure
  must not start a recreation."""
  found = []
  for index in range(len(o.tpus())):
    status, state = runner.probe(provision.state_step(o, index).argv)
    if status == 0 and state in LOST:
      found.append((index, True))
    elif status != 0 or not state:
      listed, names = runner.probe(provision.list_step(o, index).argv)
      if listed == 0 and o.tpus()[index][0].name not in names.split():
        found.append((index, False))
  return found


def watch(o: Options, rounds: int, seconds: float) -> None:
  """Looks at every slice `rounds` times (0 = until interrupted), `seconds` apart, recovering lost ones."""
  done = 0
  while True:
    for index, listed in lost(o):
      print(
          f"# slice {o.tpus()[index][0].name} is {'lost' if listed else 'gone'}: recreating it and "
          f"restarting {_process(o, index)}", flush=True)
      runner.execute(recover(o, index, listed))
    done += 1
    if rounds and done >= rounds:
      return
    time.sleep(seconds)


def dry_run(o: Options, seconds: float) -> None:
  """What `watch` checks every round, and what it would run for a lost slice."""
  print(f"# every {seconds:g} s, for each slice:")
  runner.dry_run([provision.state_step(o, index) for index in range(len(o.tpus()))])
  for index in range(len(o.tpus())):
    print(f"# when slice {o.tpus()[index][0].name} is {'/'.join(sorted(LOST))} (or gone):")
    runner.dry_run(recover(o, index, True))


def status_steps(o: Options) -> list[Step]:
  """Each slice's state, then the syncer's records (read-only commands)."""
  steps = [
      dataclasses.replace(provision.state_step(o, i), captures=f"state_{i}")
      for i in range(0 if o.xpk_cluster else len(o.slices))]
  return steps + [
      Step("the syncer's records", ("gcloud", "storage", "cat", f"{o.run_workdir}/metrics.jsonl"), "records")]


def summarise(lines: list[str]) -> dict[int, dict]:
  """Per learner, from the syncer's metrics.jsonl lines: steps (local steps of its accepted pushes, each
  (seq, fragment) counted once, as a resumed syncer may write a replayed push again), version (outer step
  of its last push), staleness of that push, last_push (seconds since the syncer started) and age (seconds
  between that push and the newest record). Lines that are not JSON (a partly written tail) are skipped."""
  records = []
  for line in lines:
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  newest = max((r.get("wall_time", 0.0) for r in records), default=0.0)
  rows, seen = {}, set()
  for record in (r for r in records if r.get("kind") == "push"):
    learner = record["learner"]
    row = rows.setdefault(learner, {"steps": 0, "pushes": 0})
    key = (learner, record["seq"], record["fragment"])
    if record["accepted"] and key not in seen:
      seen.add(key)
      row["steps"] += record["local_steps"]
      row["pushes"] += 1
    row.update(version=record["outer_step"], staleness=record["staleness"], last_push=record["wall_time"],
               age=newest - record["wall_time"])
  return rows


def status_table(o: Options, values: dict[str, str]) -> str:
  """The lines `status` prints: one per learner (slice state and its row), learners without pushes included."""
  rows = summarise(values.get("records", "").splitlines())
  lines = [
      f"{'learner':>7} {'slice':<20} {'state':<12} {'steps':>9} {'version':>7} {'staleness':>9} "
      f"{'last push':>10} {'age':>8}"]
  for i, host in enumerate(o.slice_hosts()):
    row = rows.get(i)
    figures = (f"{row['steps']:>9} {row['version']:>7} {row['staleness']:>9} {row['last_push']:>9.0f}s "
               f"{row['age']:>7.0f}s" if row else f"{'-':>9} {'-':>7} {'-':>9} {'-':>10} {'-':>8}")
    lines.append(f"{i:>7} {host.name:<20} {values.get(f'state_{i}', '?') or '?':<12} {figures}")
  return "\n".join(lines)


def logs(o: Options, lines: int) -> list[Step]:
  """The last `lines` lines of the syncer's log (each shard's, named as deploy names them) and of each learner's
  (worker 0 of its slice; an XPK workload's pods log to Cloud Logging instead)."""
  shards = [("the syncer", "syncer")] if o.syncer_shards == 1 else [
      (f"syncer shard {s}", f"syncer_{s}") for s in range(o.syncer_shards)]
  hosts = [(who, o.syncer(), log) for who, log in shards]
  hosts += [(f"learner {i}", dataclasses.replace(host, worker="0"), f"learner_{i}")
            for i, host in enumerate([] if o.xpk_cluster else o.slice_hosts())]
  hosts += [("the evaluator", o.evaluator_host(), "evaluator")] if o.evaluator_host() is not None else []
  return [
      Step(f"{who}'s log on {host.name}" + (" (worker 0)" if who.startswith("learner") else ""),
           tuple(host.ssh(o.project, f"tail -n {lines} dd/{o.run_name}/{log}.log"))) for who, host, log in hosts]

"""The sharded syncer with real processes: two syncer shards, one SIGKILLed mid-run and restarted; an evaluator
reading Θ from both."""

import collections
import os
import time

import pytest

from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco.service import shardrun
from experiments.launch_local import LocalCluster

pytestmark = pytest.mark.slow  # Real syncer and learner processes.

CONFIG = "tests/service_config.py"
RUN_TIMEOUT = 400.0


def _records(path, kind) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(path) if r["kind"] == kind] if os.path.exists(path) else []


def _shard_records(workdir, shard, kind):
  return _records(os.path.join(shardrun.shard_workdir(workdir, shard), "metrics.jsonl"), kind)


def test_a_sharded_run_with_a_shard_killed_mid_run_loses_nothing_and_applies_nothing_twice(tmp_path):
  cluster = LocalCluster(CONFIG, str(tmp_path / "run"), [
      "--config.syncer.min_learners_to_start=1", "--config.service.shards=2", "--config.service.evaluate_on=none",
      "--config.streaming.num_fragments=2", "--config.streaming.strategy=balanced", "--config.inner_steps=8",
      "--config.outer_steps=8"], 2, env=dict(os.environ, DD_SYNCER_TOKEN="s" * 32), shards=2)
  try:
    cluster.start()
    deadline = time.monotonic() + RUN_TIMEOUT
    while len(_shard_records(cluster.workdir, 1, "outer")) < 4:
      assert time.monotonic() < deadline, "shard 1 did not merge 4 times"
      time.sleep(0.2)
    cluster.kill("syncer_1")  # SIGKILL: shard 0 and the learners go on; shard 1's fragment waits for it.
    killed_at = max(r["outer_step"] for r in _shard_records(cluster.workdir, 1, "outer"))
    time.sleep(1.0)
    cluster.restart("syncer_1")  # Same port, --config.resume=True: its own checkpoint and log.
    codes = cluster.wait(RUN_TIMEOUT)
  finally:
    cluster.stop()
  assert codes == {"syncer": 0, "syncer_1": 0, "learner_0": 0, "learner_1": 0}, codes
  applied = collections.Counter()
  for shard in range(2):
    pushes = _shard_records(cluster.workdir, shard, "push")
    assert pushes and {r["fragment"] for r in pushes} == {0}  # Each shard owns one fragment (local id 0).
    applied.update((r["learner"], r["seq"]) for r in pushes)
    versions = [r["outer_step"] for r in _shard_records(cluster.workdir, shard, "outer")]
    summary, = _shard_records(cluster.workdir, shard, "summary")
    assert summary["done"] and versions == sorted(set(versions)) and versions[-1] == summary["outer_step"]
  assert max(applied.values()) == 1, [k for k, n in applied.items() if n > 1]  # Once, on one shard only.
  for m in range(2):  # Every push a learner saw acknowledged was applied, once, by the shard it went to.
    acked = [(m, r["seq"]) for r in _records(os.path.join(cluster.workdir, f"learner_{m}", "metrics.jsonl"), "ack")
             if r["status"] in ("applied", "dropped", "duplicate")]
    assert acked and all(applied[key] == 1 for key in acked), [k for k in acked if applied[k] != 1]
  # Shard 1 went on from where it was killed; shard 0 alone counted the budget, every step once.
  assert max(r["outer_step"] for r in _shard_records(cluster.workdir, 1, "outer")) > killed_at
  assert any(r["replayed"] for r in _shard_records(cluster.workdir, 1, "push")) or killed_at % 8 == 0
  assert _shard_records(cluster.workdir, 0, "summary")[0]["steps_done"] >= 2 * 8 * 8  # learners × H × outer_steps.
  assert _shard_records(cluster.workdir, 1, "summary")[0]["steps_done"] == 0
  for m in range(2):  # Each learner heard shard 1's new incarnation in a reply, and carried on.
    summary, = _records(os.path.join(cluster.workdir, f"learner_{m}", "metrics.jsonl"), "learner_summary")
    assert summary["syncer_restarts"] == 1, summary


def test_an_evaluator_reads_every_shard_and_tags_its_evals_with_each_fragments_version(tmp_path):
  cluster = LocalCluster(CONFIG, str(tmp_path / "run"), [
      "--config.service.shards=2", "--config.service.evaluate_on=evaluator", "--config.streaming.num_fragments=2",
      "--config.streaming.strategy=balanced"], 2, env=dict(os.environ, DD_SYNCER_TOKEN="v" * 32), shards=2,
                         evaluator=True)
  try:
    cluster.start()
    codes = cluster.wait(RUN_TIMEOUT)
  finally:
    cluster.stop()
  assert codes == {"syncer": 0, "syncer_1": 0, "learner_0": 0, "learner_1": 0, "evaluator": 0}, codes
  merged = []  # Per shard (= per fragment here: one each), the versions it merged.
  for shard in range(2):
    assert not _shard_records(cluster.workdir, shard, "eval")  # Evaluation happened off the syncers.
    merged.append({0} | {r["outer_step"] for r in _shard_records(cluster.workdir, shard, "outer")})
  summaries = [_shard_records(cluster.workdir, shard, "summary")[0] for shard in range(2)]
  evaluator = os.path.join(cluster.workdir, "evaluator", "metrics.jsonl")
  evals = _records(evaluator, "eval")
  assert len(evals) >= 2 and [r["outer_step"] for r in evals] == sorted({r["outer_step"] for r in evals})
  for record in evals:  # Each fragment at a version its shard merged; the record's version is their sum.
    assert all(v in merged[p] for p, v in enumerate(record["versions"])) and record["outer_step"] == sum(
        record["versions"]), record
  final = [s["outer_step"] for s in summaries]
  assert evals[-1]["versions"] == final and min(final) >= 1  # The final Θ of both shards, each merged.
  assert evals[-1]["tokens"] == summaries[0]["tokens"]  # The run's clock is shard 0's, which counts the budget.
  done, = _records(evaluator, "evaluator_summary")
  assert done["evaluated_version"] == sum(final) and done["eval_loss"] == evals[-1]["eval_loss"]
  assert done["pulled_bytes"] > 0

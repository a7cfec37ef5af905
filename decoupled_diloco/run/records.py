"""Metric records every runtime writes the same way: train-loss windows, evals, and the one
schema of the `learner_summary` and `summary` records (docs/records.md).

A summary record always has every field of its schema; what a runtime does not measure is
null, so readers (report.py, the notebooks) read one shape whatever ran.
"""

import os
import threading

from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError

# Per learner group, at the run's end. Seconds are virtual under sim, wall-clock otherwise.
LEARNER_SUMMARY_FIELDS = ("learner", "steps", "tokens", "busy_seconds", "idle_seconds", "blocked_seconds",
                          "finished_early_seconds", "wall_seconds", "compute_utilization", "blocked_fraction", "stalls",
                          "overlapped_steps", "pushes", "dropped", "rejected", "bytes_sent", "bytes_received",
                          "uplink_busy_seconds", "downlink_busy_seconds", "staleness_histogram", "clipped",
                          "trimmed_share", "final_ack_seconds", "exchange_seconds", "rounds", "retries",
                          "syncer_restarts", "processes", "group_peak_bytes", "group_host_bytes", "ack_statuses")
# The run's totals, once, when it is done.
SUMMARY_FIELDS = ("eval_loss", "optimal_loss", "outer_updates", "steps", "steps_done", "done", "virtual_seconds",
                  "wall_seconds", "syncer_seconds", "goodput", "compute_utilization", "bytes_sent", "idle_fraction",
                  "blocked_fraction", "merges", "accepted_pushes", "dropped_pushes", "rejected_pushes",
                  "duplicates_pushes", "late_pushes", "excluded_pushes", "failures", "lost_steps", "down_seconds",
                  "refused_calls", "diverged")
# Where the run stood when a record was written.
CLOCK_FIELDS = ("outer_step", "inner_step", "tokens", "time", "wall_time")


def _record(kind: str, schema: tuple, header: tuple, clock: dict, fields: dict) -> dict:
  unknown = set(fields) - set(schema)
  if unknown:
    raise ValueError(f"{kind} record has no fields {sorted(unknown)}: add them to the schema in run/records.py")
  return {"kind": kind, **{k: clock.get(k) for k in header}, **{k: fields.get(k) for k in schema}}


def learner_summary(clock: dict, account=None, **fields) -> dict:
  """The `learner_summary` record: the clock's outer_step, inner_step, time and wall_time, then every
  field of LEARNER_SUMMARY_FIELDS: `account`'s (run.account.Account), overridden by `fields`, null
  where neither has one (`tokens` is the learner's own)."""
  return _record("learner_summary", LEARNER_SUMMARY_FIELDS, ("outer_step", "inner_step", "time", "wall_time"), clock,
                 {**(account.fields() if account is not None else {}), **fields})


def summary(clock: dict, **fields) -> dict:
  """The `summary` record: the clock, then every field of SUMMARY_FIELDS (null where `fields` has none)."""
  return _record("summary", SUMMARY_FIELDS, CLOCK_FIELDS, clock, fields)


def push(clock: dict, push_, staleness: int, accepted: bool, verdict=None, **extra) -> dict:
  """The `push` record of a pseudo-gradient the syncer took; `verdict` (syncer.Verdict): its decoded norm
  and clip factor, so that a clipped push is visible push by push."""
  return {
      "kind": "push", **clock, "learner": push_.learner, "fragment": push_.fragment, "local_steps": push_.local_steps,
      "tokens": push_.tokens, "staleness": staleness, "accepted": int(accepted), "wire_bytes": push_.wire_bytes,
      **({} if push_.delta_norm is None else {"pseudo_gradient_norm": float(push_.delta_norm)}),
      **({} if verdict is None else verdict.fields()), **extra}


def outer(clock: dict, report, **extra) -> dict:
  """The `outer` record of a merge (syncer.MergeReport)."""
  return {
      "kind": "outer", **clock, "fragment": report.fragment, "learners": list(report.learners),
      "staleness": list(report.staleness), "weights": list(report.weights),
      **({"trimmed": list(report.trimmed)} if report.trimmed else {}), **extra}


def write_summaries(write, exp, clock: dict, accounts, end: float, weights, useful, learner_fields, **fields) -> dict:
  """Writes the learner_summary records and the summary of an in-process run (sim, threads) that ended at `end`
  seconds; returns the summary. Each learner's record has its steps, tokens, utilization and `learner_fields[m]`;
  the summary has goodput (`useful` seconds, weighted by each group's devices or chips `weights`, over the
  device-time allocated for `end` seconds), compute utilization (busy likewise), the push counts and `fields`."""
  for m, (account, learner, extra) in enumerate(zip(accounts, exp.learners, learner_fields)):
    write(
        learner_summary(clock, account, learner=m, steps=learner.steps,
                        tokens=learner.steps * learner.batches.tokens_per_batch,
                        finished_early_seconds=end - (end if account.done_at is None else account.done_at),
                        compute_utilization=account.busy / end if end else 0.0, **extra))
  allocated = sum(w * end for w in weights)
  share = lambda seconds: sum(w * s for w, s in zip(weights, seconds)) / allocated if allocated else 0.0
  steps = [l.steps for l in exp.learners]
  record = summary(clock, optimal_loss=exp.corpus.optimal_loss, outer_updates=clock["outer_step"], steps=steps,
                   steps_done=sum(steps), done=not fields.get("diverged"), goodput=share(useful),
                   compute_utilization=share([a.busy for a in accounts]),
                   **(push_counts(exp.syncer.counts) if exp.syncer else {}), **fields)
  write(record)
  return record


def push_counts(counts: dict) -> dict:
  """Summary fields of a syncer's push counters ('accepted', 'dropped', ..., 'merges')."""
  return {("merges" if k == "merges" else f"{k}_pushes"): v for k, v in counts.items()}


def fresh_workdir(workdir: str, resume: bool, no_resume: str) -> str:
  """For runtimes that cannot resume: refuses `resume` (saying `no_resume`) and a workdir that
  already holds a run, before anything is written; returns the checkpoints directory."""
  if resume:
    raise ConfigError(no_resume)
  checkpoints = storage.makedirs(workdir) / "checkpoints"
  if checkpoints.is_dir() and any(checkpoints.iterdir()):
    raise ConfigError(f"workdir {workdir} already holds a run: pick a new --workdir")
  return os.fspath(checkpoints)


def train_records(learner, outer_step: int, log_every: int, extra: dict) -> list[dict]:
  """Mean loss (and an MoE model's router metrics) per window of `log_every` inner steps; windows also end
  where a drain ends.

  Runtimes drain at round (or push) boundaries, so windows never span a checkpoint and a
  resumed run writes exactly the records the uninterrupted run wrote.
  """
  records, window = [], []
  drained = learner.drain_metrics()
  for i, (step, metrics) in enumerate(drained):
    window.append(metrics)
    if (step + 1) % log_every == 0 or i == len(drained) - 1:
      means = {name: sum(m[name] for m in window) / len(window) for name in metrics}
      records.append({
          "kind": "train", "outer_step": outer_step, "learner": learner.index, "inner_step": step + 1,
          "tokens": (step + 1) * learner.batches.tokens_per_batch, **means, **extra})
      window = []
  return records


class Recorder:
  """A MetricsWriter shared by threads (learners, the evaluator, gRPC handlers).

  Records written before `attach` wait in memory (the syncer process's log replay: which
  records the file keeps depends on the checkpoint the restart could use, known only after).
  """

  def __init__(self, writer: metrics_lib.MetricsWriter | None = None):
    self.writer, self.lock, self._waiting = writer, threading.Lock(), []

  def attach(self, writer: metrics_lib.MetricsWriter) -> None:
    """Starts writing into `writer`, the waiting records first."""
    with self.lock:
      self.writer = writer
      for record in self._waiting:
        writer.write(record)
      self._waiting.clear()

  def write(self, record: dict) -> None:
    """Appends one record (thread-safe)."""
    with self.lock:
      if self.writer is None:
        self._waiting.append(record)
      else:
        self.writer.write(record)

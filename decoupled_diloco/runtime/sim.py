"""Virtual-clock runtime: real JAX steps, simulated time, deterministic event order.

Every learner runs its real inner steps, but time advances by what its hardware profile
says a step costs, and transfers cost latency + bytes / bandwidth. Events are processed
in (time, priority, sequence) order, so a seeded run gives identical metrics twice.
At equal times, finished steps and arrivals at the syncer go first and replies after
them, so learners that report together all receive the merge they completed.

Modes: 'decoupled' (learners never wait: the syncer replies with the newest Θ at once),
'diloco' (blocking: a learner waits for the merge that includes its push, so the slowest
learner sets the pace) and 'ddp' (one group, no syncer). The run ends when the learners
have taken outer_steps × inner_steps × M inner steps in total (same tokens in every mode).
"""

import collections
import dataclasses
import heapq
import itertools
import os
import time

from absl import logging
import numpy as np

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco import policy as policy_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.experiment import Experiment
from decoupled_diloco.runtime import records
from decoupled_diloco.syncer import MergeReport, PushRejected

# Priorities at equal times: steps that end produce pushes, pushes arrive, then replies
# leave with the resulting Θ, and only then do learners start new work.
STEP, ARRIVE, DEADLINE, REPLY, RECEIVE = range(5)


@dataclasses.dataclass
class LearnerClock:
  """One learner's timeline and accounting, in virtual seconds."""
  busy: float = 0.0          # Computing inner steps.
  useful: float = 0.0        # Busy time whose push was accepted (goodput's numerator).
  idle: float = 0.0          # Between a push and the next start: transfers, waiting for a merge.
  idle_since: float | None = None
  done_at: float | None = None  # When the token budget left this learner nothing to do.
  round_start: float = 0.0
  round_compute: float = 0.0
  round_steps: int = 0
  target: int | None = None
  pushes: int = 0
  dropped: int = 0           # Over-stale: counted by the syncer, not merged.
  rejected: int = 0          # Malformed: refused by the syncer.
  staleness: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class Simulation:
  """Runs one experiment on the virtual clock; `run()` returns the summary figures."""

  def __init__(self, exp: Experiment, writer: metrics_lib.MetricsWriter):
    self.exp, self.config, self.writer = exp, exp.config, writer
    self.syncer = exp.syncer
    self.blocking = exp.config.mode == "diloco"
    self.clocks = [LearnerClock() for _ in exp.learners]
    self.rngs = [np.random.default_rng([exp.config.sim.seed, m]) for m in range(len(exp.learners))]
    self.speeds = policy_lib.SpeedTracker(
        [1.0 / p.mean_step_seconds(f) for p, f in zip(exp.profiles, exp.flops_per_step)])
    self.steps_left = exp.config.outer_steps * exp.config.inner_steps * len(exp.learners)
    self.tokens_per_eval = (exp.config.eval_every * exp.config.inner_steps
                            * sum(l.batches.tokens_per_batch for l in exp.learners))
    self.next_eval_tokens = self.tokens_per_eval
    self.waiting: list[int] = []
    self._events, self._sequence, self.now = [], itertools.count(), 0.0
    self._begin = time.time()
    self.last_eval = None

  # Event plumbing.
  def _schedule(self, at: float, priority: int, kind, *payload) -> None:
    heapq.heappush(self._events, (at, priority, next(self._sequence), kind, payload))

  def _transfer_seconds(self) -> float:
    sim = self.config.sim
    bandwidth = sim.link_gbps * 1e9 / 8
    return sim.link_latency_seconds + (self.exp.bytes_per_sync / bandwidth if bandwidth else 0.0)

  @property
  def tokens(self) -> int:
    """Tokens processed by all learners so far (the run's budget and eval cadence)."""
    return sum(l.steps * l.batches.tokens_per_batch for l in self.exp.learners)

  def _clock(self, version: int) -> dict:
    return {"outer_step": version, "inner_step": max(l.steps for l in self.exp.learners), "tokens": self.tokens,
            "time": self.now, "wall_time": time.time() - self._begin}

  # Learner side.
  def _start_round(self, m: int) -> None:
    clock = self.clocks[m]
    clock.target = policy_lib.target_steps(self.config.policy, self.config.inner_steps, self.speeds.speeds[m],
                                           self.speeds.max_speed)
    clock.round_start, clock.round_compute, clock.round_steps = self.now, 0.0, 0
    self._next_step(m)

  def _next_step(self, m: int) -> None:
    clock = self.clocks[m]
    seconds = self.exp.profiles[m].step_seconds(self.exp.flops_per_step[m], self.rngs[m])
    if self.steps_left > 0 and policy_lib.keep_training(self.config.policy, clock.target, clock.round_steps,
                                                        clock.round_compute, seconds):
      self.steps_left -= 1
      clock.round_steps += 1
      clock.busy += seconds
      clock.round_compute += seconds
      if self.config.policy.speed_source == "measured":
        self.speeds.observe(m, seconds)
      self._schedule(self.now + seconds, STEP, self._on_step, m)
    elif clock.round_steps:
      self._finish_round(m)
    else:
      clock.done_at = self.now

  def _on_step(self, m: int) -> None:
    self.exp.learners[m].step()
    self._next_step(m)

  def _finish_round(self, m: int) -> None:
    learner, clock = self.exp.learners[m], self.clocks[m]
    for record in records.train_records(learner, self.syncer.version if self.syncer else 0, self.config.log_every,
                                        {"time": self.now, "wall_time": time.time() - self._begin}):
      self.writer.write(record)
    if self.syncer is None:  # ddp: no outer loop, the next round starts at once.
      self._maybe_evaluate(0)
      self._start_round(m)
      return
    clock.idle_since = self.now
    push = learner.push(self.syncer, compute_seconds=clock.round_compute)
    self._schedule(self.now + self._transfer_seconds(), ARRIVE, self._on_arrive, push, clock.round_compute)

  def _on_receive(self, m: int, params, version: int) -> None:
    self.exp.learners[m].pull(params, version)
    clock = self.clocks[m]
    clock.idle += self.now - clock.idle_since
    clock.idle_since = None
    if self.steps_left > 0:
      self._start_round(m)
    else:
      clock.done_at = self.now

  # Syncer side.
  def _on_arrive(self, push, compute_seconds: float) -> None:
    m, clock = push.learner, self.clocks[push.learner]
    staleness = self.syncer.version - push.base_version
    try:
      accepted, report = self.syncer.receive(push, self.now)
    except PushRejected as error:
      logging.warning("%s", error)
      clock.rejected += 1
      self._schedule(self.now, REPLY, self._on_reply, m)
      return
    clock.pushes += 1
    clock.staleness[staleness] += 1
    if accepted:
      clock.useful += compute_seconds
    else:
      clock.dropped += 1
    self.writer.write({"kind": "push", **self._clock(self.syncer.version), "learner": m,
                       "local_steps": push.local_steps, "tokens": push.tokens, "staleness": staleness,
                       "accepted": int(accepted)})
    if self.blocking and accepted:  # Waits for the merge that includes its push (maybe this one).
      self.waiting.append(m)
    else:
      self._schedule(self.now, REPLY, self._on_reply, m)
    if self.syncer.deadline is not None and report is None:
      self._schedule(self.syncer.deadline, DEADLINE, self._on_deadline)
    if report is not None:
      self._on_merge(report)

  def _on_deadline(self) -> None:
    report = self.syncer.on_deadline(self.now)
    if report is not None:
      self._on_merge(report)

  def _on_merge(self, report: MergeReport) -> None:
    self.syncer.observe_sync_seconds(self._transfer_seconds())  # ξ_sync: Θ's trip back to a learner.
    self._write_outer(report)
    self._maybe_evaluate(report.version)
    for m in self.waiting:
      self._schedule(self.now, REPLY, self._on_reply, m)
    self.waiting = []

  def _write_outer(self, report: MergeReport) -> None:
    self.writer.write({"kind": "outer", **self._clock(report.version), "learners": list(report.learners),
                       "staleness": list(report.staleness), "weights": list(report.weights)})

  def _on_reply(self, m: int) -> None:
    """Θ leaves the syncer now (a snapshot) and reaches the learner after the transfer."""
    self._schedule(self.now + self._transfer_seconds(), RECEIVE, self._on_receive, m, self.syncer.params,
                   self.syncer.version)

  def _maybe_evaluate(self, version: int, force: bool = False) -> None:
    if not force and self.tokens < self.next_eval_tokens:
      return
    while self.next_eval_tokens <= self.tokens:
      self.next_eval_tokens += self.tokens_per_eval
    record = records.eval_record(self.exp, self._clock(version))
    self.writer.write(record)
    self.last_eval = record
    gap = (f" (optimum {self.exp.corpus.optimal_loss:.3f}, gap {record['eval_loss'] - self.exp.corpus.optimal_loss:.3f})"
           if self.exp.corpus.optimal_loss is not None else "")
    logging.info("version %d | virtual %.1fs | steps per learner %s | eval %.3f%s", version, self.now,
                 [l.steps for l in self.exp.learners], record["eval_loss"], gap)

  def run(self) -> dict:
    """Processes events until the token budget is spent; then merges what is left and evaluates."""
    version = self.syncer.version if self.syncer else 0
    for m, learner in enumerate(self.exp.learners):
      if self.syncer is not None:
        learner.pull(self.syncer.params, version)
      self._start_round(m)
    while self._events:
      self.now, _, _, handler, payload = heapq.heappop(self._events)
      handler(*payload)
    if self.syncer is not None and self.syncer.pending:
      self._write_outer(self.syncer.merge(self.now))
    final_version = self.syncer.version if self.syncer else 0
    if self.last_eval is None or self.last_eval["tokens"] != self.tokens or self.last_eval["outer_step"] != final_version:
      self._maybe_evaluate(final_version, force=True)
    return self._summarize(final_version)

  def _summarize(self, version: int) -> dict:
    """Per-learner accounting records and the run's totals (goodput = useful / allocated chip-time)."""
    chips = [p.chips for p in self.exp.profiles]
    for m, (clock, learner) in enumerate(zip(self.clocks, self.exp.learners)):
      if clock.idle_since is not None:  # Pushed last and the run ended before a reply was needed.
        clock.idle += self.now - clock.idle_since
        clock.done_at, clock.idle_since = self.now, None
      self.writer.write({"kind": "learner_summary", **self._clock(version), "learner": m,
                         "busy_seconds": clock.busy, "idle_seconds": clock.idle,
                         "finished_early_seconds": self.now - (clock.done_at or self.now), "steps": learner.steps,
                         "tokens": learner.steps * learner.batches.tokens_per_batch, "pushes": clock.pushes,
                         "dropped": clock.dropped, "rejected": clock.rejected,
                         "staleness_histogram": {str(s): n for s, n in sorted(clock.staleness.items())}})
    allocated = sum(c * self.now for c in chips)
    useful = sum(c * (clock.useful if self.syncer else clock.busy) for c, clock in zip(chips, self.clocks))
    summary = {"eval_loss": self.last_eval["eval_loss"], "optimal_loss": self.exp.corpus.optimal_loss,
               "virtual_seconds": self.now, "goodput": useful / allocated if allocated else 0.0,
               "outer_updates": version, "steps": [l.steps for l in self.exp.learners],
               "idle_fraction": [round(c.idle / self.now, 4) if self.now else 0.0 for c in self.clocks],
               **({("merges" if k == "merges" else f"{k}_pushes"): v for k, v in self.syncer.counts.items()}
                  if self.syncer else {})}
    self.writer.write({"kind": "summary", **self._clock(version), **{k: v for k, v in summary.items()
                                                                     if k not in ("steps", "optimal_loss", "idle_fraction")}})
    return summary


def run(exp: Experiment, workdir: str) -> dict:
  """Simulates `exp` in `workdir` and checkpoints the final state; returns the summary."""
  if exp.config.resume:
    raise ConfigError("the virtual-clock runtime does not resume: rerun it (a seeded run is deterministic)")
  checkpoints = os.path.join(workdir, "checkpoints")
  if os.path.isdir(checkpoints) and os.listdir(checkpoints):
    raise ConfigError(f"workdir {workdir} already holds a run: pick a new --workdir")
  os.makedirs(workdir, exist_ok=True)
  # -1: a rerun after a crash (no checkpoint yet) drops every record of the crashed attempt.
  with metrics_lib.MetricsWriter(workdir, resume_from_step=-1) as writer:
    summary = Simulation(exp, writer).run()
  with checkpoint_lib.Checkpointer(checkpoints) as checkpointer:
    state = {f"learner_{l.index}": l.state for l in exp.learners}
    if exp.syncer is not None:
      state.update(syncer_params=exp.syncer.params, syncer_opt_state=exp.syncer.state.opt_state)
    checkpointer.save(summary["outer_updates"], state, {"config": exp.config.to_dict(), "summary": summary})
  return summary

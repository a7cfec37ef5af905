"""Virtual-clock runtime: real JAX steps, simulated time, deterministic event order.

Why: heterogeneous hardware and wide-area links are studied on one machine, so every
learner runs its real inner steps while time advances by what its hardware profile says a
step costs and transfers cost latency + bytes / bandwidth on its own link. Events run in
(time, priority, sequence) order, so a seeded run gives identical metrics twice. Modes
'decoupled', 'diloco' and 'ddp'; streaming, grace windows and failures are detailed in
docs/runtimes.md.
"""

import collections
import dataclasses
import heapq
import itertools
import time

import jax
import numpy as np

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import compression, fragments
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco import policy as policy_lib
from decoupled_diloco import storage
from decoupled_diloco.costmodel.link import Link
from decoupled_diloco.experiment import Experiment
from decoupled_diloco.run import account as account_lib
from decoupled_diloco.run import evaluator, records, schedule
from decoupled_diloco.run import monitor as monitor_lib
from decoupled_diloco.runtime import byzantine, failures as failures_lib
from decoupled_diloco.runtime import sim_checkpoint
from decoupled_diloco.syncer import MergeReport

# Priorities at equal times: steps that end produce pushes, pushes arrive, then replies
# leave with the resulting Θ, and only then do learners start new work.
STEP, ARRIVE, DEADLINE, REPLY, RECEIVE = range(5)


@dataclasses.dataclass(kw_only=True)
class LearnerClock(account_lib.Account):
  """One learner's timeline, in virtual seconds, on top of its account."""
  up: Link
  down: Link
  overlapped_steps: int = 0  # Steps computed while at least one fragment was in flight.
  period_open: bool = False  # Whether this period's target is set (it is chosen when its first step starts).
  round_compute: float = 0.0
  round_steps: int = 0
  target: int | None = None
  unsent: set = dataclasses.field(default_factory=set)  # Fragments not pushed yet this period.
  in_flight: dict = dataclasses.field(default_factory=dict)  # fragment -> inner step by which it must land.
  deferred: set = dataclasses.field(default_factory=set)  # Due again while still in flight: pushed on landing.
  landed: dict = dataclasses.field(default_factory=dict)  # fragment -> (Θ_p, version) waiting to be blended.
  compute_since_push: list = dataclasses.field(default_factory=list)
  epoch: int = 0  # Bumped by a failure: the step and Θ it had under way are void.
  step: float | None = None  # Nominal seconds of the step in progress (None: none is).


class Simulation:
  """Runs one experiment on the virtual clock; `run()` returns the summary figures."""

  def __init__(self, exp: Experiment, writer: metrics_lib.MetricsWriter, monitor: monitor_lib.Monitor | None = None):
    self.exp, self.config, self.writer = exp, exp.config, writer
    self.monitor = monitor  # Sees the records written (writer's observer): the run stops once it says diverged.
    self.syncer = exp.syncer
    self.blocking = exp.config.mode == "diloco"
    self.num_fragments = exp.learners[0].num_fragments
    self.overlap = exp.config.streaming.overlap_steps
    sim = exp.config.sim
    gbps = sim.learner_link_gbps or (sim.link_gbps,) * len(exp.learners)
    latency = sim.learner_link_latency_seconds or (sim.link_latency_seconds,) * len(exp.learners)
    self.clocks = [
        LearnerClock(up=Link(g, l), down=Link(g, l), compute_since_push=[0.0] * self.num_fragments)
        for g, l in zip(gbps, latency)]
    self.rngs = [np.random.default_rng([exp.config.sim.seed, m]) for m in range(len(exp.learners))]
    self.plan = exp.plan
    self.speeds = policy_lib.SpeedTracker(list(self.plan.declared_speeds))
    self.steps_left = self.plan.budget_steps
    self.eval_due = schedule.Every(self.plan.tokens_per_eval)
    if self.syncer is not None:  # Θ_p travels back in the downlink format; each fragment's share of the model.
      self.downlink = compression.Codec(format=exp.config.compression.downlink_format)
      shapes = [[x.shape for x in jax.tree.leaves(self.syncer.fragment_params(p))] for p in range(self.num_fragments)]
      self.down_bytes = [round(compression.wire_bytes(self.downlink, s) * exp.byte_scale) for s in shapes]
      fragment_bytes = fragments.fragment_bytes(self.syncer.params, self.syncer.assignment)
      self.shares = [b / sum(fragment_bytes) for b in fragment_bytes]
    self.waiting: dict[int, list[int]] = collections.defaultdict(list)
    self._events, self._sequence, self.now = [], itertools.count(), 0.0
    self._begin = time.time()
    self.last_eval = None
    failure_settings = failures_lib.Settings.from_config(exp.config)
    self.failures = failures_lib.Injector(failure_settings, self) if failure_settings else None
    self.byzantine = byzantine.Settings.from_config(exp.config)

  # Event plumbing.
  def _schedule(self, at: float, priority: int, kind, *payload) -> None:
    heapq.heappush(self._events, (at, priority, next(self._sequence), kind, payload))

  @property
  def tokens(self) -> int:
    """Tokens processed by all learners so far (the run's budget and eval cadence)."""
    return sum(l.steps * l.batches.tokens_per_batch for l in self.exp.learners)

  def _clock(self, version: int) -> dict:
    return {
        "outer_step": version, "inner_step": max(l.steps for l in self.exp.learners), "tokens": self.tokens,
        "time": self.now, "wall_time": time.time() - self._begin}

  # Learner side: periods of H steps; fragment p is pushed at its offset in the period and
  # must have landed `overlap_steps` steps later.
  def _start_period(self, m: int) -> None:
    clock = self.clocks[m]
    clock.period_open, clock.round_compute, clock.round_steps = False, 0.0, 0
    clock.unsent = set(range(self.num_fragments))
    if self.failures:
      self.failures.on_period(m)
    self._next_step(m)

  def _next_step(self, m: int) -> None:
    learner, clock = self.exp.learners[m], self.clocks[m]
    for p in [
        p for p in clock.landed if clock.in_flight[p] <= learner.steps or p in clock.deferred or self.steps_left == 0]:
      if learner.take(p, *clock.landed.pop(p)):  # Counts restart here (the share α carries over).
        clock.compute_since_push[p] *= learner.alpha
      del clock.in_flight[p]
    for p in sorted(clock.deferred - clock.in_flight.keys()):
      clock.deferred.discard(p)
      if learner.steps_since_push[p]:  # (With α = 0 the landing dropped the steps it was due for.)
        self._push(m, p)
    if (any(needed <= learner.steps or p in clock.deferred for p, needed in clock.in_flight.items()) or
        (self.steps_left == 0 and clock.in_flight)):
      if clock.idle_since is None:  # (Waiting for the last merges once the budget is spent is no stall.)
        clock.idle_since, clock.stalls = self.now, clock.stalls + (self.steps_left > 0)
      return
    if clock.idle_since is not None:
      clock.idle += self.now - clock.idle_since
      clock.idle_since = None
    if not clock.period_open:
      clock.period_open = True
      clock.target = policy_lib.target_steps(self.config.policy, self.config.inner_steps, self.speeds.speeds[m],
                                             self.speeds.max_speed)
    if self.steps_left == 0 and clock.round_steps == 0:
      self._flush_learner(m)
      return
    seconds = self.plan.profiles[m].step_seconds(self.plan.flops_per_step[m], self.rngs[m])
    if self.steps_left > 0 and policy_lib.keep_training(self.config.policy, clock.target, clock.round_steps,
                                                        clock.round_compute, seconds):
      self.steps_left -= 1
      clock.round_steps += 1
      clock.busy += seconds
      clock.round_compute += seconds
      clock.compute_since_push = [c + seconds for c in clock.compute_since_push]
      clock.overlapped_steps += bool(clock.in_flight)
      if self.config.policy.speed_source == "measured":
        self.speeds.observe(m, seconds)
      elapsed = self.failures.step_seconds(m, seconds) if self.failures else seconds
      clock.step = seconds
      self._schedule(self.now + elapsed, STEP, self._on_step, m, clock.epoch)
    else:
      self._end_period(m)

  def _on_step(self, m: int, epoch: int) -> None:
    clock = self.clocks[m]
    if epoch != clock.epoch:  # A failure voided it.
      return
    clock.step = None
    self.exp.learners[m].step()
    if self.syncer is not None and clock.target is not None:
      for p in fragments.due(clock.round_steps, self.num_fragments, clock.target):
        self._request_push(m, p)
    self._next_step(m)

  def _end_period(self, m: int) -> None:
    """The period's work is done: log it, push what is still unsent, start the next one."""
    learner, clock = self.exp.learners[m], self.clocks[m]
    for record in records.train_records(learner, self.syncer.version if self.syncer else 0, self.config.log_every,
                                        {"time": self.now, "wall_time": time.time() - self._begin}):
      self.writer.write(record)
    if self.syncer is None:  # ddp: no outer loop.
      self._maybe_evaluate(0)
    else:
      for p in sorted(clock.unsent):
        self._request_push(m, p)
    self._start_period(m)

  def _flush_learner(self, m: int) -> None:
    """Out of budget: push every fragment with unpushed work (its anchor has landed), then stop."""
    learner, clock = self.exp.learners[m], self.clocks[m]
    for p in range(self.num_fragments):
      if self.syncer is not None and learner.steps_since_push[p] and p not in clock.in_flight:
        self._push(m, p)
    if clock.in_flight:  # The last merges have yet to land; _next_step is called again when they do.
      clock.idle_since = self.now
    else:
      clock.done_at = self.now

  def _request_push(self, m: int, p: int) -> None:
    """Pushes fragment p now, or once its previous push has landed (a short DyLU period can
    bring a fragment's turn round again within tau steps); the learner stalls until then."""
    clock = self.clocks[m]
    clock.unsent.discard(p)
    if p in clock.in_flight:
      clock.deferred.add(p)
    elif self.exp.learners[m].steps_since_push[p]:  # (Landed after the last step, α = 0: nothing left to push.)
      self._push(m, p)

  def _push(self, m: int, p: int) -> None:
    learner, clock = self.exp.learners[m], self.clocks[m]
    clock.unsent.discard(p)
    push = learner.push(p, compute_seconds=clock.compute_since_push[p])
    push = byzantine.corrupt(push, self.byzantine, learner.steps)
    clock.compute_since_push[p] = 0.0
    clock.in_flight[p] = learner.steps + self.overlap
    arrival = clock.up.send(self.now, round(push.wire_bytes * self.exp.byte_scale))
    self._schedule(arrival, ARRIVE, self._on_arrive, push, push.compute_seconds, len(clock.in_flight), clock.epoch)

  def _on_receive(self, m: int, p: int, params, version: int, epoch: int) -> None:
    clock = self.clocks[m]
    if epoch != clock.epoch:  # Sent to a learner that has failed since: it rejoins with Θ.
      return
    clock.landed[p] = (params, version)
    if clock.idle_since is not None:  # Stalled on this (or on the run's end): go on.
      self._next_step(m)

  # Syncer side.
  def _on_arrive(self, push, compute_seconds: float, in_flight: int, epoch: int) -> None:
    """The syncer takes a push; its reply leaves now, or with the merge the push waits for.

    A push that opened or joined a grace window waits for that window's merge in every mode:
    the window exists so that the pushing learners receive a merge that includes their work
    within their τ steps of slack (docs/syncer.md); replying with the Θ from before the merge
    would hand them a Θ without their own push.
    """
    m, fragment = push.learner, push.fragment
    taken = account_lib.hand_over(self.syncer, self.clocks[m], push, self.now, compute_seconds * self.shares[fragment],
                                  round(push.wire_bytes * self.exp.byte_scale))
    if taken is None:
      self._schedule(self.now, REPLY, self._on_reply, m, fragment, epoch)
      return
    accepted, report, staleness = taken
    self.writer.write(
        records.push(self._clock(self.syncer.version), push, staleness, accepted, self.syncer.verdict,
                     in_flight=in_flight))
    deadline = self.syncer.fragments[fragment].deadline
    if accepted and (self.blocking or (report is None and deadline is not None)):
      self.waiting[fragment].append((m, epoch))  # Waits for the merge that includes its push (maybe this one).
    else:
      self._schedule(self.now, REPLY, self._on_reply, m, fragment, epoch)
    if deadline is not None and report is None:
      self._schedule(deadline, DEADLINE, self._on_deadline)
    if report is not None:
      self._on_merge(report)

  def _on_deadline(self) -> None:
    for report in self.syncer.on_deadline(self.now):
      self._on_merge(report)

  def _on_merge(self, report: MergeReport) -> None:
    # ξ_sync: Θ_p's trip back to a learner.
    self.syncer.observe_sync_seconds(self.clocks[report.learners[0]].down.seconds(self.down_bytes[report.fragment]))
    self._write_outer(report)
    self._maybe_evaluate(report.version)
    for m, epoch in self.waiting.pop(report.fragment, []):
      self._schedule(self.now, REPLY, self._on_reply, m, report.fragment, epoch)

  def _write_outer(self, report: MergeReport) -> None:
    account_lib.count_trimmed(self.clocks, report)
    self.writer.write(records.outer(self._clock(report.version), report))

  def _on_reply(self, m: int, p: int, epoch: int) -> None:
    """Θ_p leaves the syncer now (a snapshot) and reaches the learner after its downlink's queue,
    unless the learner failed since it pushed (`epoch`): it rejoins with Θ instead."""
    if epoch != self.clocks[m].epoch:
      return
    arrival = self.clocks[m].down.send(self.now, self.down_bytes[p])
    theta = self.syncer.fragment_params(p)
    if self.downlink.format != "fp32":  # What the learner gets is what the wire carried.
      theta = jax.tree.unflatten(
          jax.tree.structure(theta),
          compression.decode(self.downlink, compression.encode(self.downlink, jax.tree.leaves(theta))))
    self._schedule(arrival, RECEIVE, self._on_receive, m, p, theta, self.syncer.fragments[p].version, epoch)

  def _maybe_evaluate(self, version: int, force: bool = False) -> None:
    if not self.eval_due.due(self.tokens) and not force:
      return
    record = evaluator.evaluate(self.exp, self._clock(version))
    self.writer.write(record)  # The monitor, if any, prints the progress line and judges the loss.
    self.last_eval = record

  @property
  def diverged(self) -> str | None:
    """Why the run diverged (its monitor's verdict), or None."""
    return self.monitor.diverged if self.monitor is not None else None

  def run(self, between_events=None, resumed: bool = False) -> dict:
    """Processes events until the token budget is spent; then merges what is left and evaluates.

    `between_events()` runs after each event (checkpoints); `resumed`: the state was restored
    mid-run (sim_checkpoint), so the learners do not start afresh.
    """
    for m, learner in enumerate(self.exp.learners if not resumed else []):
      if self.syncer is not None:
        learner.start_from(self.syncer.params, self.syncer.versions)
      self._start_period(m)
    if self.failures:
      self.failures.start()
    # Once the budget is spent, pending failure events (and rejoins) no longer matter.
    while self._events and not self.diverged and not (self.steps_left == 0 and all(e[1] >= failures_lib.FAIL
                                                                                   for e in self._events)):
      self.now, _, _, handler, payload = heapq.heappop(self._events)
      handler(*payload)
      if between_events is not None:
        between_events()
    if self.syncer is not None:
      for report in self.syncer.flush(self.now):
        self._write_outer(report)
    final_version = self.syncer.version if self.syncer else 0
    if self.last_eval is None or self.last_eval["tokens"] != self.tokens or self.last_eval[
        "outer_step"] != final_version:
      self._maybe_evaluate(final_version, force=True)
    return self._summarize(final_version)

  def _summarize(self, version: int) -> dict:
    """Per-learner accounting records and the run's totals (goodput = useful / allocated chip-time)."""
    for account in self.clocks:
      if account.idle_since is not None:  # Pushed last and the run ended before a reply was needed.
        account.idle += self.now - account.idle_since
        account.done_at, account.idle_since = self.now, None
    per_learner = [
        dict(overlapped_steps=c.overlapped_steps, bytes_sent=c.up.bytes, bytes_received=c.down.bytes,
             uplink_busy_seconds=c.up.busy, downlink_busy_seconds=c.down.busy) for c in self.clocks]
    return records.write_summaries(
        self.writer.write, self.exp, self._clock(version), self.clocks, self.now, [p.chips for p in self.plan.profiles],
        [a.useful if self.syncer else a.busy for a in self.clocks], per_learner, eval_loss=self.last_eval["eval_loss"],
        virtual_seconds=self.now, bytes_sent=sum(c.up.bytes for c in self.clocks), diverged=bool(self.diverged),
        idle_fraction=[round(c.idle / self.now, 4) if self.now else 0.0 for c in self.clocks],
        **(self.failures.summary(self.now) if self.failures else {}))


def run(exp: Experiment, workdir: str) -> dict:
  """Simulates `exp` in `workdir`, checkpointing every checkpoint_every rounds' tokens and at the end;
  with resume=True continues from the latest checkpoint, writing exactly the records an
  uninterrupted run writes (those after the checkpoint are replaced). Returns the summary."""
  with checkpoint_lib.Checkpointer(storage.makedirs(workdir) / "checkpoints") as checkpointer:
    resume_from = sim_checkpoint.latest(checkpointer, exp, workdir)
    # Without a checkpoint, a rerun after a crash drops every record of the crashed attempt.
    monitor = monitor_lib.Monitor.for_config(exp.config, exp.corpus.optimal_loss)
    with metrics_lib.MetricsWriter(workdir, keep_records=resume_from["records"] if resume_from else 0,
                                   observer=monitor.observe) as writer:
      simulation = Simulation(exp, writer, monitor)
      if resume_from is not None:
        sim_checkpoint.restore(checkpointer, simulation, resume_from)
      summary = simulation.run(sim_checkpoint.Cadence(checkpointer, simulation), resumed=resume_from is not None)
      sim_checkpoint.save(checkpointer, simulation, done=True, summary=summary)
  return summary

"""Real-time runtime: every learner group in one process, one thread each, wall-clock time.

For a single TPU VM or a Colab. The groups sit on disjoint device subsets, so one Python
thread per group keeps every subset busy (JAX dispatch releases the GIL while devices
compute). The syncer is the virtual clock's state machine behind one condition variable,
held only to hand a push over or read Θ, and the step budget has a lock of its own, so no
learner holds a lock while it computes. Modes, DyLU on measured speeds, slowdown, the
budget and the accounting are detailed in docs/runtimes.md.
"""

import concurrent.futures
import contextlib
import threading
import time

from absl import logging
import jax

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco import policy as policy_lib
from decoupled_diloco.experiment import Experiment
from decoupled_diloco.run import account as account_lib
from decoupled_diloco.run import evaluator as evaluator_lib
from decoupled_diloco.run import monitor as monitor_lib
from decoupled_diloco.run import records, schedule, state
from decoupled_diloco.runtime import byzantine
from decoupled_diloco import push as push_lib
from decoupled_diloco.push import Push
from decoupled_diloco.syncer import MergeReport


class ThreadedRun:
  """Runs one experiment with a thread per learner; `run()` returns the summary figures."""

  def __init__(self, exp: Experiment, writer: metrics_lib.MetricsWriter, monitor: monitor_lib.Monitor | None = None):
    config = exp.config
    self.monitor = monitor  # Sees the records written (writer's observer): learners stop once it says diverged.
    schedule.require_supported(config.mode, "threads")
    self.exp, self.config, self.writer, self.syncer = exp, config, records.Recorder(writer), exp.syncer
    self.blocking = config.mode == "diloco"
    num = len(exp.learners)
    self.plan = exp.plan
    self.accounts = [account_lib.Account() for _ in range(num)]
    self.byzantine = byzantine.Settings.from_config(config)
    # Under the budget lock: the budget, tokens done, measured speeds (0 = none yet).
    self.budget = threading.Lock()
    self.steps_left = self.plan.budget_steps
    self.tokens = 0
    self.measured = policy_lib.SpeedTracker([0.0] * num)
    # Under the syncer lock: the syncer and the coordination below.
    self.lock = threading.Condition()
    self.pushed: set[int] = set()  # diloco: learners that handed their push over since the last merge.
    self.waiting: set[int] = set()  # Learners waiting for a merge (diloco, or in a grace window).
    self.done: set[int] = set()
    self.eval_due = schedule.Every(self.plan.tokens_per_eval)
    self.syncer_seconds = 0.0  # Time the syncer spent receiving and merging (lock held).
    self.stopping, self.failure = False, None
    # Lock order: syncer lock, then budget lock, then the writer's lock; never the other way round.
    self.evaluator: evaluator_lib.Evaluator | None = None  # Started with the clock (run()).
    self._start, self._begin = time.monotonic(), time.time()

  def now(self) -> float:
    """Wall-clock seconds since the run started: the syncer's `now`."""
    return time.monotonic() - self._start

  def _clock(self, version: int) -> dict:
    with self.budget:
      steps, tokens = max(a.steps for a in self.accounts), self.tokens
    return {
        "outer_step": version, "inner_step": steps, "tokens": tokens, "time": self.now(),
        "wall_time": time.time() - self._begin}

  @contextlib.contextmanager
  def _holding(self, m: int, lock):
    """`lock`, the wait for it counted as learner m's blocked time."""
    asked = time.monotonic()
    with lock:
      self.accounts[m].blocked += time.monotonic() - asked
      yield

  def _wait(self, m: int, predicate) -> None:
    """Waits (syncer lock held, released meanwhile) until `predicate` holds or the run failed."""
    asked = time.monotonic()
    self.lock.wait_for(lambda: predicate() or self.failure is not None)
    self.accounts[m].blocked += time.monotonic() - asked

  # Learner threads.
  def _learner(self, m: int) -> None:
    try:
      with self._holding(m, self.lock):
        params, versions = self.syncer.params, self.syncer.versions
      self.exp.learners[m].start_from(params, versions)
      while self._round(m):
        pass
    except BaseException as error:  # pylint: disable=broad-except
      self._fail(error)
    finally:
      with self.lock:
        self.accounts[m].done_at = self.now()
        self.done.add(m)
        self.lock.notify_all()

  def _round(self, m: int) -> bool:
    """Local work, push, newest Θ; False once the budget left this learner nothing to do."""
    learner, compute, steps = self.exp.learners[m], 0.0, 0
    with self._holding(m, self.budget):
      target = self._target(m)
    while self._claim_step(m, target, steps, compute):
      seconds = learner.timed_step(self.plan.slowdown[m])  # Waited for: its wall-clock time is what DyLU measures.
      compute, steps = compute + seconds, steps + 1
      with self._holding(m, self.budget):
        self._account_step(m, seconds)
    if steps == 0:
      return False
    push = byzantine.corrupt(learner.push(0, compute_seconds=compute), self.byzantine, learner.steps)
    with self._holding(m, self.lock):
      # Every step was waited for: draining its losses here only copies scalars.
      extra = {"time": self.now(), "wall_time": time.time() - self._begin}
      for record in records.train_records(learner, self.syncer.version, self.config.log_every, extra):
        self.writer.write(record)
      if self.blocking:  # Hand over in learner order: the merge then sums as lockstep does.
        self._wait(m, lambda: all(k in self.pushed or k in self.done for k in range(m)))
      # Wait for the merge that includes the push: always in diloco, and in a grace window (docs/syncer.md).
      if self._hand_over(m, push) and (self.blocking or self.syncer.in_window(m, 0)):
        self.waiting.add(m)
        self.lock.notify_all()
        self._wait(m, lambda: not self.syncer.holds(m, 0) or self._no_merge_coming())
        self.waiting.discard(m)
      params, version = self.syncer.fragment_params(0), self.syncer.versions[0]
    learner.take(0, params, version)
    return True

  def _target(self, m: int) -> int | None:
    """The round's steps (budget lock held): DyLU on measured speeds once every learner has one."""
    speeds = self.plan.declared_speeds
    if self.config.policy.speed_source == "measured" and min(self.measured.speeds) > 0:
      speeds = self.measured.speeds
    return policy_lib.target_steps(self.config.policy, self.config.inner_steps, speeds[m], max(speeds))

  def _claim_step(self, m: int, target: int | None, steps: int, compute: float) -> bool:
    """Takes one step of the run's budget if the round and the budget allow it."""
    with self._holding(m, self.budget):
      speed = self.measured.speeds[m]
      if self.failure is not None or self.steps_left == 0 or self.diverged or not policy_lib.keep_training(
          self.config.policy, target, steps, compute, 1.0 / speed if speed else 0.0):
        return False
      self.steps_left -= 1
      return True

  def _account_step(self, m: int, seconds: float) -> None:
    """A finished step (budget lock held): tokens, busy time and, after the first, the speed."""
    account = self.accounts[m]
    account.steps += 1
    account.busy += seconds
    self.tokens += self.exp.learners[m].batches.tokens_per_batch
    if account.steps >= 2:  # The first step pays one-off dispatch costs.
      self.measured.observe(m, seconds)

  @property
  def diverged(self) -> str | None:
    """Why the run diverged (its monitor's verdict, from the background evaluator), or None."""
    return self.monitor.diverged if self.monitor is not None else None

  # Syncer side (syncer lock held).
  def _hand_over(self, m: int, push) -> bool:
    """receive() at wall-clock now; records the push and any merge. True if it was accepted."""
    began = time.monotonic()
    self.pushed.add(m)
    taken = account_lib.hand_over(self.syncer, self.accounts[m], push, self.now(), push.compute_seconds,
                                  push.wire_bytes)
    self.syncer_seconds += time.monotonic() - began
    if taken is None:
      return False
    accepted, report, staleness = taken
    self.writer.write(records.push(self._clock(self.syncer.version), push, staleness, accepted, self.syncer.verdict))
    if report is not None:
      self.syncer.observe_sync_seconds(time.monotonic() - began)  # ξ_sync: the merge's own duration.
      self._on_merge(report, "push")
    elif self.syncer.deadlines:
      self.lock.notify_all()  # The timer thread picks the new grace window up.
    return accepted

  def _no_merge_coming(self) -> bool:
    """The budget is spent and nobody will push again: the quorum (diloco) or the window can no longer fill."""
    with self.budget:
      spent = self.steps_left == 0 or self.diverged
    return bool(spent) and all(k in self.waiting or k in self.done for k in range(len(self.accounts)))

  def _on_merge(self, report: MergeReport, trigger: str) -> None:
    """Records a merge ('push': it completed the quorum; 'deadline': a grace window closed;
    'end': what was left when the budget ran out) and queues Θ's evaluation when it is due."""
    clock = self._clock(report.version)
    account_lib.count_trimmed(self.accounts, report)
    self.writer.write(records.outer(clock, report, trigger=trigger))
    self.pushed.clear()
    if self.eval_due.due(clock["tokens"]):
      self.evaluator.submit(self.syncer.params, clock)  # A snapshot: Θ's arrays are never changed in place.
    self.lock.notify_all()

  # Helper threads.
  def _timer(self) -> None:
    """Closes grace windows on time: sleeps on the syncer lock until the earliest deadline."""
    with self.lock:
      while not self.stopping and self.failure is None:
        deadlines = self.syncer.deadlines
        if not deadlines or min(deadlines) > self.now():
          self.lock.wait(min(deadlines) - self.now() if deadlines else None)
          continue
        began = time.monotonic()
        reports = self.syncer.on_deadline(self.now())
        self.syncer_seconds += time.monotonic() - began
        for report in reports:
          self._on_merge(report, "deadline")

  def _compile(self, m: int) -> None:
    """Compiles what learner m runs before the clock starts: inner step, pseudo-gradient, push check.

    Compilation is not a step time: left in, it would be measured as one (DyLU) and, with
    several groups, spent while the others already train. Ahead-of-time compiling fills
    the same cache the calls use, and allocates nothing but one batch; the syncer's push
    validation runs once on Θ itself (same shapes as a push; no state changes). The merge
    compiles at the first merge of each size, under the syncer's lock.
    """
    learner = self.exp.learners[m]
    learner.loop.step.lower(learner.state, learner.loop.put_batch(learner.batches.batch(learner.steps))).compile()
    if m == 0:
      learner.loop.loss.lower(learner.params, learner.loop.put_batch(self.exp.evals.batches[0])).compile()
    push_lib.validate(Push(m, self.syncer.fragment_params(0), 0, 1, 1), self.syncer.learners, self.syncer.fragments,
                      self.syncer.codec)

  def _guarded(self, target):

    def body():
      try:
        target()
      except BaseException as error:  # pylint: disable=broad-except
        self._fail(error)

    return body

  def _fail(self, error: BaseException) -> None:
    """The first error of any thread stops every thread; run() re-raises it."""
    with self.lock:
      if self.failure is None:
        self.failure = error
      self.lock.notify_all()

  def run(self) -> dict:
    """Starts the threads, waits for the budget to be spent, merges what is left, evaluates."""
    helpers = [threading.Thread(target=self._guarded(self._timer), name="syncer-timer", daemon=True)]
    learners = [
        threading.Thread(target=self._learner, args=(m,), name=f"learner-{m}", daemon=True)
        for m in range(len(self.exp.learners))]
    with concurrent.futures.ThreadPoolExecutor(len(learners)) as pool:
      list(pool.map(self._compile, range(len(learners))))
    self._start, self._begin = time.monotonic(), time.time()
    self.evaluator = evaluator_lib.Evaluator(lambda params: self.exp.learners[0].evaluate(params, self.exp.evals),
                                             self.exp.evals, self.writer.write)
    for thread in helpers + learners:
      thread.start()
    for thread in learners:
      thread.join()
    with self.lock:
      end = self.now()
      self.stopping = True
      if self.failure is None:
        for report in self.syncer.flush(end):
          self._on_merge(report, "end")
        clock = self._clock(self.syncer.version)
        last = self.evaluator.last_queued or {}
        if (last.get("tokens"), last.get("outer_step")) != (clock["tokens"], clock["outer_step"]):
          self.evaluator.submit(self.syncer.params, clock)
      self.lock.notify_all()
    self.evaluator.close()
    for thread in helpers:
      thread.join()
    if self.failure is not None:
      raise self.failure
    return self._summarize(end)

  def _summarize(self, end: float) -> dict:
    """Per-learner accounting records and the run's totals (goodput = useful / allocated device-time)."""
    theta_bytes = sum(x.nbytes for x in jax.tree.leaves(self.syncer.params))
    for account in self.accounts:
      account.idle = max(0.0, account.done_at - account.busy - account.blocked)
      account.bytes_received = (account.pushes + account.rejected + 1) * theta_bytes
    per_learner = [dict(wall_seconds=end, blocked_fraction=a.blocked / end) for a in self.accounts]
    return records.write_summaries(self.writer.write, self.exp, self._clock(self.syncer.version), self.accounts, end,
                                   self.config.learners.devices, [a.useful for a in self.accounts], per_learner,
                                   eval_loss=self.evaluator.last["eval_loss"], wall_seconds=end,
                                   syncer_seconds=self.syncer_seconds, diverged=bool(self.diverged),
                                   bytes_sent=sum(a.bytes_sent for a in self.accounts),
                                   blocked_fraction=[round(a.blocked / end, 4) for a in self.accounts])


def run(exp: Experiment, workdir: str) -> dict:
  """Trains `exp` in real time in `workdir` and checkpoints the final state; returns the summary."""
  checkpoints = records.fresh_workdir(workdir, exp.config.resume,
                                      "the threads runtime does not resume: start a new run with a new --workdir")
  monitor = monitor_lib.Monitor.for_config(exp.config, exp.corpus.optimal_loss)
  with metrics_lib.MetricsWriter(workdir, resume_from_step=-1, observer=monitor.observe) as writer:
    summary = ThreadedRun(exp, writer, monitor).run()
  logging.info("wall-clock %.1fs, goodput %.3f, %d outer updates, steps per learner %s, blocked fraction %s",
               summary["wall_seconds"], summary["goodput"], summary["outer_updates"], summary["steps"],
               summary["blocked_fraction"])
  with checkpoint_lib.Checkpointer(checkpoints) as checkpointer:
    version = summary["outer_updates"]
    state.save(checkpointer, exp, version, state.metadata(exp, version, summary=summary))
  return summary

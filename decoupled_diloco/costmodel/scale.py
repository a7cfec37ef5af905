"""Goodput under chip failures at scale: cost-model learners driven by the real syncer.

Why: a scale study (a million chips, thousands of failures) cannot run real steps and needs
none, since what decides goodput is *when* groups compute, fail, wait and push. So each
learner group is a cost model, while every push goes through the real `Syncer` (tiny zero
pseudo-gradients), so versions, staleness, quorum and merges are the state machine's own.
The failure model (elastic or not), the goodput definition and the seeding are in
docs/costmodels.md.
"""

import dataclasses
import heapq
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decoupled_diloco import policy as policy_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.push import Push
from decoupled_diloco.syncer import Settings, Syncer

SECONDS_PER_YEAR = 365 * 24 * 3600
# Priorities at equal times: repairs land first, rounds that end push before a failure at
# the same instant can void them, then recoveries end, then failures strike.
REPAIR, ROUND_END, RESUME, FAIL = range(4)
_EPS = 1e-9  # Tolerance when counting whole steps in an interrupted segment.
# DiLoCo's outer Nesterov SGD (its updates are zero here). One shared object, because the
# syncer's jitted merge takes the optimizer as a static argument: a new one per
# simulation would recompile it every time.
OUTER_OPTIMIZER = optax.sgd(0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass(frozen=True)
class FailureModel:
  """How chips fail and what a failure costs (seconds and chips)."""
  mtbi_seconds: float = SECONDS_PER_YEAR  # Per-chip mean time between interruptions; inf = never fails.
  restart_seconds: float = 0.0  # Non-elastic groups: downtime of a full restart (re-schedule + restore).
  resize_seconds: float = 0.0  # Elastic groups: downtime of dropping a failed domain and re-forming.
  domain_chips: int = 256  # Elastic groups: chips one failure takes out (the failed chip's replica).
  repair_seconds: float = 3600.0  # Elastic groups: until the failed domain is back.

  @property
  def down_share(self) -> float:
    """Steady-state share of an elastic job's domains out for repair.

    Each domain alternates independently between live (failing at rate domain_chips/MTBI)
    and repair (repair_seconds), so it is down with probability x/(1 + x), x = domain_chips
    · repair / MTBI, with a residual repair time uniform over the repair: exact, whatever
    the distribution of live times, and the same for any group size.
    """
    x = self.domain_chips * self.repair_seconds / self.mtbi_seconds
    return x / (1 + x)

  def validate(self) -> None:
    """Rejects parameters that would make time run backwards or failures meaningless."""
    times = {
        "mtbi_seconds": self.mtbi_seconds, "restart_seconds": self.restart_seconds,
        "resize_seconds": self.resize_seconds, "repair_seconds": self.repair_seconds}
    for name, value in times.items():
      if not value >= 0 or (name == "mtbi_seconds" and value == 0):
        bound = "> 0" if name == "mtbi_seconds" else ">= 0"
        raise ConfigError(f"FailureModel.{name}={value} must be {bound} seconds: pass a duration {bound}")
    if not isinstance(self.domain_chips, int) or self.domain_chips < 1:
      raise ConfigError(f"FailureModel.domain_chips={self.domain_chips!r} must be an int >= 1: pass the chips "
                        "one failure takes out (e.g. 4 for a host, 256 for a slice)")


@dataclasses.dataclass
class _Group:
  """One cost-model learner group: chips, recovery state and the round in progress."""
  chips: int
  rng: np.random.Generator
  failed: int = 0  # Domains broken and waiting for repair.
  absent: int = 0  # Domains not in the current job (broken, or repaired but not yet rejoined).
  down: bool = False  # In a restart or resize.
  starved: bool = False  # Elastic and every domain is out: waits for a repair.
  epoch: int = 0  # Bumped by every interruption, so stale round-end events are ignored.
  steps_done: int = 0  # Whole steps of the current round kept so far.
  work: float = 0.0  # Chip-seconds of those steps.
  base_version: int = 0  # Syncer version the round started from.
  segment_start: float = 0.0


class ScaleSimulation:
  """M cost-model groups on N chips under a failure process; `run()` returns the figures."""

  def __init__(self, num_chips: int, num_learners: int, elastic: bool, failure_model: FailureModel,
               step_seconds: float = 1.0, inner_steps: int = 24, duration_seconds: float = 12 * 3600, seed: int = 0,
               quorum: int = 1, policy_kind: str = "fixed"):
    _validate(num_chips, num_learners, step_seconds, inner_steps, duration_seconds, quorum)
    failure_model.validate()
    if elastic and num_chips // num_learners < failure_model.domain_chips:
      raise ConfigError(f"a group of {num_chips // num_learners} chips is smaller than one failure domain "
                        f"({failure_model.domain_chips} chips): use fewer learners or a smaller domain_chips")
    if policy_kind == "time_budget":
      raise ConfigError("policy 'time_budget' needs measured step times: use 'fixed' or 'dylu' for scale runs")
    self.policy = policy_lib.Settings(kind=policy_kind)
    # Every group has the same chips and step time, so the policy's H is one number.
    self.target = policy_lib.target_steps(self.policy, inner_steps, 1.0, 1.0)
    self.elastic, self.fm, self.step = elastic, failure_model, step_seconds
    self.duration = duration_seconds
    params = {"w": jnp.zeros((), jnp.float32)}
    self.syncer = Syncer(OUTER_OPTIMIZER, params, range(num_learners), Settings(quorum=quorum))
    self.zeros = jax.device_put(params, self.syncer.device)
    chips = num_chips // num_learners
    self.groups = [_Group(chips, np.random.default_rng([seed, m])) for m in range(num_learners)]
    self.allocated = num_chips * duration_seconds
    self.useful = self.lost = self.pending_work = 0.0
    self.failures, self.staleness = 0, []
    self.merges: list[tuple[float, int]] = []  # (time, version) of every merge, in order.
    self._events, self._sequence, self.now = [], itertools.count(), 0.0

  def _schedule(self, at: float, kind: int, m: int, epoch: int = 0) -> None:
    heapq.heappush(self._events, (at, kind, next(self._sequence), m, epoch))

  def _active(self, g: _Group) -> int:
    """Chips in the group's job: all of them unless elastic domains are out."""
    return max(0, g.chips - g.absent * self.fm.domain_chips) if self.elastic else g.chips

  # A group's round: pull (if nothing is kept), run segments of whole steps, push.
  def _run_segment(self, m: int) -> None:
    g = self.groups[m]
    if self._active(g) == 0:
      g.starved = True
      return
    if g.steps_done == 0:  # Nothing local to keep: start from the current Θ.
      g.base_version, g.work = self.syncer.version, 0.0
    g.segment_start = self.now
    self._schedule(self.now + (self.target - g.steps_done) * self.step, ROUND_END, m, g.epoch)

  def _start_round(self, m: int) -> None:
    g = self.groups[m]
    g.absent = g.failed  # Repaired domains rejoin when the group re-forms at a push.
    g.steps_done = 0
    self._run_segment(m)

  def _on_round_end(self, m: int, epoch: int) -> None:
    g = self.groups[m]
    if epoch != g.epoch:
      return
    g.work += (self.target - g.steps_done) * self.step * self._active(g)
    g.steps_done = self.target
    self.staleness.append(self.syncer.version - g.base_version)
    push = Push(m, self.zeros, g.base_version, tokens=round(g.work / self.step), local_steps=self.target,
                compute_seconds=self.target * self.step)
    accepted, report = self.syncer.receive(push, self.now)
    if accepted:
      self.pending_work += g.work
    if report is not None:
      self.useful += self.pending_work
      self.pending_work = 0.0
      self.merges.append((report.time, report.version))
    self._start_round(m)

  # Failures and recoveries.
  def _on_fail(self, m: int) -> None:
    g = self.groups[m]
    self._schedule(self.now + g.rng.exponential(self.fm.mtbi_seconds / g.chips), FAIL, m)
    live = self._active(g)
    if g.rng.random() * g.chips >= live:  # Struck a chip already out of the job: nothing changes.
      return
    self.failures += 1
    if not (g.down or g.starved):
      elapsed = self.now - g.segment_start
      kept = min(self.target - g.steps_done, math.floor(elapsed / self.step + _EPS)) if self.elastic else 0
      g.work += kept * self.step * live
      self.lost += (elapsed - kept * self.step) * live  # Non-elastic: kept = 0, the whole round.
      g.steps_done = g.steps_done + kept if self.elastic else 0
      g.down, g.epoch = True, g.epoch + 1
      recovery = self.fm.resize_seconds if self.elastic else self.fm.restart_seconds
      self._schedule(self.now + recovery, RESUME, m, g.epoch)
    if self.elastic:
      g.failed, g.absent = g.failed + 1, g.absent + 1
      self._schedule(self.now + self.fm.repair_seconds, REPAIR, m)

  def _on_resume(self, m: int, epoch: int) -> None:
    g = self.groups[m]
    if epoch == g.epoch:
      g.down = False
      self._run_segment(m)

  def _on_repair(self, m: int) -> None:
    g = self.groups[m]
    g.failed -= 1
    if g.starved:
      g.starved, g.absent = False, g.failed
      self._run_segment(m)

  def run(self) -> dict:
    """Processes events up to `duration_seconds`; returns goodput and the syncer's figures."""
    for m, g in enumerate(self.groups):
      if math.isfinite(self.fm.mtbi_seconds):
        if self.elastic:  # Start in the stationary state of the repair queue (see down_share).
          for _ in range(g.rng.binomial(g.chips // self.fm.domain_chips, self.fm.down_share)):
            g.failed += 1
            self._schedule(g.rng.uniform(0.0, self.fm.repair_seconds), REPAIR, m)
        self._schedule(g.rng.exponential(self.fm.mtbi_seconds / g.chips), FAIL, m)
      self._start_round(m)
    handlers = {
        REPAIR: lambda m, _: self._on_repair(m), ROUND_END: self._on_round_end, RESUME: self._on_resume,
        FAIL: lambda m, _: self._on_fail(m)}
    while self._events and self._events[0][0] <= self.duration:
      self.now, kind, _, m, epoch = heapq.heappop(self._events)
      handlers[kind](m, epoch)
    counts = self.syncer.counts
    return {
        "goodput": self.useful / self.allocated, "lost_fraction": self.lost / self.allocated,
        "merges": counts["merges"], "version": self.syncer.version, "accepted": counts["accepted"],
        "dropped": counts["dropped"], "failures": self.failures,
        "mean_staleness": float(np.mean(self.staleness)) if self.staleness else 0.0,
        "max_staleness": max(self.staleness, default=0)}


def _validate(num_chips, num_learners, step_seconds, inner_steps, duration_seconds, quorum) -> None:
  """One clear message per impossible layout or duration."""
  if not isinstance(num_learners, int) or num_learners < 1 or not isinstance(num_chips, int) or num_chips < 1:
    raise ConfigError(f"num_chips={num_chips!r}, num_learners={num_learners!r}: both must be ints >= 1")
  if num_chips % num_learners:
    raise ConfigError(f"num_chips={num_chips} is not divisible by num_learners={num_learners}: "
                      "pick a chip count that splits into equal groups")
  if not step_seconds > 0 or not duration_seconds > 0:
    raise ConfigError(f"step_seconds={step_seconds}, duration_seconds={duration_seconds}: both must be > 0")
  if not isinstance(inner_steps, int) or inner_steps < 1 or not 0 <= quorum <= num_learners:
    raise ConfigError(f"inner_steps={inner_steps!r} must be an int >= 1 and quorum={quorum} in "
                      f"[0, {num_learners}] (0 = all learners)")


def simulate_goodput(num_chips: int, num_learners: int, elastic: bool, failure_model: FailureModel,
                     step_seconds: float = 1.0, inner_steps: int = 24, duration_seconds: float = 12 * 3600,
                     seed: int = 0, quorum: int = 1) -> dict:
  """Goodput of M learner groups sharing N chips under seeded failures (see the module doc).

  Data-parallel is one group pushing every step (inner_steps=1); Decoupled DiLoCo is M
  groups of N/M chips pushing every H steps to a quorum-K syncer. Same seed, same figures.
  """
  return ScaleSimulation(num_chips, num_learners, elastic, failure_model, step_seconds, inner_steps, duration_seconds,
                         seed, quorum).run()

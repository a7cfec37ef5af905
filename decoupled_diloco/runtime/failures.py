"""Chip failures with real math on the virtual clock: a seeded schedule and what a failure does.

The failure model is the goodput cost model's (`costmodel.scale.FailureModel`): every chip
fails as a Poisson process of rate 1 / mtbi_seconds, so a group of c chips fails at rate
c / MTBI. What a failure does here, to real learners with real state:
- a Decoupled DiLoCo learner group (mode 'decoupled') goes down: every step since its last
  checkpoint is lost (the budget gets them back, so other learners or its later self redo
  them), it is down for a drawn time (exponential, mean restart_seconds), and it rejoins
  with the current Θ and its own last checkpointed AdamW state and step count (stale
  optimizer state, fresh parameters, as the paper describes). The others never wait for it;
- a data-parallel job (mode 'ddp') that is not elastic stops: it loses everything since its
  checkpoint, is down for a drawn restart, and resumes from the checkpoint (params too);
- an elastic data-parallel job loses the step in progress, pauses for a drawn resize and
  goes on without the failed domain of domain_chips chips until it is repaired
  (repair_seconds): the surviving replicas take over its share of the batch, so each step
  takes chips / live times as long (same math, fewer chips). No chips left: it waits for a repair.
A learner checkpoints its inner state at the start of every `checkpoint_every`-th period
(with P = 1 that is just after its push, so a failure loses exactly the unpushed work).
Failures stop once the run's token budget is spent. Each learner draws from its own
Generator seeded by (failures.seed, learner), so a seed gives the same trace twice, and the
trace of failure times does not depend on the recovery parameters.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.costmodel import scale
from decoupled_diloco.errors import ConfigError

MODES = ("decoupled", "ddp")
_FIELDS = ("enabled", "mtbi_seconds", "restart_seconds", "resize_seconds", "domain_chips", "repair_seconds", "elastic",
           "checkpoint_every", "seed", "byzantine_learner", "byzantine_kind", "byzantine_scale"
          )  # config.failures, described in configs/default.py (byzantine_*: runtime/byzantine.py).


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.failures` once validated."""
  model: scale.FailureModel
  elastic: bool
  checkpoint_every: int
  seed: int

  @classmethod
  def from_config(cls, config) -> "Settings | None":
    """None when failures are off; ConfigError (naming the fix) for a setting that cannot be honoured."""
    cfg = config.failures
    settings_lib.refuse_unknown(cfg, "failures", _FIELDS)
    if not cfg.enabled:
      return None
    if config.runtime != "sim":
      raise ConfigError(f"failures.enabled needs the virtual clock, not runtime={config.runtime!r}: "
                        "add --config.runtime=sim (real runtimes see real failures)")
    if config.mode not in MODES:
      raise ConfigError(f"failures.enabled supports modes {MODES}, not {config.mode!r}: use --config.mode=decoupled "
                        "or ddp")
    if cfg.elastic and config.mode != "ddp":
      raise ConfigError("failures.elastic applies to the data-parallel baseline (mode='ddp'); decoupled learners "
                        "rejoin with Θ: drop --config.failures.elastic")
    if not isinstance(cfg.checkpoint_every, int) or cfg.checkpoint_every < 1:
      raise ConfigError(f"failures.checkpoint_every={cfg.checkpoint_every!r} must be an int >= 1 (periods between "
                        "a learner's checkpoints)")
    model = scale.FailureModel(float(cfg.mtbi_seconds), float(cfg.restart_seconds), float(cfg.resize_seconds),
                               cfg.domain_chips, float(cfg.repair_seconds))
    model.validate()
    return cls(model, bool(cfg.elastic), cfg.checkpoint_every, int(cfg.seed))


def next_failure(rng: np.random.Generator, now: float, chips: int, model: scale.FailureModel) -> float:
  """When a group of `chips` chips fails next: every chip is a Poisson process of rate 1 / MTBI."""
  return now + rng.exponential(model.mtbi_seconds / chips)


def downtime(rng: np.random.Generator, mean: float) -> float:
  """A drawn recovery time (exponential, so the mean is the model's); 0 stays 0."""
  return float(rng.exponential(mean)) if mean > 0 else 0.0


def live_chips(chips: int, failed_domains: int, model: scale.FailureModel) -> int:
  """Chips an elastic job still runs on with `failed_domains` domains out for repair."""
  return max(0, chips - failed_domains * model.domain_chips)


@dataclasses.dataclass
class Checkpoint:
  """A learner's inner state as saved: device copies, since the inner step donates its state."""
  steps: int
  step: jax.Array
  opt_state: object
  params: object  # Only data-parallel jobs restore params; decoupled learners take Θ.


def checkpoint(learner, with_params: bool) -> Checkpoint:
  """Copies the learner's step count and AdamW state (and params when asked)."""
  state = learner.state
  return Checkpoint(learner.steps, jnp.copy(state.step), jax.tree.map(jnp.copy, state.opt_state),
                    jax.tree.map(jnp.copy, state.params) if with_params else None)


def rejoin(learner, saved: Checkpoint, params=None, versions=None) -> None:
  """Restores `saved`'s step and AdamW state; params are Θ (`params`, `versions`) or the checkpoint's.

  Why copies again: the next inner step donates the state, which must not consume the
  checkpoint a later failure restores. Losses of the lost steps are dropped: those steps are
  taken again and logged then.
  """
  restored = saved.params if params is None else None
  state = learner.state._replace(step=jnp.copy(saved.step), opt_state=jax.tree.map(jnp.copy, saved.opt_state))
  if restored is not None:
    for leaf in jax.tree.leaves(state.params):
      leaf.delete()
    state = state._replace(params=jax.tree.map(jnp.copy, restored))
  learner.state, learner.steps = state, saved.steps
  kept = [(s, m) for s, m in learner._pending_metrics if s < saved.steps]  # pylint: disable=protected-access
  learner._pending_metrics = kept  # pylint: disable=protected-access
  if params is not None:
    learner.start_from(params, versions)


# Event priorities, after every priority of the virtual clock's own events (runtime/sim.py):
# a step that ends at the instant a chip fails is done, and what is left at the budget's end
# is only failure bookkeeping, which the clock then stops processing.
FAIL, REJOIN, REPAIR = 5, 6, 7


class Injector:
  """Drives failures of a `sim.Simulation`'s learners: its hooks are called by the clock.

  Reaches into the simulation's clocks, budget and event queue on purpose: a failure has to
  undo exactly the accounting the clock did for the work it destroys.
  """

  def __init__(self, settings: Settings, simulation):
    self.settings, self.sim = settings, simulation
    count = len(simulation.exp.learners)
    self.chips = [p.chips for p in simulation.plan.profiles]
    self.rngs = [np.random.default_rng([settings.seed, m]) for m in range(count)]
    self.saved = [None] * count
    self.periods = [0] * count
    self.since_checkpoint = [0.0] * count  # Nominal compute seconds since the last checkpoint.
    self.down_since: list[float | None] = [None] * count
    self.failed_domains = [0] * count
    self.starved = [False] * count
    self.failures = self.lost_steps = 0
    self.down_seconds = 0.0
    if settings.elastic:
      for m, chips in enumerate(self.chips):
        if chips < settings.model.domain_chips:
          raise ConfigError(f"learner group {m} has {chips} chips, fewer than one failure domain "
                            f"({settings.model.domain_chips}): lower failures.domain_chips or raise learners.chips")

  # Hooks called by the clock.
  def start(self) -> None:
    """Draws every group's first failure."""
    for m, chips in enumerate(self.chips):
      self.sim._schedule(next_failure(self.rngs[m], 0.0, chips, self.settings.model), FAIL, self._on_fail, m)

  def on_period(self, m: int) -> None:
    """A period starts: every checkpoint_every-th one, the learner checkpoints its inner state."""
    if self.periods[m] % self.settings.checkpoint_every == 0:
      self.saved[m] = checkpoint(self.sim.exp.learners[m], with_params=self.sim.syncer is None)
      self.since_checkpoint[m] = 0.0
    self.periods[m] += 1

  def step_seconds(self, m: int, seconds: float) -> float:
    """How long a step of nominal `seconds` takes on the chips the group still has."""
    self.since_checkpoint[m] += seconds
    if not self.settings.elastic:
      return seconds
    return seconds * self.chips[m] / live_chips(self.chips[m], self.failed_domains[m], self.settings.model)

  def summary(self, now: float) -> dict:
    """The run's failure figures (downtime of groups still down at the end counted up to `now`)."""
    still_down = sum(now - since for since in self.down_since if since is not None)
    return {"failures": self.failures, "lost_steps": self.lost_steps, "down_seconds": self.down_seconds + still_down}

  # Events.
  def _on_fail(self, m: int) -> None:
    sim, rng, model = self.sim, self.rngs[m], self.settings.model
    if sim.steps_left == 0:  # The budget is spent: the run is only finishing.
      return
    sim._schedule(next_failure(rng, sim.now, self.chips[m], model), FAIL, self._on_fail, m)
    if self.settings.elastic:
      live = live_chips(self.chips[m], self.failed_domains[m], model)
      if rng.random() * self.chips[m] >= live:  # Struck a chip already out of the job.
        return
      self.failures += 1
      self.failed_domains[m] += 1
      sim._schedule(sim.now + model.repair_seconds, REPAIR, self._on_repair, m)
      if self.down_since[m] is None and not self.starved[m]:  # Else folded into the recovery under way.
        self._interrupt(m, keep=True)
        sim._schedule(sim.now + downtime(rng, model.resize_seconds), REJOIN, self._on_rejoin, m)
      return
    if self.down_since[m] is not None or sim.clocks[m].done_at is not None:
      return
    self.failures += 1
    self._interrupt(m, keep=False)
    sim._schedule(sim.now + downtime(rng, model.restart_seconds), REJOIN, self._on_rejoin, m)

  def _interrupt(self, m: int, keep: bool) -> None:
    """Takes learner m down: the step in progress is lost, and unless `keep` all since its checkpoint."""
    sim, clock, learner = self.sim, self.sim.clocks[m], self.sim.exp.learners[m]
    in_progress = clock.step or 0.0
    lost = int(clock.step is not None) + (0 if keep else learner.steps - self.saved[m].steps)
    clock.busy -= in_progress if keep else self.since_checkpoint[m]
    if keep and clock.step is not None:
      clock.round_steps -= 1
      clock.round_compute -= in_progress
      clock.compute_since_push = [c - in_progress for c in clock.compute_since_push]
    sim.steps_left += lost
    self.lost_steps += lost
    clock.step, clock.epoch = None, clock.epoch + 1  # Its pending step and arriving Θ are void.
    if clock.idle_since is not None:
      clock.idle += sim.now - clock.idle_since
      clock.idle_since = None
    if not keep:
      clock.compute_since_push = [0.0] * len(clock.compute_since_push)
      clock.in_flight.clear()
      clock.landed.clear()
      clock.deferred.clear()
    self.down_since[m] = sim.now

  def _on_rejoin(self, m: int) -> None:
    if self.settings.elastic and live_chips(self.chips[m], self.failed_domains[m], self.settings.model) == 0:
      self.starved[m] = True  # No chip left: wait for a repair.
      return
    self._resume(m)

  def _on_repair(self, m: int) -> None:
    self.failed_domains[m] -= 1
    if self.starved[m]:
      self.starved[m] = False
      self._resume(m)

  def _resume(self, m: int) -> None:
    """Back up: an elastic job continues its period; a restarted group rejoins from its checkpoint."""
    sim = self.sim
    self.down_seconds += sim.now - self.down_since[m]
    self.down_since[m] = None
    if self.settings.elastic:
      sim._next_step(m)
      return
    if sim.syncer is None:
      rejoin(sim.exp.learners[m], self.saved[m])
    else:
      rejoin(sim.exp.learners[m], self.saved[m], sim.syncer.params, sim.syncer.versions)
    sim._start_period(m)

"""The run plan: what a config asks of a run, derived once, the same for every runtime and process.

(Not decoupled_diloco/plan.py, which is the compile plan of a model on a slice.)
"""

import dataclasses

from decoupled_diloco import hardware
from decoupled_diloco import model as model_lib
from decoupled_diloco.errors import ConfigError

# Which runtimes run each mode. 'service' is the syncer and learner processes (--role).
SUPPORTED = {
    "ddp": ("lockstep", "sim"),
    "diloco": ("lockstep", "sim", "threads", "service"),
    "decoupled": ("sim", "threads", "service"),}
_HINTS = {
    ("decoupled", "lockstep"): "mode='decoupled' needs a clock: add --config.runtime=sim (virtual) or "
                               "--config.runtime=threads (wall clock); the lockstep runtime runs rounds",
    ("ddp", "threads"): "runtime='threads' runs modes 'decoupled' and 'diloco': use --config.runtime=lockstep or sim "
                        "for ddp",
    ("ddp", "service"): "mode='ddp' has no syncer to serve: use --config.mode=diloco or decoupled with --role",}


def require_supported(mode: str, runtime: str) -> None:
  """Refuses a mode that `runtime` cannot run, naming the runtimes that can."""
  if runtime not in SUPPORTED.get(mode, (runtime,)):
    raise ConfigError(
        _HINTS.get((mode, runtime), f"runtime={runtime!r} does not run mode={mode!r}: use one of "
                   f"{SUPPORTED[mode]}"))


def flops_per_step(config) -> list[float]:
  """Training FLOPs of one inner step of each group: its batch on this model, or the simulated
  model and batch (sim.simulated_params / simulated_tokens_per_step) when they are set."""
  flops_per_token = (6.0 * config.sim.simulated_params
                     if config.sim.simulated_params else model_lib.flops_per_token(config.model))
  return [
      flops_per_token * (config.sim.simulated_tokens_per_step or batch * config.model.seq_len)
      for batch in config.learners.batch_size]


def declared_speeds(profiles, flops) -> list[float]:
  """Steps per second each group's hardware profile promises: DyLU's declared speeds."""
  return [1.0 / p.mean_step_seconds(f) for p, f in zip(profiles, flops)]


def expected_steps(config, profiles, flops) -> list[int]:
  """Inner steps each learner will take, which sizes its warmup + cosine schedule.

  In rounds (ddp, diloco) every learner takes outer_steps × inner_steps. Decoupled
  learners share the run's budget of outer_steps × inner_steps × M steps in proportion
  to their speed (more rounds, or DyLU's longer ones), so a fast learner's cosine is
  not over before the run is, nor a slow one's barely begun.
  """
  per_learner = config.outer_steps * config.inner_steps
  if config.mode != "decoupled":
    return [per_learner] * len(profiles)
  speeds = declared_speeds(profiles, flops)
  return [max(1, round(per_learner * len(speeds) * v / sum(speeds))) for v in speeds]


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """The run's shape: budget, cadence, per-learner schedule and declared speeds (pure, from the config)."""
  mode: str
  runtime: str
  inner_steps: int  # H.
  outer_steps: int
  eval_every: int  # Rounds' worth of tokens between evals of Θ.
  checkpoint_every: int  # Rounds' worth of tokens between checkpoints.
  tokens_per_batch: tuple[int, ...]  # Per learner: batch_size × seq_len.
  flops_per_step: tuple[float, ...]  # Per learner, at the simulated size.
  profiles: tuple[hardware.HardwareProfile, ...]
  declared_speeds: tuple[float, ...]  # Steps per second each profile promises (DyLU's declared input).
  expected_steps: tuple[int, ...]  # Inner steps each learner's LR schedule is sized for.
  slowdown: tuple[float, ...]  # Per learner: sleep × step time after each step (wall-clock runtimes).

  @classmethod
  def from_config(cls, config) -> "RunPlan":
    """The plan of a validated config."""
    profiles = hardware.profiles_from_config(config.learners, config.sim.reference_step_seconds)
    flops = flops_per_step(config)
    num = len(config.learners.devices)
    return cls(config.mode, config.runtime, config.inner_steps, config.outer_steps,
               config.eval_every, config.checkpoint_every,
               tuple(b * config.model.seq_len for b in config.learners.batch_size), tuple(flops), tuple(profiles),
               tuple(declared_speeds(profiles, flops)), tuple(expected_steps(config, profiles, flops)),
               tuple(config.learners.slowdown) or (0.0,) * num)

  @property
  def num_learners(self) -> int:
    """M: learner groups in the run."""
    return len(self.tokens_per_batch)

  @property
  def budget_steps(self) -> int:
    """The run's inner steps over all learners, outer_steps × inner_steps × M: the same tokens in every mode."""
    return self.outer_steps * self.inner_steps * self.num_learners

  @property
  def tokens_per_round(self) -> int:
    """Tokens of one round: H steps of every learner."""
    return self.inner_steps * sum(self.tokens_per_batch)

  @property
  def tokens_per_eval(self) -> int:
    """Tokens between evaluations of Θ: eval_every rounds' worth."""
    return self.eval_every * self.tokens_per_round

  @property
  def tokens_per_checkpoint(self) -> int:
    """Tokens between the virtual clock's checkpoints: checkpoint_every rounds' worth."""
    return self.checkpoint_every * self.tokens_per_round


@dataclasses.dataclass
class Every:
  """A cadence in tokens (evals, checkpoints): due whenever the tokens done cross its next mark."""
  interval: int
  next: int = 0  # The next mark; 0: the first multiple of `interval`.

  def due(self, done: int) -> bool:
    """Whether `done` tokens reached the next mark; the mark then moves past `done` in O(1), however far it jumped."""
    if done < (self.next or self.interval):
      return False
    self.next = (done // self.interval + 1) * self.interval
    return True

"""The syncer: owner of Θ and the outer optimizer state, and the state machine that merges.

Learners push pseudo-gradients whenever they are ready; the syncer validates each push,
drops over-stale ones, and merges what has arrived once a quorum of learners reported
(and an adaptive grace window, if any, closed): weights = staleness × tokens, merge rule
= weighted mean or RDA, then one outer step. It does no I/O and reads no clock: runtimes
pass `now` in (virtual or wall-clock seconds) and decide when to call what, so the same
machine runs under the lockstep, virtual-clock and networked runtimes.

Θ lives on the host (the CPU device of the process that runs the syncer), apart from
every learner group's mesh, so no learner holds an extra device copy of it.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from decoupled_diloco import merge, outer
from decoupled_diloco.errors import ConfigError


class PushRejected(ValueError):
  """A malformed push; the syncer's state is untouched."""


@dataclasses.dataclass
class Push:
  """What a learner hands the syncer at the end of its local work."""
  learner: int
  delta: Any             # Pseudo-gradient Θ_base − θ, on the syncer's device.
  base_version: int      # Syncer version the learner started from.
  tokens: int            # Tokens processed since that pull.
  local_steps: int       # Inner steps since that pull.
  compute_seconds: float = 0.0  # Time those steps took (feeds the grace window's step EMA).


class SyncerState(NamedTuple):
  """Everything a checkpoint of the syncer must hold."""
  params: Any
  opt_state: Any
  version: int


@dataclasses.dataclass(frozen=True)
class MergeReport:
  """One outer step: which pushes went in, and with what staleness and weight."""
  version: int
  learners: tuple[int, ...]
  staleness: tuple[int, ...]
  weights: tuple[float, ...]
  time: float


@dataclasses.dataclass(frozen=True)
class Settings:
  """Merge policy, from `config.syncer`."""
  quorum: int = 0                  # Distinct learners needed to merge; 0 = all of them.
  staleness: str = "constant"      # One of merge.STALENESS_FUNCTIONS.
  staleness_a: float = 0.5
  staleness_b: float = 0.0
  max_staleness: int = -1          # Drop pushes staler than this; -1 = never drop.
  token_weighting: str = "tokens"  # One of merge.TOKEN_WEIGHTINGS.
  merge_rule: str = "mean"         # One of merge.MERGE_RULES.
  grace_gamma: float = 0.0         # γ of the grace window; 0 = merge as soon as the quorum is met.
  grace_overlap_steps: float = 0.0  # τ: steps of slack learners have before they need Θ.
  ema: float = 0.3                 # Weight of the newest duration in the ξ EMAs.

  @classmethod
  def from_config(cls, syncer_cfg) -> "Settings":
    """Settings from `config.syncer`, rejecting unknown rule names with the allowed ones."""
    settings = cls(**{f.name: syncer_cfg[f.name] for f in dataclasses.fields(cls) if f.name in syncer_cfg})
    for name, allowed in (("staleness", merge.STALENESS_FUNCTIONS), ("token_weighting", merge.TOKEN_WEIGHTINGS),
                          ("merge_rule", merge.MERGE_RULES)):
      if getattr(settings, name) not in allowed:
        raise ConfigError(f"syncer.{name}={getattr(settings, name)!r} is unknown: use one of {allowed}")
    checks = ((settings.quorum >= 0, f"syncer.quorum={settings.quorum} must be >= 0 (0 = all learners)"),
              (0 <= settings.grace_gamma < 1, f"syncer.grace_gamma={settings.grace_gamma} must be in [0, 1)"),
              (settings.staleness_a >= 0, f"syncer.staleness_a={settings.staleness_a} must be >= 0"),
              (settings.staleness_b >= 0, f"syncer.staleness_b={settings.staleness_b} must be >= 0"),
              (settings.max_staleness >= -1, f"syncer.max_staleness={settings.max_staleness} must be >= -1"),
              (0 < settings.ema <= 1, f"syncer.ema={settings.ema} must be in (0, 1]"))
    for ok, message in checks:
      if not ok:
        raise ConfigError(f"{message}: fix --config.syncer.*")
    return settings


def grace_seconds(gamma: float, overlap_steps: float, step_seconds: float, quorum_seconds: float,
                  sync_seconds: float) -> float:
  """ξ_grace = γ(τ·ξ_step − ξ_quorum − ξ_sync), never negative: wait only within the slack."""
  return max(0.0, gamma * (overlap_steps * step_seconds - quorum_seconds - sync_seconds))


def host_device() -> jax.Device:
  """The device standing for host memory: the first CPU device of this process."""
  return jax.local_devices(backend="cpu")[0]


class Syncer:
  """Θ, outer state, versions and pending pushes; merges when the policy says so."""

  def __init__(self, optimizer: optax.GradientTransformation, params, learners: Sequence[int],
               settings: Settings = Settings(), device: jax.Device | None = None):
    self.optimizer, self.settings = optimizer, settings
    self.device = device or host_device()
    self.learners = frozenset(learners)
    if settings.quorum > len(self.learners):
      raise ConfigError(f"syncer.quorum={settings.quorum} exceeds the {len(self.learners)} learners: "
                        "it could never be met; lower --config.syncer.quorum")
    params = jax.device_put(params, self.device)
    self.state = SyncerState(params, jax.jit(optimizer.init)(params), 0)
    # Static (hashable) per-leaf facts: which leaves are averaged plainly (embeddings), and
    # the shape and dtype every pushed leaf must have.
    self._averaged = tuple(jax.tree.leaves(merge.embedding_mask(params)))
    self._leaf_specs = [(x.shape, np.dtype(x.dtype)) for x in jax.tree.leaves(params)]
    self.pending: list[Push] = []
    self.deadline: float | None = None
    self.counts = {"accepted": 0, "dropped": 0, "rejected": 0, "merges": 0}
    self._window_start: float | None = None
    self._xi = {"step": 0.0, "quorum": 0.0, "sync": 0.0}

  @property
  def params(self):
    """Θ, the current global parameters (host)."""
    return self.state.params

  @property
  def version(self) -> int:
    """Outer steps taken so far; staleness is measured in these."""
    return self.state.version

  @property
  def quorum(self) -> int:
    """Distinct learners needed for a merge (0 in the settings means all)."""
    return self.settings.quorum or len(self.learners)

  def to_host(self, tree):
    """Explicit move of a learner's arrays off its mesh, onto the syncer's device."""
    return jax.device_put(tree, self.device)

  def pseudo_gradient(self, anchor, local_params):
    """Δ_m = Θ_anchor − θ_m, computed on the host from the learner's current params."""
    return _jit_pseudo_gradient(anchor, self.to_host(local_params))

  def validate(self, push: Push) -> None:
    """Raises PushRejected, naming the problem, for anything that must not be merged."""
    who = f"push from learner {push.learner}"
    if push.learner not in self.learners:
      raise PushRejected(f"{who} rejected: unknown learner; registered learners are {sorted(self.learners)}")
    if not 0 <= push.base_version <= self.version:
      raise PushRejected(f"{who} rejected: base version {push.base_version} is not in [0, {self.version}] "
                         "(a version from the future means a misrouted or corrupt push)")
    if push.tokens < 1 or push.local_steps < 1:
      raise PushRejected(f"{who} rejected: tokens={push.tokens}, local_steps={push.local_steps}; "
                         "need tokens >= 1 and local_steps >= 1")
    if jax.tree.structure(push.delta) != jax.tree.structure(self.state.params):
      raise PushRejected(f"{who} rejected: pseudo-gradient tree structure differs from the params'")
    for (path, leaf), (shape, dtype) in zip(jax.tree_util.tree_leaves_with_path(push.delta), self._leaf_specs):
      got = (tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", type(leaf))))
      if got != (shape, dtype):
        raise PushRejected(f"{who} rejected: {jax.tree_util.keystr(path)} is {got[1]}{list(got[0])}, "
                           f"expected {dtype}{list(shape)}")
    if not bool(_jit_all_finite(push.delta)):
      raise PushRejected(f"{who} rejected: the pseudo-gradient holds NaN or Inf (did the learner diverge?)")

  def receive(self, push: Push, now: float) -> tuple[bool, MergeReport | None]:
    """Takes a push at time `now`: (accepted, report of the merge it triggered, if any).

    Rejected pushes raise PushRejected before anything changes; over-stale ones are
    dropped and counted.
    """
    # Explicit move onto the syncer's device first: a merge must never meet a leaf that
    # lives elsewhere after the push was accepted.
    try:
      push = dataclasses.replace(push, delta=self.to_host(push.delta))
    except (TypeError, ValueError) as error:
      self.counts["rejected"] += 1
      raise PushRejected(f"push from learner {push.learner} rejected: its pseudo-gradient is not a tree of "
                         f"arrays ({error})") from error
    try:
      self.validate(push)
    except PushRejected:
      self.counts["rejected"] += 1
      raise
    if 0 <= self.settings.max_staleness < self.version - push.base_version:
      self.counts["dropped"] += 1
      return False, None
    self.counts["accepted"] += 1
    self._xi_update("step", push.compute_seconds / push.local_steps)
    if self._window_start is None:
      self._window_start = now
    self.pending.append(push)
    reporters = len({p.learner for p in self.pending})
    if reporters < self.quorum:
      return True, None
    if reporters == len(self.learners):  # Nobody left to wait for.
      return True, self.merge(now)
    if self.deadline is not None:  # Inside an open grace window.
      return True, None
    self._xi_update("quorum", now - self._window_start)
    grace = grace_seconds(self.settings.grace_gamma, self.settings.grace_overlap_steps, self._xi["step"],
                          self._xi["quorum"], self._xi["sync"])
    if grace > 0:
      self.deadline = now + grace
      return True, None
    return True, self.merge(now)

  def on_deadline(self, now: float) -> MergeReport | None:
    """The grace window closed: merge what has arrived (if it is still open)."""
    if self.deadline is None or now < self.deadline or not self.pending:
      return None
    return self.merge(now)

  def observe_sync_seconds(self, seconds: float) -> None:
    """Runtimes report how long a merge + broadcast took (ξ_sync of the grace window)."""
    self._xi_update("sync", seconds)

  def merge(self, now: float) -> MergeReport | None:
    """Merges every pending push and takes one outer step.

    Weight of push i: its token weight normalised over the merge, times its staleness
    factor, un-normalised: w_i = f(s_i) · t_i / Σ_j t_j. Staleness damps rather than
    re-balances, so a lone stale push (quorum 1) is still scaled down; with staleness 0
    everywhere this is exactly DiLoCo's token-weighted mean.
    """
    if not self.pending:
      return None
    s = self.settings
    staleness = [self.version - p.base_version for p in self.pending]
    shares = merge.normalized_weights([merge.token_weight(p.tokens, p.local_steps, s.token_weighting)
                                       for p in self.pending])
    damping = [merge.staleness_weight(st, s.staleness, s.staleness_a, s.staleness_b) for st in staleness]
    weights = (shares * np.asarray(damping)).astype(np.float32)
    params, opt_state = _jit_merge_and_step(self.optimizer, s.merge_rule, self._averaged, self.state.params,
                                            self.state.opt_state, [p.delta for p in self.pending], weights)
    report = MergeReport(self.version + 1, tuple(p.learner for p in self.pending), tuple(staleness),
                         tuple(float(w) for w in weights), now)
    self.state = SyncerState(params, opt_state, self.version + 1)
    self.pending, self.deadline, self._window_start = [], None, None
    self.counts["merges"] += 1
    return report

  def _xi_update(self, name: str, seconds: float) -> None:
    a = self.settings.ema
    self._xi[name] = seconds if self._xi[name] == 0 else (1 - a) * self._xi[name] + a * seconds


_jit_pseudo_gradient = jax.jit(outer.pseudo_gradient)
_jit_all_finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])))


@jax.jit(static_argnums=(0, 1, 2))
def _jit_merge_and_step(optimizer, rule, averaged_leaves, params, opt_state, deltas, weights):
  averaged = jax.tree.unflatten(jax.tree.structure(params), averaged_leaves)
  merged = merge.merge_deltas(deltas, weights, rule, averaged)
  return outer.outer_step(optimizer, params, opt_state, merged)

"""The syncer: owner of Θ and the outer optimizer state, and the state machine that merges.

Learners push pseudo-gradients whenever they are ready; the syncer validates each push,
drops over-stale ones, folds each accepted one into its fragment's running sums at once
(`merge.Accumulator`: the push's buffer is released, so memory does not grow with the
pushes per merge) and merges once a quorum of learners reported (and an adaptive grace
window, if any, closed): weights = staleness × tokens, merge rule = weighted mean, RDA or
a robust rule (`robust`: each push clipped to a multiple of recent norms, or a coordinate-wise
trimmed mean over the merge's pushes, which are then held until it), then one outer step. It
does no I/O and reads no clock: runtimes pass `now` in (virtual or wall-clock seconds) and
decide when to call what, so the same machine runs under the lockstep, virtual-clock and
networked runtimes.

Θ lives on the host (the CPU device of the process that runs the syncer), apart from
every learner group's mesh, so no learner holds an extra device copy of it.
"""

import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from decoupled_diloco import accumulate, compression, fragments, merge, robust
from decoupled_diloco import push as push_lib
from decoupled_diloco.push import Push, PushRejected
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.robust import Verdict
from decoupled_diloco.syncer_settings import Settings  # Re-exported: the syncer's config group.


class SyncerState(NamedTuple):
  """Everything a checkpoint of the syncer must hold (outer state and version per fragment)."""
  params: Any
  opt_state: tuple
  version: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MergeReport:
  """One outer step: which pushes went in, and with what staleness and weight."""
  version: int
  learners: tuple[int, ...]
  staleness: tuple[int, ...]
  weights: tuple[float, ...]
  time: float
  fragment: int = 0
  trimmed: tuple[float, ...] = ()  # trimmed_mean: per push, the share of its coordinates trimmed.


def grace_seconds(gamma: float, overlap_steps: float, step_seconds: float, quorum_seconds: float,
                  sync_seconds: float) -> float:
  """ξ_grace = γ(τ·ξ_step − ξ_quorum − ξ_sync), never negative: wait only within the slack."""
  return max(0.0, gamma * (overlap_steps * step_seconds - quorum_seconds - sync_seconds))


def host_device() -> jax.Device:
  """The device standing for host memory: the first CPU device of this process."""
  return jax.local_devices(backend="cpu")[0]


def map_large_blocks() -> None:
  """glibc maps every block >= 1 MiB on its own from now on, so freed tensors go back to the OS (syncer process).

  Why: glibc raises that threshold to each freed mapped block's size (up to 32 MB), and then
  keeps freed tensors in a fragmented heap: with 8 MB tensors the syncer peaked at 24 B/param,
  not 16 (docs/syncer-memory.md). No-op with another C library.
  """
  try:
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD, fixed.
  except (OSError, AttributeError):
    pass


@dataclasses.dataclass
class _Fragment:
  """One fragment's share of the syncer: its slice of Θ, outer state, version and open pushes."""
  params: Any  # Θ_p: the params' tree with None where other fragments own leaves.
  opt_state: Any
  rda: tuple  # Static per-leaf flags: merged by RDA (else by the weighted mean).
  leaf_specs: list  # (shape, dtype) every pushed leaf must have.
  version: int = 0
  pending: list = dataclasses.field(default_factory=list)  # Accepted pushes' headers (delta None).
  accumulator: merge.Accumulator | None = None  # Their running sums; None while no push is open.
  deadline: float | None = None
  window_start: float | None = None
  norms: list = dataclasses.field(default_factory=list)  # clip: the last W merged pushes' decoded norms.
  held: list = dataclasses.field(default_factory=list)  # trimmed_mean: each pending push's float32 tensors.


class Syncer:
  """Θ, outer state, versions and pending pushes, per fragment; merges when the policy says so.

  With P fragments (streaming) each keeps its own version, outer optimizer state, pending
  pushes and grace window, so fragment p merges whenever its quorum reported, whatever the
  others do; P = 1 is plain (Decoupled) DiLoCo. `version` counts merges of all fragments.
  """

  def __init__(self, optimizer: optax.GradientTransformation, params, learners: Sequence[int],
               settings: Settings = Settings(), device: jax.Device | None = None,
               assignment: Sequence[int] | None = None, codec: compression.Codec = compression.Codec()):
    self.optimizer, self.settings, self.codec = optimizer, settings, codec
    self.device = device or host_device()
    self.learners = frozenset(learners)
    if settings.quorum > len(self.learners):
      raise ConfigError(f"syncer.quorum={settings.quorum} exceeds the {len(self.learners)} learners: "
                        "it could never be met; lower --config.syncer.quorum")
    params = jax.device_put(params, self.device)
    self.assignment = tuple(assignment) if assignment is not None else (0,) * len(jax.tree.leaves(params))
    self.fragments = [
        self._new_fragment(fragments.select(params, self.assignment, p)) for p in range(max(self.assignment) + 1)]
    self.counts = {"accepted": 0, "dropped": 0, "rejected": 0, "merges": 0}
    self.verdict: Verdict | None = None  # What the syncer made of the last push received (for its record).
    self._xi = {"step": 0.0, "quorum": 0.0, "sync": 0.0}

  def _new_fragment(self, params) -> _Fragment:
    # Committed to the syncer's device like every later outer state: else the second merge compiles again.
    return _Fragment(params, self.to_host(jax.jit(self.optimizer.init)(params)),
                     merge.rda_leaves(self.settings.merge_rule, jax.tree.leaves(merge.embedding_mask(params))),
                     [(x.shape, np.dtype(x.dtype)) for x in jax.tree.leaves(params)])

  @property
  def params(self):
    """Θ, the current global parameters (host), assembled from every fragment."""
    return fragments.combine([f.params for f in self.fragments], self.assignment)

  @property
  def version(self) -> int:
    """Merges so far over all fragments (outer steps when P = 1): a monotonic clock for records."""
    return sum(f.version for f in self.fragments)

  @property
  def versions(self) -> tuple[int, ...]:
    """Each fragment's version; staleness of a push is measured in its fragment's."""
    return tuple(f.version for f in self.fragments)

  @property
  def state(self) -> SyncerState:
    """What a checkpoint holds: Θ, the outer states and versions of every fragment."""
    return SyncerState(self.params, tuple(f.opt_state for f in self.fragments), self.versions)

  def drop_state(self) -> None:
    """Lets go of Θ and the outer states, so that a restore's copies take their place rather than sit beside
    them (a restart's peak: 8 B/param less). Only `restore` may follow."""
    for fragment in self.fragments:
      fragment.params = fragment.opt_state = None

  def restore(self, state: SyncerState) -> None:
    """Takes a checkpointed state back (onto the syncer's device); open pushes are dropped."""
    params = jax.device_put(state.params, self.device)
    for p, fragment in enumerate(self.fragments):
      fragment.params = fragments.select(params, self.assignment, p)
      fragment.opt_state = jax.device_put(state.opt_state[p], self.device)
      fragment.version, fragment.pending, fragment.deadline, fragment.window_start = state.version[p], [], None, None
      fragment.accumulator, fragment.held, fragment.norms = None, [], []

  def adopt(self, accumulator: merge.Accumulator | None) -> merge.Accumulator | None:
    """An accumulator read back from a checkpoint (numpy sums), placed on the syncer's device."""
    if accumulator is None:
      return None
    return accumulator._replace(sums=self.to_host(accumulator.sums), radii=self.to_host(accumulator.radii))

  @property
  def pending(self) -> list[Push]:
    """Accepted pushes not merged yet, over all fragments: their headers (`delta` None, it is folded)."""
    return [push for f in self.fragments for push in f.pending]

  @property
  def deadlines(self) -> list[float]:
    """Open grace windows' closing times (one per fragment that has one)."""
    return [f.deadline for f in self.fragments if f.deadline is not None]

  def in_window(self, learner: int, fragment: int) -> bool:
    """Whether a push of `learner` waits in fragment `fragment`'s open grace window.

    Such a push is answered with that window's merge in every runtime (docs/syncer.md): the window
    exists so that the learners in it receive a Θ_p that holds their own push.
    """
    state = self.fragments[fragment]
    return state.deadline is not None and any(p.learner == learner for p in state.pending)

  def holds(self, learner: int, fragment: int) -> bool:
    """Whether a push of `learner` to `fragment` is accepted but not merged yet (a waiting learner's end)."""
    return any(p.learner == learner for p in self.fragments[fragment].pending)

  @property
  def quorum(self) -> int:
    """Distinct learners needed for a merge (0 in the settings means all)."""
    return self.settings.quorum or len(self.learners)

  def fragment_params(self, fragment: int):
    """Θ_p: what a learner receives back after pushing fragment p."""
    return self.fragments[fragment].params

  def to_host(self, tree):
    """Explicit move of arrays (e.g. checkpointed sums) onto the syncer's device; pushes take `push.on_device`."""
    return jax.device_put(tree, self.device)

  def check(self, push: Push) -> Push:
    """The push decoded onto the syncer's device and validated; raises PushRejected (counted).

    Separate from `receive` so that a service can validate a push, log it, then apply it:
    a refused push must never reach its write-ahead log.
    """
    # Explicit move onto the syncer's device (and the payload's check) first: a merge must never
    # meet a leaf that lives elsewhere after the push was accepted.
    try:
      push = push_lib.on_device(push, self.codec, self.device)
    except (TypeError, ValueError) as error:
      self.counts["rejected"] += 1
      raise PushRejected(f"push from learner {push.learner} rejected: its pseudo-gradient is not a valid tree or "
                         f"payload of arrays ({error})") from error
    try:
      norm = push_lib.validate(push, self.learners, self.fragments, self.codec, self.settings.max_push_norm)
    except PushRejected:
      self.counts["rejected"] += 1
      push_lib.release(push)
      raise
    return dataclasses.replace(push, checked_norm=norm)

  @property
  def recent_norms(self) -> list[list[float]]:
    """Per fragment, the merged pushes' norms the clip rule's median is over: a checkpoint keeps them,
    so that a restarted syncer clips as the uninterrupted one would."""
    return [list(f.norms) for f in self.fragments]

  def restore_recent_norms(self, norms: Sequence[Sequence[float]]) -> None:
    """Takes checkpointed `recent_norms` back."""
    for fragment, saved in zip(self.fragments, norms, strict=True):
      fragment.norms = [float(n) for n in saved]

  def receive(self, push: Push, now: float, checked: bool = False) -> tuple[bool, MergeReport | None]:
    """Takes a push at time `now`: (accepted, report of the merge it triggered, if any).

    Rejected pushes raise PushRejected before anything changes; over-stale ones are
    dropped and counted (and not kept). An accepted one is folded into its fragment's
    running sums here; either way, the host memory its checked delta views is let go of
    (`push.release`): the caller's reference to its payload is the last one.
    `checked`: the push is what `check` returned (not checked twice).
    """
    if not checked:
      push = self.check(push)
    fragment = self.fragments[push.fragment]
    self.verdict = Verdict(push.checked_norm)
    if 0 <= self.settings.max_staleness < fragment.version - push.base_version:
      self.counts["dropped"] += 1
      push_lib.release(push)
      return False, None
    self.counts["accepted"] += 1
    self._xi_update("step", push.compute_seconds / push.local_steps)
    if fragment.window_start is None:
      fragment.window_start = now
    if self.settings.merge_rule == "trimmed_mean":
      fragment.held.append([np.array(leaf, np.float32) for leaf in push_lib.delta_leaves(push, self.codec)])
      push_lib.release(push)
    else:
      self._fold(fragment, push)
    fragment.pending.append(dataclasses.replace(push, delta=None, delta_norm=None))  # Its header only.
    reporters = len({p.learner for p in fragment.pending})
    if reporters < self.quorum:
      return True, None
    if reporters == len(self.learners):  # Nobody left to wait for.
      return True, self.merge(now, push.fragment)
    if fragment.deadline is not None:  # Inside an open grace window.
      return True, None
    self._xi_update("quorum", now - fragment.window_start)
    grace = grace_seconds(self.settings.grace_gamma, self.settings.grace_overlap_steps, self._xi["step"],
                          self._xi["quorum"], self._xi["sync"])
    if grace > 0:
      fragment.deadline = now + grace
      return True, None
    return True, self.merge(now, push.fragment)

  def on_deadline(self, now: float) -> list[MergeReport]:
    """Grace windows closed by `now`: merge what each of those fragments has received."""
    return [
        self.merge(now, p) for p, f in enumerate(self.fragments)
        if f.deadline is not None and now >= f.deadline and f.pending]

  def flush(self, now: float) -> list[MergeReport]:
    """Merges every fragment that holds pushes (the end of a run: no update is left behind)."""
    return [self.merge(now, p) for p, f in enumerate(self.fragments) if f.pending]

  def warm_up(self) -> None:
    """Compiles the push check, the first and later folds and the merge of every fragment, changing nothing.

    Why: a networked syncer would otherwise compile them while answering the first
    pushes, and every learner's first exchange would wait for XLA. It reads only shapes and
    works on zeros of its own, so it may run in a thread beside merges (a restarted syncer
    serves first and warms up meanwhile).
    """
    zeros_like = lambda tree: self.to_host(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree))
    for state in self.fragments:
      zeros = zeros_like(state.params)
      push_lib.all_finite(zeros)
      sums, radii = None, None
      for _ in range(2):  # The first fold and later ones, the way this codec's pushes are folded.
        sums, radii = accumulate.fold(state.rda, sums, radii, jax.tree.leaves(zeros), np.float32(1),
                                      one_at_a_time=self.codec.format != "fp32")
      jax.block_until_ready(
          accumulate.merge_and_step(self.optimizer, state.rda, zeros, zeros_like(state.opt_state),
                                    merge.Accumulator(sums, radii, 2.0, 1.0), np.float32(0.5), arrivals=2))

  @property
  def estimates(self) -> dict[str, float]:
    """ξ_step, ξ_quorum and ξ_sync in seconds (0 = not measured yet): the grace window's EMAs,
    which a checkpoint keeps so that a restarted syncer does not learn them again."""
    return dict(self._xi)

  def restore_estimates(self, estimates: dict[str, float]) -> None:
    """Takes checkpointed `estimates` back."""
    self._xi = {name: float(estimates[name]) for name in self._xi}

  def observe_sync_seconds(self, seconds: float) -> None:
    """Runtimes report how long a merge + broadcast took (ξ_sync of the grace window)."""
    self._xi_update("sync", seconds)

  def _weight_and_damping(self, fragment: _Fragment, push: Push) -> tuple[float, float]:
    """(t_i, f(s_i)): the push's token weight and staleness factor (its version is the merge's)."""
    s = self.settings
    return (merge.token_weight(push.tokens, push.local_steps, s.token_weighting),
            merge.staleness_weight(fragment.version - push.base_version, s.staleness, s.staleness_a, s.staleness_b))

  def _fold(self, fragment: _Fragment, push: Push) -> None:
    """Adds an accepted push to its fragment's running sums (see `merge.Accumulator`), tensor by tensor."""
    weight, damping = self._weight_and_damping(fragment, push)
    if self.settings.merge_rule == "clip":  # On the raw push, before its weights (docs/syncer.md).
      seen = fragment.norms + [p.checked_norm for p in fragment.pending]  # Merged, then open: oldest first.
      recent = seen[max(0, len(seen) + 1 - self.settings.clip_window):] + [push.checked_norm]
      self.verdict = Verdict(push.checked_norm,
                             robust.clip_factor(push.checked_norm, recent, self.settings.clip_multiple))
      damping *= self.verdict.clip_factor
    accumulator = fragment.accumulator
    ref = weight if accumulator is None else accumulator.ref
    sums, radii = (None, None) if accumulator is None else (accumulator.sums, accumulator.radii)
    fragment.accumulator = None  # Its buffers are donated to the fold.
    sums, radii = accumulate.fold(fragment.rda, sums, radii, push_lib.delta_leaves(push, self.codec),
                                  merge.fold_scale(weight, damping, ref), one_at_a_time=push_lib.one_at_a_time(push),
                                  wait_each=push.drop_pages is not None)
    total = weight / ref + (0.0 if accumulator is None else accumulator.total)
    fragment.accumulator = merge.Accumulator(jax.block_until_ready(sums), radii, total, ref)  # Done with the push.
    push_lib.release(push)

  def merge(self, now: float, fragment: int = 0) -> MergeReport | None:
    """Merges fragment `fragment`'s open pushes and takes one outer step on it.

    Weight of push i: its token weight normalised over the merge, times its staleness
    factor, un-normalised: w_i = f(s_i) · t_i / Σ_j t_j. Staleness damps rather than
    re-balances, so a lone stale push (quorum 1) is still scaled down; with staleness 0
    everywhere this is exactly DiLoCo's token-weighted mean. The pushes were folded into
    running sums on arrival; the shares t_i / Σ_j t_j are applied here, from Σ_j t_j.
    """
    state = self.fragments[fragment]
    if not state.pending:
      return None
    tokens, damping = zip(*(self._weight_and_damping(state, p) for p in state.pending))
    weights = (merge.normalized_weights(tokens) * np.asarray(damping)).astype(np.float32)
    staleness = tuple(state.version - p.base_version for p in state.pending)
    trimmed = ()
    if self.settings.merge_rule == "trimmed_mean":
      merged, trimmed = robust.trimmed_merge([iter(leaves) for leaves in state.held], tokens, damping,
                                             self.settings.trim_fraction)
      state.held = []
      accumulator = merge.Accumulator(self.to_host(merged), [None] * len(merged), 1.0, 1.0)
    else:
      accumulator, state.accumulator = state.accumulator, None  # Donated to the merge.
    state.params, state.opt_state = accumulate.merge_and_step(self.optimizer, state.rda, state.params, state.opt_state,
                                                              accumulator, np.float32(1.0 / accumulator.total),
                                                              arrivals=len(state.pending))
    state.version += 1
    report = MergeReport(self.version, tuple(p.learner for p in state.pending), staleness,
                         tuple(float(w) for w in weights), now, fragment, tuple(trimmed))
    state.norms = (state.norms + [p.checked_norm for p in state.pending])[-self.settings.clip_window:]
    state.pending, state.deadline, state.window_start = [], None, None
    self.counts["merges"] += 1
    return report

  def _xi_update(self, name: str, seconds: float) -> None:
    a = self.settings.ema
    self._xi[name] = seconds if self._xi[name] == 0 else (1 - a) * self._xi[name] + a * seconds

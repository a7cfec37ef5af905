"""One learner group: its compiled inner loop, its data shard and its train state.

A learner only knows how to start from global params, take inner steps, push its
pseudo-gradient and land a merged fragment; runtimes decide when each happens. (Verbs by
layer: a learner pushes and lands, the syncer receives and merges, a learner process's
client pushes and pulls over the wire.) Steps are dispatched without waiting for
results, so a runtime that interleaves several groups' steps keeps all their meshes busy.
"""

import dataclasses
import time
from typing import Any

import jax
import numpy as np
import optax

from decoupled_diloco import compression, fragments, outer
from decoupled_diloco.inner import InnerLoop, TrainState
from decoupled_diloco.push import Push


@dataclasses.dataclass
class Learner:
  """Mutable per-group bookkeeping around a pure, jitted inner step.

  Sync state is kept per fragment (one fragment unless streaming): the Θ_p it last
  received (its anchor), that fragment's version, the work done since its last push, and
  the error-feedback residual of its compressed pushes.
  """
  index: int
  loop: InnerLoop
  batches: Any  # data.batches.LearnerBatches or data.pipeline.PackedBatches: batch(step).
  state: TrainState
  assignment: tuple = ()  # Fragment id of every param leaf; () = a single fragment.
  codec: compression.Codec = compression.Codec()
  alpha: float = 0.0  # Share of its own params a learner keeps when a merged fragment lands.
  to_host: Any = jax.device_get  # θ off the group's devices (a multi-process group gathers from all its hosts).
  keep_pushed: bool = False  # Keep θ_p as pushed, to anchor on when no new Θ_p comes back (learner processes).
  forms_delta: bool = True  # False on a multi-process group's followers: only the leader's Δ is sent.
  steps: int = 0  # Host mirror of state.step: picks the next batch without a device sync.
  anchors: list = dataclasses.field(default_factory=list)  # Θ_p last received (host); None after a push.
  base_versions: list = dataclasses.field(default_factory=list)
  tokens_since_push: list = dataclasses.field(default_factory=list)
  steps_since_push: list = dataclasses.field(default_factory=list)
  residuals: list = dataclasses.field(default_factory=list)  # Error feedback: what compression has not sent yet.
  pushed: dict = dataclasses.field(default_factory=dict)  # fragment -> θ_p as pushed (keep_pushed).
  _pending_metrics: list = dataclasses.field(default_factory=list)  # (step, {'loss', router metrics}) on device.

  def __post_init__(self):
    self.assignment = self.assignment or (0,) * len(jax.tree.leaves(self.loop.param_shardings))
    fragments = max(self.assignment) + 1
    self.anchors, self.base_versions, self.residuals = [None] * fragments, [0] * fragments, [None] * fragments
    self.tokens_since_push, self.steps_since_push = [0] * fragments, [0] * fragments

  @property
  def params(self):
    """θ as the params tree of block_i's (a device copy where the step holds the blocks stacked)."""
    return self.loop.from_step(self.state.params)

  @property
  def num_fragments(self) -> int:
    """P: how many fragments this learner syncs separately."""
    return len(self.anchors)

  def start_from(self, global_params, versions) -> None:
    """Start local work from all of Θ (the run's start, a round, a rejoin); AdamW state carries over.

    The local params are freed before Θ arrives, so this never holds two parameter
    copies on the group's devices. `versions`: one per fragment, or one for all.
    """
    for leaf in jax.tree.leaves(self.state.params):
      leaf.delete()
    self.state = self.state._replace(params=self.loop.to_step(self.loop.put_params(global_params)))
    versions = [versions] * self.num_fragments if isinstance(versions, int) else list(versions)
    for p in range(self.num_fragments):
      self.anchors[p], self.base_versions[p] = fragments.select(global_params, self.assignment, p), versions[p]
      self.tokens_since_push[p] = self.steps_since_push[p] = 0
    self.pushed.clear()  # Pushes before a rejoin anchor nothing any more.

  def feedback_state(self) -> list:
    """Each fragment's error-feedback residual as host arrays, for a checkpoint: zeros before the fragment's
    first push, which fold in as nothing (e = β·0 + Δ is Δ to the bit), so a restored run sends what this one would."""
    params, residuals = jax.eval_shape(self.loop.from_step, self.state.params), []
    for p, residual in enumerate(self.residuals):
      if residual is None:
        residual = [
            np.zeros(x.shape, np.float32) for x in jax.tree.leaves(fragments.select(params, self.assignment, p))]
      residuals.append([np.asarray(r) for r in residual])
    return residuals

  def restore(self, state, data_state=None) -> None:
    """Takes a checkpointed TrainState (block_i's) and its data position (None: not saved), so a resumed
    learner goes on where it stopped: packed pipelines from their saved position instead of replaying."""
    self.state = self.loop.to_step(state)
    self.steps = int(self.state.step)
    if data_state:
      self.batches.restore(data_state)

  def land(self, fragment: int, fragment_params, version: int, anchor=None) -> None:
    """A merged fragment lands: θ_p ← α·θ_p + (1 − α)·Θ_p, and Θ_p anchors the next push.

    With α = 0 the local leaves are freed and replaced (a fresh start of that fragment), so what
    the τ steps taken since the push did to this fragment is dropped, and the next push's
    c^tokens / c^steps count from this receipt (Decoupled DiLoCo): its Δ covers only the
    steps taken after it. α > 0 keeps the share α of θ_p − Θ_p, which holds the τ steps'
    progress, so a share α of their tokens and steps stays counted (rounded): the weight
    follows what the Δ carries.

    `anchor`: Θ_p on the host when `fragment_params` is Θ_p placed elsewhere (a multi-process group
    places it on its devices; its leader forms Δ against the host copy); a learner that forms no Δ (a
    group's follower) keeps no anchor.
    """
    leaves, treedef = jax.tree.flatten(self.params)
    shardings = jax.tree.leaves(self.loop.param_shardings)
    incoming = iter(jax.tree.leaves(fragment_params))
    for i, owner in enumerate(self.assignment):
      if owner != fragment:
        continue
      merged = self.loop.put_params_leaf(next(incoming), shardings[i])
      if self.alpha:
        merged = _blend(self.alpha, leaves[i], merged)
      leaves[i].delete()
      leaves[i] = merged
    self.state = self.state._replace(params=self.loop.to_step(jax.tree.unflatten(treedef, leaves)))
    self.anchors[fragment] = (fragment_params if anchor is None else anchor) if self.forms_delta else None
    self.base_versions[fragment] = version
    self.pushed.pop(fragment, None)  # The new Θ_p anchors: θ_p as pushed is not needed any more.
    self.tokens_since_push[fragment] = round(self.alpha * self.tokens_since_push[fragment])
    self.steps_since_push[fragment] = round(self.alpha * self.steps_since_push[fragment])

  def warm_up(self) -> None:
    """Runs once, on throwaway inputs, the programs that a push and a landing compile; changes nothing.

    Why: XLA compiles a program (or loads it from the persistent cache) at its first call, so
    a restarted learner would pay for these after its start-up, in its first round: the layout
    converters of scanned layers (θ read for a push, written back by a landing), a compressed
    format's encoder and error feedback, α's blend and the pushed Δ's norm. A runtime calls this
    before it counts the learner as started (service/learner_main.py). With fp32 pushes, α = 0
    and unscanned layers only the norm is compiled (a push is otherwise a device_get and numpy, a
    landing a device_put). The inputs are copies of θ and zeros of its shapes: state, anchors,
    residuals, counts and the data position stay as they were.
    """
    params = self.params  # As `push` and `land` read θ (a copy where the step holds the layers stacked).
    ran = [self.loop.to_step(params)]  # As `land` writes it back.
    leaves = jax.tree.leaves(params)
    if self.alpha:  # One of each (shape, dtype, sharding): what a compiled program is specialised on.
      ran += [_blend(self.alpha, x, x) for x in {(x.shape, x.dtype, x.sharding): x for x in leaves}.values()]
    if self.codec.format != "fp32":
      zeros = [np.zeros(shape, np.float32) for shape in {x.shape for x in leaves}]  # A Δ on the host, as pushed.
      ran += compression.encode_with_feedback(self.codec, zeros)
      if ran[-1] is not None:  # The residual: later pushes fold it in, another program.
        ran += compression.encode_with_feedback(self.codec, zeros, ran[-1])
    jax.block_until_ready(ran)  # XLA on CPU finishes a program loaded from its cache in its first run.
    for fragment in range(self.num_fragments) if self.forms_delta else ():  # Each fragment's Δ norm: its own tree.
      _global_norm(
          jax.tree.map(lambda x: np.zeros(x.shape, np.float32), fragments.select(params, self.assignment, fragment)))

  def step(self) -> None:
    """Dispatch one inner step asynchronously; its metrics are fetched later in `drain_metrics`."""
    batch = self.loop.put_local_batch(self.batches.batch(self.steps))
    self.state, metrics = self.loop.step(self.state, batch)
    self._pending_metrics.append((self.steps, {k: v for k, v in metrics.items() if k != "grad_norm"}))
    self.steps += 1
    for p in range(self.num_fragments):
      self.steps_since_push[p] += 1
      self.tokens_since_push[p] += self.batches.tokens_per_batch

  def timed_step(self, slowdown: float = 0.0) -> float:
    """One inner step waited for, then `slowdown` × its time asleep; returns the seconds it all took.

    Why wait: wall-clock runtimes measure speeds (DyLU) from step times, which asynchronous
    dispatch would hide; the sleep emulates a slower slice on a machine of equal devices.
    """
    begin = time.monotonic()
    self.step()
    jax.block_until_ready(self.state.step)
    if slowdown:
      time.sleep(slowdown * (time.monotonic() - begin))
    return time.monotonic() - begin

  def drain_metrics(self) -> list[tuple[int, dict]]:
    """(inner step, {'loss': cross-entropy, an MoE model's router metrics}) since the last drain, as floats;
    blocks on the group's devices. The gradient norm stays out: train records never held it."""
    pending, self._pending_metrics = self._pending_metrics, []
    values = jax.device_get([metrics for _, metrics in pending])
    return [(step, {k: float(v) for k, v in metrics.items()}) for (step, _), metrics in zip(pending, values)]

  def drain_losses(self) -> list[tuple[int, float]]:
    """(inner step, loss) pairs since the last drain: `drain_metrics` for callers that want the loss only."""
    return [(step, metrics["loss"]) for step, metrics in self.drain_metrics()]

  def push(self, fragment: int = 0, compute_seconds: float = 0.0) -> Push:
    """Pseudo-gradient Δ_p = Θ_p − θ_p of fragment `fragment` against its anchor, on the host, as it goes
    on the wire.

    fp32 pushes travel as a tree; any other format as a `compression.Compressed`, with
    what it lost kept for the next push when error feedback is on. The anchor is
    released: the next landing brings a new one, and holding the old Θ_p would keep a
    stale copy alive on the host.
    """
    local = self.to_host(fragments.select(self.params, self.assignment, fragment))
    delta = outer.pseudo_gradient(self.anchors[fragment], local) if self.forms_delta else local
    if self.codec.format == "fp32":
      payload, wire_bytes = delta, compression.wire_bytes(self.codec, [x.shape for x in jax.tree.leaves(delta)])
    else:
      payload, self.residuals[fragment] = compression.encode_with_feedback(self.codec, jax.tree.leaves(delta),
                                                                           self.residuals[fragment])
      wire_bytes = payload.nbytes
    push = Push(self.index, payload, self.base_versions[fragment], self.tokens_since_push[fragment],
                self.steps_since_push[fragment], compute_seconds, fragment, wire_bytes,
                delta_norm=_global_norm(delta) if self.forms_delta else None)
    self.anchors[fragment] = None
    if self.keep_pushed:
      self.pushed[fragment] = local
    self.tokens_since_push[fragment] = self.steps_since_push[fragment] = 0
    return push

  def take(self, fragment: int, fragment_params, version: int) -> bool:
    """The reply to fragment `fragment`'s push: Θ_p at `version` lands if a merge moved it since the push's
    base; returns whether it did.

    Else (with a quorum K > 1 the push waits in the syncer for others) θ_p as pushed anchors
    (`keep_pushed`), as a learner process does: landing the unmoved Θ_p would drop the pushed
    progress and compute the next Δ from that same Θ_p again, so once the waiting push merged,
    the next one would repeat its work as a stale update (with Nesterov on every merge that diverged).
    """
    if version == self.base_versions[fragment] and fragment in self.pushed:
      self.anchor_on_pushed(fragment)
      return False
    self.land(fragment, fragment_params, version)
    return True

  def anchor_on_pushed(self, fragment: int) -> None:
    """No merge moved Θ_p since the push's base: θ_p as pushed anchors the next push, and the local
    progress made since goes on (counted from the push)."""
    self.anchors[fragment] = self.pushed.pop(fragment)

  def evaluate(self, params, evals) -> float:
    """Mean held-out loss of `params` (from anywhere) on `evals` (run.evaluator.EvalSet), on this group's mesh."""
    return evals.mean_loss(lambda p, batch: self.loop.loss(p, self.loop.put_batch(batch)), self.loop.put_params(params))


_jit_global_norm = jax.jit(optax.global_norm)


def _global_norm(tree) -> float:
  """‖Δ‖ of a push, computed by XLA on the host's CPU device where Δ already is: reproducible to the bit (a
  resumed run's records equal an uninterrupted run's), and no accelerator gets a copy of Δ."""
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    return float(_jit_global_norm(tree))


@jax.jit
def _blend(alpha, local, merged):
  return alpha * local + (1 - alpha) * merged

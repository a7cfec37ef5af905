"""Streaming accumulation: folding pushes as they arrive equals the batch merge, and holds no push.

The reference is the batch merge the syncer did before (`merge.merge_deltas` over every
pending push, weights f(s_i)·t_i/Σt_j), run the same way: one jit with the outer step.
Θ starts at 0 with outer SGD at lr 1 and no momentum, so the new Θ is exactly −merge.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decoupled_diloco import compression, merge, outer
from decoupled_diloco.push import Push
from decoupled_diloco.syncer import Settings, Syncer, SyncerState

_SHAPES = {"token_embed": {"embedding": (16, 8)}, "block_0": {"w": (8, 12), "b": (12,)}, "head": {"w": (12, 16)}}
_BASES, _TOKENS, _STEPS = (3, 2, 0, 3), (100, 300, 50, 1000), (2, 5, 1, 10)
_VERSION = 3


def _params():
  return jax.tree.map(lambda shape: jnp.zeros(shape, jnp.float32), _SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _deltas(count: int, seed: int = 0) -> list:
  """Pseudo-gradients of different scales; one push leaves block_0/b at 0 (RDA's φ(0) = 0)."""
  rng = np.random.default_rng(seed)
  deltas = []
  for i in range(count):
    delta = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 10.0**-(i % 3), _params())
    if i == 1:
      delta["block_0"]["b"] = np.zeros_like(delta["block_0"]["b"])
    deltas.append(delta)
  return deltas


_NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _start(optimizer) -> tuple:
  """Θ and outer state to merge into: zeros for SGD at lr 1 (new Θ = −merge), random for Nesterov."""
  params = _params()
  if optimizer is not _NESTEROV:
    return params, optimizer.init(params)
  rng = np.random.default_rng(7)
  random = lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * 1e-2)
  return jax.tree.map(random, params), jax.tree.map(random, optimizer.init(params))


def _syncer(settings: Settings, learners: int, codec=compression.Codec(), optimizer=optax.sgd(1.0)) -> Syncer:
  syncer = Syncer(optimizer, _params(), range(learners), settings, codec=codec)
  params, opt_state = _start(optimizer)
  syncer.restore(SyncerState(params, (opt_state,), (_VERSION,)))  # Staleness up to 3.
  return syncer


def _batch_merge(settings: Settings, deltas: list, pushes: list[Push], optimizer=optax.sgd(1.0)) -> tuple:
  """(new Θ, weights) as the batch merge computed them."""
  shares = merge.normalized_weights([
      merge.token_weight(p.tokens, p.local_steps, settings.token_weighting) for p in pushes])
  damping = [
      merge.staleness_weight(_VERSION - p.base_version, settings.staleness, settings.staleness_a, settings.staleness_b)
      for p in pushes]
  weights = (shares * np.asarray(damping)).astype(np.float32)
  params, opt_state = _start(optimizer)
  mask = merge.embedding_mask(params)

  @jax.jit
  def batch(params, opt_state, deltas, weights):
    return outer.outer_step(optimizer, params, opt_state, merge.merge_deltas(deltas, weights, settings.merge_rule,
                                                                             mask))

  new_params, _ = batch(params, opt_state, deltas, weights)
  return new_params, tuple(float(w) for w in weights)


def _stream(syncer: Syncer, pushes: list[Push]):
  reports = [syncer.receive(push, now=float(i))[1] for i, push in enumerate(pushes)]
  assert reports[:-1] == [None] * (len(pushes) - 1) and reports[-1] is not None
  return syncer.params, reports[-1]


def _assert_float32_close(got, want) -> None:
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    scale = float(np.max(np.abs(b))) or 1.0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * scale,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("rule, staleness, weighting",
                         list(itertools.product(merge.BATCH_RULES, merge.STALENESS_FUNCTIONS, merge.TOKEN_WEIGHTINGS)))
def test_streaming_merge_equals_the_batch_merge(rule, staleness, weighting):
  settings = Settings(merge_rule=rule, staleness=staleness, staleness_a=0.5, staleness_b=1.0, token_weighting=weighting)
  deltas = _deltas(4)
  pushes = [Push(m, d, b, t, s) for m, (d, b, t, s) in enumerate(zip(deltas, _BASES, _TOKENS, _STEPS))]
  want, weights = _batch_merge(settings, deltas, pushes)
  got, report = _stream(_syncer(settings, 4), pushes)
  _assert_float32_close(got, want)
  assert report.weights == weights and report.staleness == tuple(_VERSION - b for b in _BASES)
  assert len(set(weights)) > 1 or weighting == "none" and staleness == "constant"  # Unequal weights tested.


@pytest.mark.parametrize("count", (2, 4))
def test_equal_weights_give_the_batch_mean_bit_for_bit(count):
  """Equal tokens and no staleness (synchronous DiLoCo): shares 1/M are powers of two here, folded with
  a_i = 1 and scaled once, which rounds exactly like the batch merge's w_i·Δ_i, through an outer
  Nesterov step with momentum. Not for M = 1: the batch merge's w·Δ fed the outer step's
  multiply-adds directly, and which product XLA contracted decided the last bit. Nor RDA: its
  directions are computed in another XLA fusion than the batch merge's (see above for both)."""
  settings = Settings(merge_rule="mean")
  deltas = _deltas(count, seed=1)
  pushes = [Push(m, d, _VERSION, 512, 4) for m, d in enumerate(deltas)]
  want, weights = _batch_merge(settings, deltas, pushes, _NESTEROV)
  got, report = _stream(_syncer(settings, count, optimizer=_NESTEROV), pushes)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert report.weights == weights == (1 / count,) * count


@pytest.mark.parametrize("fmt", ["int4", "bf16", "topk"])
def test_compressed_pushes_decode_into_the_accumulator(fmt):
  codec = compression.Codec(format=fmt, block_size=8, topk_fraction=0.25)
  settings = Settings(merge_rule="rda", staleness="polynomial", token_weighting="tokens_squared_per_step")
  deltas = _deltas(3, seed=2)
  payloads = [compression.encode(codec, jax.tree.leaves(d)) for d in deltas]
  decoded = [jax.tree.unflatten(jax.tree.structure(d), compression.decode(codec, p)) for d, p in zip(deltas, payloads)]
  pushes = [Push(m, p, b, t, s) for m, (p, b, t, s) in enumerate(zip(payloads, _BASES, _TOKENS, _STEPS))]
  want, _ = _batch_merge(settings, decoded, pushes)
  got, _ = _stream(_syncer(settings, 3, codec), pushes)
  _assert_float32_close(got, want)


def _held_bytes() -> int:
  return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.parametrize("rule", merge.BATCH_RULES)
def test_open_pushes_hold_one_accumulator_whatever_their_number(rule):
  """After 1 or 7 pushes (quorum 8: nothing merged) the syncer holds the same bytes: each push was
  folded into the sums and released, and only its header is kept."""
  settings = Settings(merge_rule=rule, token_weighting="tokens")
  held = {}
  for count in (1, 7):
    syncer = _syncer(settings, 8)
    before = _held_bytes()
    for m, delta in enumerate(_deltas(count)):
      assert syncer.receive(Push(m, delta, _VERSION, 100 + m, 2), now=0.0) == (True, None)
    held[count] = _held_bytes() - before
    assert [p.delta for p in syncer.pending] == [None] * count
    del syncer
  params = sum(int(np.prod(s)) for s in jax.tree.leaves(_SHAPES, is_leaf=lambda x: isinstance(x, tuple)))
  assert held[1] == held[7] and 4 * params <= held[7] <= 4 * params + 64  # Sums (+ a few RDA radii).


def test_dropped_over_stale_push_is_not_kept():
  syncer = _syncer(Settings(max_staleness=1), 2)
  before = _held_bytes()
  assert syncer.receive(Push(0, _deltas(1)[0], 0, 10, 1), now=0.0) == (False, None)
  assert syncer.pending == [] and _held_bytes() == before and syncer.counts["dropped"] == 1


def test_a_merge_leaves_only_theta_and_the_outer_state():
  """The sums become the merge and then Θ, the outer state is updated in place: nothing else is left."""
  syncer = _syncer(Settings(merge_rule="rda"), 2, optimizer=_NESTEROV)
  before = _held_bytes()
  for m, delta in enumerate(_deltas(2)):
    syncer.receive(Push(m, delta, _VERSION, 10, 1), now=0.0)
  assert syncer.version == _VERSION + 1 and syncer.fragments[0].accumulator is None
  assert _held_bytes() == before

"""Tests for the Transformer LM: shapes, causality, init, params/axes trees, sizing, training."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from decoupled_diloco import model as model_lib
from decoupled_diloco.errors import ConfigError

AXIS_NAMES = {'vocab', 'embed', 'mlp', 'heads', 'kv', None}


def tiny_cfg(**overrides) -> ml_collections.ConfigDict:
  cfg = dict(vocab_size=256, seq_len=16, d_model=32, num_layers=2, num_heads=4, d_ff=64, dtype='float32')
  cfg.update(overrides)
  return ml_collections.ConfigDict(cfg)


def one_billion_cfg() -> ml_collections.ConfigDict:
  return tiny_cfg(seq_len=2048, d_model=2048, num_layers=16, num_heads=16, d_ff=8192, dtype='bfloat16')


def closed_form_count(cfg) -> int:
  v, t, d, l, f = cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.num_layers, cfg.d_ff
  return 2 * v * d + t * d + d + l * (4 * d * d + 2 * d * f + 2 * d)


def random_batch(seed: int, cfg, batch_size: int = 4) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch_size, cfg.seq_len + 1), 0, cfg.vocab_size, dtype=jnp.int32)


@pytest.fixture(scope='module')
def tiny():
  cfg = tiny_cfg()
  model, params, axes = model_lib.build_model(cfg, seed=0)
  return cfg, model, params, axes


def test_logits_shape_and_dtype(tiny):
  cfg, model, params, _ = tiny
  tokens = random_batch(0, cfg, batch_size=3)[:, :-1]
  logits = jax.jit(model.logits)(params, tokens)
  assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
  assert logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_shorter_sequences_are_accepted(tiny):
  cfg, model, params, _ = tiny
  logits = model.logits(params, jnp.zeros((2, cfg.seq_len // 2), jnp.int32))
  assert logits.shape == (2, cfg.seq_len // 2, cfg.vocab_size)


def test_causality(tiny):
  cfg, model, params, _ = tiny
  tokens = np.asarray(random_batch(1, cfg, batch_size=2)[:, :-1])
  changed = tokens.copy()
  t = 7
  changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
  logits_fn = jax.jit(model.logits)
  before, after = logits_fn(params, tokens), logits_fn(params, changed)
  np.testing.assert_allclose(before[:, :t], after[:, :t], atol=1e-6, rtol=0)
  assert float(jnp.max(jnp.abs(before[:, t:] - after[:, t:]))) > 1e-4


def test_initial_loss_is_near_uniform(tiny):
  cfg, model, params, _ = tiny
  loss = jax.jit(model.loss)(params, random_batch(2, cfg))
  assert loss.shape == () and loss.dtype == jnp.float32
  assert abs(float(loss) - math.log(256)) < 0.5


def test_build_model_is_deterministic_in_seed(tiny):
  cfg, _, params, _ = tiny
  _, same, _ = model_lib.build_model(cfg, seed=0)
  _, other, _ = model_lib.build_model(cfg, seed=1)
  jax.tree.map(np.testing.assert_array_equal, params, same)
  differs = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, other)
  assert differs['token_embed'] and differs['block_0']['attn']['query']['kernel']


def test_param_count_matches_closed_form(tiny):
  cfg, _, params, _ = tiny
  assert model_lib.count_params(params) == closed_form_count(cfg)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def test_param_axes_match_params(tiny):
  _, _, params, axes = tiny
  axes_structure = jax.tree.structure(jax.tree.map(lambda _: 0, axes, is_leaf=model_lib.is_axes_leaf))
  assert axes_structure == jax.tree.structure(params)

  # Params first: each leaf array is paired with its whole axes tuple.
  def check(array, names):
    assert isinstance(names, tuple) and len(names) == array.ndim
    assert set(names) <= AXIS_NAMES

  jax.tree.map(check, params, axes)
  assert axes['token_embed'] == ('vocab', 'embed')
  assert axes['block_1']['attn']['query']['kernel'] == ('embed', 'heads', 'kv')
  assert axes['block_1']['mlp']['wi']['kernel'] == ('embed', 'mlp')


def test_abstract_params_match_build_model(tiny):
  cfg, model, params, axes = tiny
  abstract_model, shapes, abstract_axes = model_lib.abstract_params(cfg)
  assert abstract_model == model and hash(abstract_model) == hash(model)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(lambda s: (s.shape, s.dtype), shapes)
  assert abstract_axes == axes
  # The abstract model applies to real params (this is how checkpoint restore uses it).
  np.testing.assert_array_equal(abstract_model.logits(params, jnp.zeros((1, 4), jnp.int32)),
                                model.logits(params, jnp.zeros((1, 4), jnp.int32)))


def test_one_billion_config_is_sized_without_allocating():
  cfg = one_billion_cfg()
  _, shapes, axes = model_lib.abstract_params(cfg)
  assert all(isinstance(s, jax.ShapeDtypeStruct) for s in jax.tree.leaves(shapes))
  n = model_lib.count_params(shapes)
  assert n == closed_form_count(cfg)
  assert 0.7e9 < n < 1.3e9
  assert jax.tree.structure(jax.tree.map(lambda _: 0, axes,
                                         is_leaf=model_lib.is_axes_leaf)) == (jax.tree.structure(shapes))


def test_flops_per_token_formula():
  cfg = one_billion_cfg()
  embeddings = cfg.vocab_size * cfg.d_model + cfg.seq_len * cfg.d_model
  n_matmul = closed_form_count(cfg) - embeddings
  expected = 6 * n_matmul + 12 * cfg.num_layers * cfg.d_model * cfg.seq_len
  assert model_lib.flops_per_token(cfg) == pytest.approx(expected)
  assert 6e9 > model_lib.flops_per_token(cfg) > 6 * 0.7e9


def test_adam_steps_reduce_loss(tiny):
  cfg, model, params, _ = tiny
  batch = random_batch(3, cfg)
  optimizer = optax.adam(3e-3)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = optimizer.init(params)
  losses = []
  for _ in range(10):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 0.5, losses


def test_bfloat16_compute_gives_finite_float32_loss():
  cfg = tiny_cfg(dtype='bfloat16')
  model, params, _ = model_lib.build_model(cfg, seed=0)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
  batch = random_batch(4, cfg)
  loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, batch)
  assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
  assert abs(float(loss) - math.log(256)) < 0.5
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize('overrides, match', [
    (dict(d_model=30, num_heads=4), 'num_heads'),
    (dict(num_layers=0), 'num_layers'),
    (dict(d_ff=-1), 'd_ff'),
    (dict(dtype='float16'), 'dtype'),])
def test_bad_config_raises_config_error(overrides, match):
  cfg = tiny_cfg(**overrides)
  with pytest.raises(ConfigError, match=match):
    model_lib.build_model(cfg, seed=0)
  with pytest.raises(ConfigError, match=match):
    model_lib.abstract_params(cfg)

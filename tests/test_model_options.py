"""Model options: every kernel, remat policy, scan and chunked loss computes the plain model's function;
RoPE, GQA, SwiGLU and tied embeddings have the shapes, counts and FLOPs they claim."""

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from decoupled_diloco import experiment, model as model_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model import attention
from tests.helpers import tiny_config


def cfg(**overrides) -> ml_collections.ConfigDict:
  """A Llama-style tiny model (RoPE, SwiGLU, 2 KV heads for 4 query heads) unless overridden."""
  base = dict(vocab_size=256, seq_len=16, d_model=32, num_layers=2, num_heads=4, d_ff=64, dtype='float32',
              position='rope', mlp='swiglu', num_kv_heads=2)
  base.update(overrides)
  return ml_collections.ConfigDict(base)


def loss_and_grads(config, params, batch):
  model, _, _ = model_lib.abstract_params(config)
  return jax.jit(jax.value_and_grad(model.loss))(params, batch)


@pytest.fixture(scope='module')
def plain():
  config = cfg()
  _, params, _ = model_lib.build_model(config, seed=0)
  batch = jax.random.randint(jax.random.key(1), (2, config.seq_len + 1), 0, 256, dtype=jnp.int32)
  return params, batch, loss_and_grads(config, params, batch)


@pytest.mark.parametrize(
    'overrides',
    [
        dict(attention='dot_product'),
        dict(attention='auto'),
        dict(remat='full'),
        dict(remat='dots_saveable'),
        dict(remat='minimal'),
        dict(remat='offload'),  # CPU devices have a pinned_host memory space.
        dict(scan_layers=True),
        dict(scan_layers=True, remat='full'),
        dict(loss_chunk=4),])
def test_option_computes_the_plain_models_loss_and_grads(plain, overrides):
  params, batch, (loss, grads) = plain
  other_loss, other_grads = loss_and_grads(cfg(**overrides), params, batch)
  np.testing.assert_allclose(other_loss, loss, atol=1e-4, rtol=0)
  worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), other_grads, grads)))
  assert worst <= 1e-4
  assert float(loss) > 1.0  # A real loss, not a degenerate zero.


def test_splash_kernel_in_interpret_mode_matches_xla_attention():
  """Pallas interpret mode on CPU; splash's blocks need sequences of a multiple of 128 tokens."""
  config = cfg(seq_len=128, num_layers=1)
  _, params, _ = model_lib.build_model(config, seed=0)
  batch = jax.random.randint(jax.random.key(1), (1, 129), 0, 256, dtype=jnp.int32)
  loss, grads = loss_and_grads(config, params, batch)
  splash_loss, splash_grads = loss_and_grads(cfg(seq_len=128, num_layers=1, attention='splash_interpret'), params,
                                             batch)
  np.testing.assert_allclose(splash_loss, loss, atol=1e-4, rtol=0)
  assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), splash_grads, grads))) <= 1e-4


@pytest.mark.parametrize('backend, dtype, segments, kernel, fallback',
                         [('tpu', 'bfloat16', False, 'splash', ''), ('tpu', 'float32', True, 'splash', ''),
                          ('gpu', 'bfloat16', False, 'cudnn', ''), ('gpu', 'float16', False, 'cudnn', ''),
                          ('gpu', 'float32', False, 'xla', 'bf16/fp16, not float32'),
                          ('gpu', 'bfloat16', True, 'xla', 'segment ids'), ('cpu', 'bfloat16', False, 'xla', ''),
                          ('cpu', 'float32', True, 'xla', '')])
def test_auto_picks_the_fastest_kernel_that_applies_and_says_why_it_fell_back(backend, dtype, segments, kernel,
                                                                              fallback):
  choice = attention.select('auto', backend, dtype, segments)
  assert choice.kernel == kernel and (fallback in choice.fallback if fallback else not choice.fallback)


@pytest.mark.parametrize('setting, backend, dtype, segments, refused',
                         [('splash', 'cpu', 'bfloat16', False, "'splash_interpret'"),
                          ('splash', 'gpu', 'bfloat16', False, 'TPU kernel'),
                          ('cudnn', 'cpu', 'bfloat16', False, 'needs a GPU'),
                          ('cudnn', 'gpu', 'float32', False, 'float32'),
                          ('cudnn', 'gpu', 'bfloat16', True, 'segment ids'), ('splash', 'tpu', 'float32', False, None),
                          ('splash_interpret', 'cpu', 'float32', True, None), ('cudnn', 'gpu', 'bfloat16', False, None),
                          ('dot_product', 'gpu', 'float32', False, None), ('xla', 'tpu', 'bfloat16', False, None)])
def test_an_explicit_kernel_runs_as_asked_or_is_refused_in_one_line(setting, backend, dtype, segments, refused):
  if refused is None:
    assert attention.select(setting, backend, dtype, segments) == (setting, '')
    return
  with pytest.raises(ConfigError, match=refused) as error:
    attention.select(setting, backend, dtype, segments)
  message = str(error.value)
  assert '\n' not in message and ('\'auto\'' in message or '=auto' in message)


def test_a_learner_group_refuses_splash_off_a_tpu_before_it_starts():
  config = tiny_config(**{'model.attention': 'splash', 'model.seq_len': 128})
  with pytest.raises(ConfigError, match='splash_interpret'):
    experiment.build(config)


def test_the_model_logs_a_fallback_it_takes(caplog, monkeypatch):
  """On a GPU at float32 'auto' runs XLA's attention and the trace logs why (never silently)."""
  monkeypatch.setattr(attention.jax, 'default_backend', lambda: 'gpu')
  config = cfg(dtype='float32', attention='auto')
  model, params, _ = model_lib.build_model(config, seed=0)
  batch = jnp.zeros((1, config.seq_len + 1), jnp.int32)
  with caplog.at_level(logging.WARNING):
    jax.eval_shape(model.loss, params, batch)
  assert any("cuDNN's flash attention takes bf16/fp16, not float32" in r.getMessage() for r in caplog.records)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (2, 8, 4, 8))
  k, v = (jax.random.normal(key, (2, 8, 2, 8)) for key in keys[1:])
  repeated = attention.xla_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
  np.testing.assert_allclose(attention.xla_attention(q, k, v), repeated, atol=1e-6)


def test_rope_scores_depend_only_on_the_distance_between_positions():
  q = jnp.tile(jax.random.normal(jax.random.key(0), (1, 1, 1, 8)), (1, 12, 1, 1))
  k = jnp.tile(jax.random.normal(jax.random.key(1), (1, 1, 1, 8)), (1, 12, 1, 1))
  scores = jnp.einsum('bqhd,bkhd->qk', attention.rope(q, 10_000.0), attention.rope(k, 10_000.0))
  np.testing.assert_allclose(scores[5, 2], scores[9, 6], rtol=1e-5)
  np.testing.assert_allclose(jnp.linalg.norm(attention.rope(q, 10_000.0), axis=-1), jnp.linalg.norm(q, axis=-1),
                             rtol=1e-5)
  assert abs(float(scores[5, 2] - scores[5, 3])) > 1e-4


def closed_form_count(c) -> int:
  d, f, v, h = c.d_model, c.d_ff, c.vocab_size, c.d_model // c.num_heads
  kv = c.get('num_kv_heads') or c.num_heads
  per_layer = 2 * d * d + 2 * d * kv * h + (3 if c.mlp == 'swiglu' else 2) * d * f + 2 * d
  embeddings = v * d + (c.seq_len * d if c.position == 'learned' else 0)
  return embeddings + (0 if c.get('tie_embeddings') else d * v) + d + c.num_layers * per_layer


@pytest.mark.parametrize(
    'overrides', [dict(), dict(tie_embeddings=True),
                  dict(position='learned', mlp='gelu'),
                  dict(num_kv_heads=1)])
def test_shapes_counts_and_flops(overrides):
  config = cfg(**overrides)
  model, params, axes = model_lib.build_model(config, seed=0)
  assert model_lib.count_params(params) == closed_form_count(config)
  attn = params['block_0']['attn']
  kv = config.num_kv_heads
  assert attn['query']['kernel'].shape == (32, 4, 8) and attn['key']['kernel'].shape == (32, kv, 8)
  assert attn['value']['kernel'].shape == (32, kv, 8) and axes['block_0']['attn']['key']['kernel'] == ('embed', 'heads',
                                                                                                       'kv')
  assert ('wg' in params['block_0']['mlp']) == (config.mlp == 'swiglu')
  assert ('pos_embed' in params) == (config.position == 'learned')
  assert ('lm_head' in params) != bool(config.get('tie_embeddings'))
  logits = model.logits(params, jnp.zeros((2, 16), jnp.int32))
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  lookups = 256 * 32 + (16 * 32 if config.position == 'learned' else 0)
  head = 32 * 256 if config.get('tie_embeddings') else 0
  n_matmul = closed_form_count(config) - lookups + head
  assert model_lib.flops_per_token(config) == 6 * n_matmul + 12 * 2 * 32 * 16


def test_tied_head_is_the_token_embedding():
  config = cfg(tie_embeddings=True)
  model, params, _ = model_lib.build_model(config, seed=0)
  tokens = jnp.arange(16, dtype=jnp.int32)[None]
  bumped = dict(params, token_embed=params['token_embed'].at[7].add(1.0))
  # Token 7 never appears in the input after position 7... so only the head sees the bump at t < 7.
  before, after = model.logits(params, tokens[:, :7]), model.logits(bumped, tokens[:, :7])
  changed = np.abs(np.asarray(after - before)).max(axis=(0, 1)) > 1e-6
  assert changed[7] and changed.sum() == 1


@pytest.mark.parametrize(
    'overrides, match',
    [
        (dict(position='alibi'), 'position'),
        (dict(mlp='relu'), 'mlp'),
        (dict(num_kv_heads=3), 'num_kv_heads'),
        (dict(remat='some'), 'remat'),
        (dict(attention='flash'), 'attention'),
        (dict(loss_chunk=5), 'loss_chunk'),
        (dict(attention='splash_interpret'), 'multiple of 128'),
        (dict(d_model=36, num_heads=4, d_ff=64), 'even head dim'),  # head dim 9 cannot be rotated in pairs.
    ])
def test_bad_options_name_the_fix(overrides, match):
  with pytest.raises(ConfigError, match=match):
    model_lib.build_model(cfg(**overrides), seed=0)

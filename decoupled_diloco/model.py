"""Decoder-only Transformer language model, exposed as pure functions over pure-dict params.

Architecture (GPT-2-like, no dropout so runs are bit-for-bit repeatable):
  token embedding + learned position embedding
  -> num_layers x [RMSNorm -> causal multi-head attention -> residual,
                   RMSNorm -> GELU MLP -> residual]
  -> final RMSNorm -> untied output projection to vocab logits.
There are no bias terms. Params are always float32; `model.dtype` only sets the compute dtype.
Softmaxes, norms and the output logits are computed in float32 for stability under bfloat16.

Why pure dicts: the rest of the framework averages, checkpoints and ships params over the wire,
so it must not depend on NNX objects. NNX is used only to declare the parameters (with logical
sharding annotations) and to apply them: `LanguageModel` keeps the hashable NNX graphdef and
rebuilds the module from a pure dict on every (traced) call.

Param tree layout (string keys only, so checkpoints restore to the same keys), e.g.
  params['block_0']['attn']['query']['kernel']   float32 [d_model, num_heads, head_dim]
and `param_axes` has the same dict structure with a tuple of logical axis names at every leaf
position, e.g. param_axes['block_0']['attn']['query']['kernel'] == ('embed', 'heads', 'kv').
Because tuples are pytree nodes (and None is an empty pytree), always map with params FIRST:
`jax.tree.map(f, params, param_axes)` hands `f` whole axes tuples. To traverse param_axes on its
own use `jax.tree.map(f, param_axes, is_leaf=is_axes_leaf)`.

Param count (V=vocab_size, T=seq_len, d=d_model, L=num_layers, f=d_ff):
  N = V*d (token embedding) + T*d (position embedding) + d*V (output projection) + d (final norm)
      + L * (4*d*d (q, k, v, out) + 2*d*f (MLP) + 2*d (two norms)).
"""

import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from decoupled_diloco.errors import ConfigError

_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_INIT_STDDEV = 0.02
_NORM_EPS = 1e-6


def is_axes_leaf(x: Any) -> bool:
  """Marks axes tuples as leaves, so param_axes can be traversed without params alongside."""
  return isinstance(x, tuple)


def _param(rngs: nnx.Rngs, stddev: float, shape: tuple[int, ...], axes: tuple) -> nnx.Param:
  """A float32 normal-initialised Param carrying logical axes, never eagerly sharded.

  Eager sharding is off because placement is the runtime's job: it maps logical axes to mesh
  axes per learner group, and the model must build on CPU with no mesh in scope.
  """
  init = nnx.with_partitioning(nnx.initializers.normal(stddev), axes, eager_sharding=False)
  return nnx.Param(init(rngs.params(), shape, jnp.float32))


def _ones_param(dim: int) -> nnx.Param:
  """A float32 RMSNorm scale, initialised to one, sharded along the embedding axis."""
  init = nnx.with_partitioning(nnx.initializers.ones, ('embed',), eager_sharding=False)
  return nnx.Param(init(jax.random.key(0), (dim,), jnp.float32))


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32, returned in the compute dtype."""

  def __init__(self, dim: int, dtype: jnp.dtype):
    self.scale = _ones_param(dim)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + _NORM_EPS)
    return (x * self.scale[...]).astype(self.dtype)


class Kernel(nnx.Module):
  """A bias-free projection; einsum spec chosen by the caller so heads stay a separate dim."""

  def __init__(self, rngs: nnx.Rngs, stddev: float, shape: tuple[int, ...], axes: tuple,
               dtype: jnp.dtype):
    self.kernel = _param(rngs, stddev, shape, axes)
    self.dtype = dtype

  def __call__(self, spec: str, x: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, self.kernel[...].astype(self.dtype))


class CausalSelfAttention(nnx.Module):
  """Multi-head attention where position t attends only to positions <= t."""

  def __init__(self, d: int, heads: int, out_stddev: float, dtype: jnp.dtype, rngs: nnx.Rngs):
    head_dim = d // heads
    in_shape, in_axes = (d, heads, head_dim), ('embed', 'heads', 'kv')
    self.query = Kernel(rngs, _INIT_STDDEV, in_shape, in_axes, dtype)
    self.key = Kernel(rngs, _INIT_STDDEV, in_shape, in_axes, dtype)
    self.value = Kernel(rngs, _INIT_STDDEV, in_shape, in_axes, dtype)
    self.out = Kernel(rngs, out_stddev, (heads, head_dim, d), ('heads', 'kv', 'embed'), dtype)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    q = self.query('btd,dhk->bthk', x)
    k = self.key('btd,dhk->bthk', x)
    v = self.value('btd,dhk->bthk', x)
    scores = jnp.einsum('bqhk,bshk->bhqs', q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    t = x.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    mixed = jnp.einsum('bhqs,bshk->bqhk', probs, v)
    return self.out('bqhk,hkd->bqd', mixed)


class MLP(nnx.Module):
  """Position-wise GELU feed-forward block."""

  def __init__(self, d: int, d_ff: int, out_stddev: float, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.wi = Kernel(rngs, _INIT_STDDEV, (d, d_ff), ('embed', 'mlp'), dtype)
    self.wo = Kernel(rngs, out_stddev, (d_ff, d), ('mlp', 'embed'), dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.wo('btf,fd->btd', jax.nn.gelu(self.wi('btd,df->btf', x)))


class Block(nnx.Module):
  """Pre-norm residual block: attention then MLP."""

  def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs):
    # GPT-2 scaling: residual-output projections shrink with depth so the stream's variance at
    # init does not grow with num_layers.
    out_stddev = _INIT_STDDEV / math.sqrt(2 * cfg.num_layers)
    self.attn_norm = RMSNorm(cfg.d_model, dtype)
    self.attn = CausalSelfAttention(cfg.d_model, cfg.num_heads, out_stddev, dtype, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, dtype)
    self.mlp = MLP(cfg.d_model, cfg.d_ff, out_stddev, dtype, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Token ids [B, T] -> float32 logits [B, T, vocab_size]."""

  def __init__(self, cfg: Any, rngs: nnx.Rngs):
    dtype = _DTYPES[cfg.dtype]
    self.num_layers = cfg.num_layers
    self.seq_len = cfg.seq_len
    self.dtype = dtype
    self.token_embed = _param(rngs, _INIT_STDDEV, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'))
    self.pos_embed = _param(rngs, _INIT_STDDEV, (cfg.seq_len, cfg.d_model), (None, 'embed'))
    for i in range(cfg.num_layers):
      setattr(self, f'block_{i}', Block(cfg, dtype, rngs))
    self.final_norm = RMSNorm(cfg.d_model, dtype)
    self.lm_head = _param(rngs, _INIT_STDDEV, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    if t > self.seq_len:
      raise ValueError(f'tokens have length {t} > model.seq_len {self.seq_len}')
    x = jnp.take(self.token_embed[...], tokens, axis=0) + self.pos_embed[...][:t]
    x = x.astype(self.dtype)
    for i in range(self.num_layers):
      x = getattr(self, f'block_{i}')(x)
    x = self.final_norm(x)
    return jnp.einsum('btd,dv->btv', x, self.lm_head[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class LanguageModel:
  """Applies the Transformer to pure-dict params; hashable, so it can be a jit static arg.

  Holds only the NNX graphdef (module structure + variable metadata, no arrays). Methods are
  pure and not jitted themselves: callers wrap them in their own jitted train/eval steps.
  """
  graphdef: nnx.GraphDef

  def logits(self, params: dict, tokens: jax.Array) -> jax.Array:
    """float32 logits [B, T, vocab] for int32 tokens [B, T]; logits at t depend only on <= t."""
    return nnx.merge(self.graphdef, params)(tokens)

  def loss(self, params: dict, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats for an int32 batch [B, T+1]."""
    logits = self.logits(params, batch[:, :-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, batch[:, 1:, None], axis=-1)
    return -jnp.mean(target_log_probs)


def validate_config(model_cfg: Any) -> None:
  """Rejects impossible model shapes up front, before any array is allocated or traced."""
  for name in ('vocab_size', 'seq_len', 'd_model', 'num_layers', 'num_heads', 'd_ff'):
    value = getattr(model_cfg, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ConfigError(f'model.{name} is {value!r}: set --config.model.{name} to a positive int')
  if model_cfg.d_model % model_cfg.num_heads:
    raise ConfigError(
        f'model.d_model {model_cfg.d_model} is not divisible by model.num_heads '
        f'{model_cfg.num_heads}: pick num_heads that divides d_model')
  dtype = getattr(model_cfg, 'dtype', None)
  if dtype not in _DTYPES:
    raise ConfigError(f'model.dtype is {dtype!r}: set --config.model.dtype to one of {sorted(_DTYPES)}')


def _split(module: Transformer) -> tuple[LanguageModel, dict, dict]:
  """Separates a (real or abstract) module into model, pure-dict values and logical axes."""
  graphdef, state = nnx.split(module)
  values = nnx.to_pure_dict(state)
  axes = nnx.to_pure_dict(state, lambda v: tuple(v.get_metadata()['out_sharding']))
  return LanguageModel(graphdef), values, axes


def build_model(model_cfg: Any, seed: int) -> tuple[LanguageModel, dict, dict]:
  """Validates model_cfg and initialises float32 params deterministically from seed.

  Returns (model, params, param_axes); see the module docstring for the tree layout and how
  to map over params and param_axes together.
  """
  validate_config(model_cfg)
  return _split(Transformer(model_cfg, nnx.Rngs(seed)))


def abstract_params(model_cfg: Any) -> tuple[LanguageModel, dict, dict]:
  """Like build_model but returns jax.ShapeDtypeStruct leaves, allocating no parameter memory.

  Lets 1B-parameter TPU configs be checked on a laptop and gives checkpoint restore its targets.
  """
  validate_config(model_cfg)
  return _split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0))))


def count_params(params_or_shapes: Any) -> int:
  """Total number of scalars in a params (or ShapeDtypeStruct) tree, for sizing and logging."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params_or_shapes))


def flops_per_token(model_cfg: Any) -> float:
  """Training FLOPs per token (forward + backward) for hardware step-time models.

  FLOPs = 6 * N_matmul + 12 * L * d * T, where N_matmul is every param except the token and
  position embeddings (lookups, not matmuls; the untied output projection is a matmul and is
  included), and 12*L*d*T counts the QK^T and attention-times-V matmuls (2 * 2*d*T forward per
  layer, times 3 for forward+backward; full T x T, ignoring the causal mask savings).
  """
  validate_config(model_cfg)
  v, t, d = model_cfg.vocab_size, model_cfg.seq_len, model_cfg.d_model
  l, f = model_cfg.num_layers, model_cfg.d_ff
  n_matmul = d * v + d + l * (4 * d * d + 2 * d * f + 2 * d)
  return float(6 * n_matmul + 12 * l * d * t)

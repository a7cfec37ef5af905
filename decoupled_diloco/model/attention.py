"""Causal self-attention: rotary positions, grouped-query heads and interchangeable kernels.

The kernels (model.attention, IMPLEMENTATIONS) all compute the same function, so a config picks
what its backend runs fastest; `select` decides, as a pure function of (setting, backend, dtype,
segments), what actually runs, refusing what cannot run there (docs/scale.md). Every kernel also
takes optional segment ids [B, T] (packed documents), so no token attends across documents.
Grouped-query attention: num_kv_heads key/value heads, each shared by num_heads /
num_kv_heads query heads.
"""

import functools
import math
from typing import NamedTuple

from absl import logging
import jax
from flax import nnx
import jax.numpy as jnp

from decoupled_diloco import mesh as mesh_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model.layers import INIT_STDDEV, Kernel, constrain

# 'dot_product': jax.nn.dot_product_attention as XLA lowers it; 'cudnn': the same call with cuDNN's flash kernel
# (GPU, bf16/fp16); 'splash': Pallas TPU splash attention; 'splash_interpret': splash in Pallas interpret mode on any
# backend (tests, and the plan tracing a TPU's attention on a CPU).
IMPLEMENTATIONS = ('auto', 'xla', 'dot_product', 'cudnn', 'splash', 'splash_interpret')
POSITIONS = ('learned', 'rope')
_HEADS_AXES = ('batch', 'length', 'heads', 'kv')
_CUDNN_DTYPES = ('bfloat16', 'float16')


class Choice(NamedTuple):
  """The kernel that runs, and why it is not the one asked for ('' when it is, or 'auto' found its best)."""
  kernel: str
  fallback: str = ''


def select(setting: str, backend: str, dtype, segments: bool = False) -> Choice:
  """The kernel `setting` runs as on `backend` at compute `dtype`, with or without segment ids: pure, so every
  backend's choice is testable on a CPU and the plan traces what the chip will run.

  'auto': splash on TPU; on GPU cuDNN's flash kernel for bf16/fp16 without segment ids, else XLA's
  attention with the reason as `fallback` (the caller logs it: never a silent fallback); XLA's on CPU.
  An explicit kernel that cannot run here is refused (ConfigError naming the fix): splash off a
  TPU unless as 'splash_interpret', cuDNN off a GPU, at float32 or with segment ids.
  """
  dtype = jnp.dtype(dtype).name
  if setting == 'auto':
    if backend == 'tpu':
      return Choice('splash')
    if backend != 'gpu':
      return Choice('xla')
    if dtype not in _CUDNN_DTYPES:
      return Choice(
          'xla', f"cuDNN's flash attention takes bf16/fp16, not {dtype}: XLA's attention runs "
          '(T x T scores; --config.model.dtype=bfloat16 runs the flash kernel)')
    if segments:
      return Choice(
          'xla', "cuDNN's flash attention here takes no segment ids (packed documents): XLA's "
          'attention runs (T x T scores)')
    return Choice('cudnn')
  if setting == 'splash' and backend != 'tpu':
    raise ConfigError(f"model.attention=splash is a TPU kernel and this backend is {backend}: use 'auto', or "
                      "'splash_interpret' to emulate it (slow; tests)")
  if setting == 'cudnn' and (backend != 'gpu' or dtype not in _CUDNN_DTYPES or segments):
    raise ConfigError(f'model.attention=cudnn needs a GPU, bf16/fp16 and no segment ids; here {backend}, {dtype}'
                      f"{', segment ids' if segments else ''}: use --config.model.attention=auto")
  return Choice(setting)


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (RoFormer) of [B, T, H, D] queries or keys, halves rotated.

  Positions enter as rotations of feature pairs, so q.k depends only on the distance between
  tokens and no position table is learned (nor limited to seq_len rows).
  """
  t, dim = x.shape[1], x.shape[-1]
  freqs = theta**(-jnp.arange(0, dim // 2, dtype=jnp.float32) * 2.0 / dim)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
  sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _causal_bias(t: int) -> jax.Array:
  """[T, T] float32: 0 where query i may see key j (j <= i), the most negative float elsewhere.

  Added rather than selected, so the backward pass keeps no boolean mask: the gradient of an
  add needs none, while jnp.where would save a broadcast [B, H, T, T] predicate.
  """
  rows = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
  return jnp.where(rows >= cols, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


def _segment_bias(segments: jax.Array) -> jax.Array:
  """[B, 1, 1, T, T] float32: the causal bias, and the most negative float between different segments.

  One [B, T, T] term (not [B, H, T, T]), added as the causal bias is; the diagonal is always
  visible, so no softmax row is empty.
  """
  t = segments.shape[1]
  rows = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
  visible = (rows >= cols)[None] & (segments[:, :, None] == segments[:, None, :])
  return jnp.where(visible, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)[:, None, None]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None) -> jax.Array:
  """Causal attention by einsums: q [B, T, N, D], k/v [B, T, K, D] -> [B, T, N, D]."""
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, n // kv_heads, d)
  scores = jnp.einsum('btkgd,bskd->bkgts', q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(d) + (_causal_bias(t) if segments is None else _segment_bias(segments))
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum('bkgts,bskd->btkgd', probs, v).reshape(b, t, n, d)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None,
                          implementation: str | None = None) -> jax.Array:
  """jax.nn.dot_product_attention, as XLA lowers it or (implementation='cudnn') cuDNN's flash kernel; handles GQA
  natively.

  Segments enter as a [B, 1, T, T] boolean mask next to is_causal (`select` keeps them from cuDNN).
  """
  mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None, *,
                  interpret: bool) -> jax.Array:
  """Splash attention on one shard: q [B, T, N, D], k/v [B, T, K, D], N = K * groups; segments [B, T]."""
  # Imported here: Pallas TPU is ~0.07 s (idle) of every start of a process that never runs it (a syncer's).
  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  b, t, n, d = q.shape
  kv_heads = k.shape[2]
  groups = n // kv_heads
  mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(groups)])
  block = min(t, 512)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  kernel = splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
  q = (q / math.sqrt(d)).reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, D]
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, D]
  if segments is None:
    out = jax.vmap(jax.vmap(kernel))(q, k, v)  # [B, K, G, T, D]
  else:  # The kernel's own segment ids: one row per sequence, shared by its heads.
    per_row = lambda q, k, v, s: jax.vmap(lambda *qkv: kernel(*qkv, segment_ids=splash.SegmentIds(s, s)))(q, k, v)
    out = jax.vmap(per_row)(q, k, v, segments)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None, *,
                     interpret: bool = False) -> jax.Array:
  """Pallas TPU splash attention; under a mesh, one kernel per batch and head shard (shard_map).

  `interpret`: Pallas interpret mode (same arithmetic, emulated on any backend), for tests and the plan.

  A Pallas call has no partitioning rule, so without shard_map XLA would gather the global
  batch onto every chip; sequences and heads are independent, so shards need no exchange.
  """
  local = functools.partial(_splash_local, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q, k, v, segments)
  # Batch shards, and head shards where the KV heads split evenly (then so do the query heads,
  # and each shard keeps whole groups).
  spec = mesh_lib.activation_spec(k.shape, ('batch', None, 'heads', None), dict(mesh.shape))
  args, specs = (q, k, v), (spec, spec, spec)
  if segments is not None:  # Segment ids split with their sequences.
    segment_spec = mesh_lib.activation_spec(segments.shape, ('batch', None), dict(mesh.shape))
    args, specs = (*args, segments), (*specs, segment_spec)
  return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)(*args)


_KERNELS = {
    'xla': xla_attention, 'dot_product': dot_product_attention,
    'cudnn': functools.partial(dot_product_attention, implementation='cudnn'), 'splash': splash_attention,
    'splash_interpret': functools.partial(splash_attention, interpret=True)}


class CausalSelfAttention(nnx.Module):
  """Grouped-query attention where position t attends only to positions <= t."""

  def __init__(self, cfg, kv_heads: int, out_stddev: float, dtype: jnp.dtype, rngs: nnx.Rngs):
    d, heads = cfg.d_model, cfg.num_heads
    head_dim = d // heads
    axes = ('embed', 'heads', 'kv')
    self.query = Kernel(rngs, INIT_STDDEV, (d, heads, head_dim), axes, dtype)
    self.key = Kernel(rngs, INIT_STDDEV, (d, kv_heads, head_dim), axes, dtype)
    self.value = Kernel(rngs, INIT_STDDEV, (d, kv_heads, head_dim), axes, dtype)
    self.out = Kernel(rngs, out_stddev, (heads, head_dim, d), ('heads', 'kv', 'embed'), dtype)
    self.rope_theta = cfg.rope_theta if cfg.position == 'rope' else 0.0
    self.implementation = cfg.attention

  def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    """Mixes [B, T, d] positions causally (and within their segment, given segment ids [B, T])."""
    q = constrain(self.query('btd,dhk->bthk', x), _HEADS_AXES)
    k = constrain(self.key('btd,dhk->bthk', x), _HEADS_AXES)
    v = constrain(self.value('btd,dhk->bthk', x), _HEADS_AXES)
    if self.rope_theta:
      q, k = rope(q, self.rope_theta), rope(k, self.rope_theta)
    choice = select(self.implementation, jax.default_backend(), q.dtype, segments is not None)
    if choice.fallback:
      logging.warning('model.attention=%s: %s', self.implementation, choice.fallback)
    mixed = _KERNELS[choice.kernel](q, k, v, segments)
    return self.out('bqhk,hkd->bqd', constrain(mixed, _HEADS_AXES))

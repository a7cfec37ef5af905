"""Building blocks of the Transformer: parameters, projections, norms, MLPs, activation layout.

Every parameter is float32 and carries logical axis names; `constrain` pins an activation to
the logical layout of ACTIVATION_RULES (decoupled_diloco.mesh) when the caller traces under a
group's mesh, so the compiled program shards activations over the batch whatever the params do.
"""

import jax
from flax import nnx
import jax.numpy as jnp

from decoupled_diloco import mesh as mesh_lib

INIT_STDDEV = 0.02
_NORM_EPS = 1e-6


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """Pins `x` to its logical layout under the abstract mesh in scope; a no-op without one.

  Why: sharding propagation alone follows FSDP-sharded params and can put the residual stream
  on the embed dimension, so every chip computes partial matmuls for the whole global batch.
  The inner loop traces under its group's mesh (jax.sharding.use_abstract_mesh); plain calls on
  one device (tests, evaluation on the host) see no mesh and are unchanged.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, mesh_lib.activation_spec(x.shape, logical_axes, dict(mesh.shape)))


def param(rngs: nnx.Rngs, stddev: float, shape: tuple[int, ...], axes: tuple) -> nnx.Param:
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

  def __init__(self, rngs: nnx.Rngs, stddev: float, shape: tuple[int, ...], axes: tuple, dtype: jnp.dtype):
    self.kernel = param(rngs, stddev, shape, axes)
    self.dtype = dtype

  def __call__(self, spec: str, x: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, self.kernel[...].astype(self.dtype))


MLP_KINDS = ('gelu', 'swiglu')


class MLP(nnx.Module):
  """Position-wise feed-forward block: GELU (GPT-2) or SwiGLU (Llama, Gemma).

  SwiGLU multiplies a SiLU-gated projection with a second one (wi), then projects back (wo);
  it has three d x d_ff matrices instead of two.
  """

  def __init__(self, d: int, d_ff: int, kind: str, out_stddev: float, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.kind = kind
    self.wi = Kernel(rngs, INIT_STDDEV, (d, d_ff), ('embed', 'mlp'), dtype)
    if kind == 'swiglu':
      self.wg = Kernel(rngs, INIT_STDDEV, (d, d_ff), ('embed', 'mlp'), dtype)
    self.wo = Kernel(rngs, out_stddev, (d_ff, d), ('mlp', 'embed'), dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    hidden = self.wi('btd,df->btf', x)
    if self.kind == 'swiglu':
      hidden = jax.nn.silu(self.wg('btd,df->btf', x)) * hidden
    else:
      hidden = jax.nn.gelu(hidden)
    hidden = constrain(hidden, ('batch', 'length', 'mlp'))
    return self.wo('btf,fd->btd', hidden)

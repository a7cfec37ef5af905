"""Mixture-of-experts feed-forward blocks: a learned router, top-k experts, capacity and its losses.

A token's normed residual x goes to the k experts its router scores highest, and their outputs
are mixed by the renormalised router probabilities (gates). With a capacity factor c > 0 every
expert takes at most C = min(T, ceil(k * T * c / E)) tokens of each sequence (a sequence is one
routing group, so routing never depends on how the batch is split over devices or microbatches);
what overflows is dropped (the residual carries the token on) and counted. With c = 0 no token is
dropped: tokens are sorted by expert and go through grouped matmuls (jax.lax.ragged_dot).
Equations of the load-balancing and z losses: docs/moe.md.
"""

import dataclasses
import math
from typing import Any

import jax
from flax import nnx
import jax.numpy as jnp

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model import layers
from decoupled_diloco.model.layers import INIT_STDDEV, constrain

# What each MoE block reports to the loss (summed over blocks; see `summarize`).
STAT_KEYS = ('balance', 'z', 'dropped', 'assigned', 'max_load', 'min_load')
_EXPERT_AXES = ('expert', 'batch', None, 'embed')


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.model.moe`, validated: num_experts = 0 is the dense model and then nothing else may be set."""
  num_experts: int = 0
  top_k: int = 2
  capacity_factor: float = 1.25
  every: int = 1
  d_ff: int = 0
  shared_experts: int = 0
  aux_loss_weight: float = 0.01
  z_loss_weight: float = 0.001

  def __post_init__(self):
    counts = ('num_experts', 'top_k', 'every', 'd_ff', 'shared_experts')
    settings_lib.check((settings_lib.is_int(getattr(self, name)) and getattr(self, name) >= 0,
                        f'model.moe.{name}={getattr(self, name)!r} must be an int >= 0: set --config.model.moe.{name}')
                       for name in counts)
    for name in ('capacity_factor', 'aux_loss_weight', 'z_loss_weight'):
      value = getattr(self, name)
      settings_lib.check([
          (isinstance(value, (int, float)) and not isinstance(value, bool) and
           value >= 0, f'model.moe.{name}={value!r} must be a number >= 0: set --config.model.moe.{name}')])
    if not self.num_experts:
      changed = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
      if changed:
        raise ConfigError(f'model.moe.{changed[0]} is set but model.moe.num_experts=0 (dense): set '
                          '--config.model.moe.num_experts > 0 or leave it at its default')
      return
    settings_lib.check([
        (self.top_k <= self.num_experts and self.top_k >= 1,
         f'model.moe.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]: set --config.model.moe.top_k'),
        (self.every >= 1, f'model.moe.every={self.every} must be >= 1 (1 = every block routes): set '
         '--config.model.moe.every')])

  @classmethod
  def from_config(cls, cfg: Any) -> 'Settings':
    """The moe sub-group of the model config (absent: dense); unknown fields are refused by name."""
    return cfg if isinstance(cfg, cls) else settings_lib.from_config(cls, cfg or {}, 'model.moe')

  def is_moe_block(self, index: int) -> bool:
    """Whether block `index` routes: every `every`-th block, counting from 1 (every=2: blocks 1, 3, ...)."""
    return bool(self.num_experts) and (index + 1) % self.every == 0

  def moe_blocks(self, num_layers: int) -> int:
    """How many of `num_layers` blocks route."""
    return sum(self.is_moe_block(i) for i in range(num_layers))


def check_model(moe: Settings, num_layers: int, scan_layers: bool) -> None:
  """MoE options that depend on the rest of the model: a block pattern that exists and that scan can stack."""
  if moe.num_experts and moe.every > num_layers:
    raise ConfigError(f'model.moe.every={moe.every} > model.num_layers={num_layers}: no block would route; '
                      'lower --config.model.moe.every')
  if moe.num_experts and moe.every > 1 and scan_layers:
    raise ConfigError(f'model.moe.every={moe.every} mixes dense and MoE blocks, which scan_layers cannot stack: '
                      'set --config.model.moe.every=1 or --config.model.scan_layers=False')


def mlp_params(moe: Settings, index: int, d_model: int, d_ff: int, matrices: int, active: bool) -> int:
  """Params of block `index`'s feed-forward part: a dense MLP's, or an MoE block's router, shared experts
  and all E experts (`active`: only the k a token runs through, what its FLOPs count)."""
  if not moe.is_moe_block(index):
    return matrices * d_model * d_ff
  experts = moe.top_k if active else moe.num_experts
  return d_model * moe.num_experts + matrices * d_model * (moe.d_ff or d_ff) * (experts + moe.shared_experts)


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """C: token slots per expert per sequence of `tokens` (no expert can take more than every token)."""
  return min(tokens, max(1, math.ceil(top_k * tokens * capacity_factor / num_experts)))


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """float32 router logits [..., E] -> (probabilities [..., E], gates [..., k], experts [..., k]).

  Gates are the top-k probabilities renormalised to sum to one, so a token's output keeps the
  scale of one expert's whatever k is (Mixtral's choice; k = 1 gives gate 1).
  """
  probs = jax.nn.softmax(logits, axis=-1)
  top, experts = jax.lax.top_k(probs, top_k)
  return probs, top / jnp.sum(top, axis=-1, keepdims=True), experts


def slots(experts: jax.Array, num_experts: int) -> jax.Array:
  """int32 [B, T, k]: each assignment's place in its expert's queue within its sequence.

  Every token's first choice queues before any token's second choice (so capacity drops second
  choices first), and within a choice earlier tokens come first.
  """
  b, t, k = experts.shape
  onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32).transpose(0, 2, 1, 3).reshape(b, k * t, num_experts)
  place = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
  return place.reshape(b, k, t).transpose(0, 2, 1)


def expert_share(experts: jax.Array, num_experts: int) -> jax.Array:
  """f [E]: the share of all k * N assignments routed to each expert (before capacity)."""
  return jnp.mean(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=tuple(range(experts.ndim)))


def balance_loss(probs: jax.Array, experts: jax.Array) -> jax.Array:
  """Switch/GShard load balance E * sum_e f_e * P_e over every token of the batch (1 when uniform).

  f_e: `expert_share` (no gradient); P_e: mean router probability of e. Its gradient pushes
  probability off overloaded experts.
  """
  num_experts = probs.shape[-1]
  mean_probs = jnp.mean(probs, axis=tuple(range(probs.ndim - 1)))
  return num_experts * jnp.sum(expert_share(experts, num_experts) * mean_probs)


def z_loss(logits: jax.Array) -> jax.Array:
  """ST-MoE router z-loss mean_t (logsumexp_e logits)^2: keeps router logits small, so bf16 stays exact."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def zero_stats() -> dict:
  """The stats a dense block of an MoE model reports, so every block returns the same structure."""
  return {key: jnp.zeros((), jnp.float32) for key in STAT_KEYS}


def summarize(stats: dict, moe_blocks: int, settings: Any) -> tuple[jax.Array, dict]:
  """Block stats summed over the model -> (the penalty added to the training loss, metrics).

  Why the mean over MoE blocks: the weights then mean the same whatever the depth. Loads are E * f_e
  (1 = an expert's fair share): the busiest and idlest expert's, averaged over MoE blocks.
  """
  balance, z = stats['balance'] / moe_blocks, stats['z'] / moe_blocks
  penalty = settings.aux_loss_weight * balance + settings.z_loss_weight * z
  return penalty, {
      'moe_aux_loss': balance, 'moe_z_loss': z, 'moe_dropped_fraction': stats['dropped'] / stats['assigned'],
      'moe_max_load': stats['max_load'] / moe_blocks, 'moe_min_load': stats['min_load'] / moe_blocks}


class MoE(nnx.Module):
  """E expert MLPs (GELU or SwiGLU, as the dense ones), a router, and optional always-on shared experts.

  Expert weights lead with the `expert` logical axis, which a group's layout may shard
  (expert=N); the dispatched tokens [E, B, C, d] are pinned to it too, so XLA moves tokens to
  their experts' devices (an all-to-all) rather than gathering the experts.
  """

  def __init__(self, cfg: Any, out_stddev: float, dtype: jnp.dtype, rngs: nnx.Rngs):
    moe, d = cfg.moe, cfg.d_model
    f, e = moe.d_ff or cfg.d_ff, moe.num_experts
    self.top_k, self.capacity_factor, self.kind, self.dtype = moe.top_k, moe.capacity_factor, cfg.mlp, dtype
    self.router = layers.param(rngs, INIT_STDDEV, (d, e), ('embed', None))
    self.wi = layers.param(rngs, INIT_STDDEV, (e, d, f), ('expert', 'embed', 'mlp'))
    if cfg.mlp == 'swiglu':
      self.wg = layers.param(rngs, INIT_STDDEV, (e, d, f), ('expert', 'embed', 'mlp'))
    self.wo = layers.param(rngs, out_stddev, (e, f, d), ('expert', 'mlp', 'embed'))
    if moe.shared_experts:
      self.shared = layers.MLP(d, moe.shared_experts * f, cfg.mlp, out_stddev, dtype, rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
    """[B, T, d] -> ([B, T, d], this block's stats {balance, z, dropped, assigned})."""
    logits = jnp.einsum('btd,de->bte', x.astype(jnp.float32), self.router[...])
    probs, gates, experts = route(logits, self.top_k)
    if self.capacity_factor:
      out, dropped = self._with_capacity(x, gates, experts)
    else:
      out, dropped = self._dropless(x, gates, experts), jnp.zeros((), jnp.float32)
    if hasattr(self, 'shared'):
      out = out + self.shared(x)
    load = probs.shape[-1] * expert_share(experts, probs.shape[-1])
    stats = {
        'balance': balance_loss(probs, experts), 'z': z_loss(logits), 'dropped': dropped,
        'assigned': jnp.asarray(experts.size, jnp.float32), 'max_load': jnp.max(load), 'min_load': jnp.min(load)}
    return out, stats

  def _expert_mlp(self, up, down, tokens: jax.Array) -> jax.Array:
    """The expert MLPs on tokens grouped by expert; `up(tokens, w)` and `down(hidden, w)` apply one
    expert-stacked weight however the tokens are grouped (dense slots or ragged groups)."""
    weight = lambda p: p[...].astype(self.dtype)  # noqa: E731
    hidden = up(tokens, weight(self.wi))
    if self.kind == 'swiglu':
      hidden = jax.nn.silu(up(tokens, weight(self.wg))) * hidden
    else:
      hidden = jax.nn.gelu(hidden)
    return down(hidden, weight(self.wo))

  def _with_capacity(self, x: jax.Array, gates: jax.Array, experts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GShard dispatch and combine tensors [B, T, E, C]; assignments past capacity are dropped."""
    num_experts = self.wi.shape[0]
    slots_per_expert = capacity(x.shape[1], num_experts, self.top_k, self.capacity_factor)
    place = slots(experts, num_experts)
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # [B, T, k, E]
    at = jax.nn.one_hot(place, slots_per_expert, dtype=jnp.float32)  # [B, T, k, C]; all zero past capacity
    dispatch = jnp.einsum('btke,btkc->btec', chosen, at)
    combine = jnp.einsum('btke,btkc->btec', chosen * gates[..., None], at)
    dropped = jnp.sum((place >= slots_per_expert).astype(jnp.float32))
    tokens = constrain(jnp.einsum('btec,btd->ebcd', dispatch.astype(self.dtype), x), _EXPERT_AXES)
    up = lambda a, w: constrain(jnp.einsum('ebcd,edf->ebcf', a, w), ('expert', 'batch', None, 'mlp'))  # noqa: E731
    out = self._expert_mlp(up, lambda h, w: jnp.einsum('ebcf,efd->ebcd', h, w), tokens)
    return jnp.einsum('ebcd,btec->btd', constrain(out, _EXPERT_AXES), combine.astype(self.dtype)), dropped

  def _dropless(self, x: jax.Array, gates: jax.Array, experts: jax.Array) -> jax.Array:
    """Every assignment computed: sorted by expert, grouped matmuls of ragged group sizes, scattered back."""
    b, t, d = x.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // self.top_k
    sizes = jnp.bincount(flat, length=self.wi.shape[0]).astype(jnp.int32)
    grouped = lambda a, w: jax.lax.ragged_dot(a, w, sizes)  # noqa: E731
    out = self._expert_mlp(grouped, grouped, x.reshape(b * t, d)[token])
    out = out * gates.reshape(-1)[order, None].astype(out.dtype)
    return jnp.zeros((b * t, d), out.dtype).at[token].add(out).reshape(b, t, d)

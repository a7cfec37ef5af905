"""Merging pseudo-gradients from several learners into one.

Learners that processed more tokens carry more signal, so the synchronous merge is a
token-weighted mean; with equal shards it is the plain mean of DiLoCo. Asynchronous and
Decoupled DiLoCo add merge weights (staleness, tokens per step) and radial-directional
averaging, which keeps the merged norm from shrinking when learners disagree.

The syncer merges by streaming accumulation (`Accumulator`, `accumulate`, `merged`): each
push is folded into running sums as it arrives and its buffer released, so host memory does
not grow with the number of pushes per merge. `merge_deltas` is the batch definition the
streaming form equals (to float32 rounding; bit for bit when the folded weights are exact).
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def normalized_weights(weights: Sequence[float]) -> np.ndarray:
  """Weights scaled to sum to one; rejects all-zero or negative weights early."""
  w = np.asarray(weights, np.float64)
  if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
    raise ValueError(f"merge weights must be finite, non-negative and not all zero, got {w.tolist()}")
  return w / w.sum()


def weighted_average(deltas: Sequence, weights):
  """Σ w_m Δ_m over pytrees of identical structure, for weights that sum to one.

  Jit-friendly (weights may be traced); normalise them first with `normalized_weights`.
  """
  return jax.tree.map(lambda *leaves: sum(weights[m] * leaf for m, leaf in enumerate(leaves)), *deltas)


STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge", "exponential")


def staleness_weight(staleness: int, kind: str, a: float, b: float) -> float:
  """How much to trust a pseudo-gradient computed from params `staleness` versions old.

  An asynchronous syncer has moved on since the learner started, so older updates point in
  a direction that was right for a Θ that no longer exists; these asynchronous federated
  learning weights (s = staleness) shrink them:
    constant     1                                         (ignore staleness)
    polynomial   (1 + s)^-a        e.g. a = 0.5: s = 0 → 1, s = 3 → 0.5 (FedBuff's 1/√(1+s))
    hinge        1 if s <= b else 1 / (a(s − b) + 1)       e.g. a = 1, b = 2: s = 2 → 1, s = 4 → 1/3
    exponential  exp(−a·s)         e.g. a = ln 2: halves per version, s = 1 → 0.5
  `b` is used only by 'hinge'. Every kind gives 1 at s = 0 and never grows with s (a >= 0).
  """
  if kind not in STALENESS_FUNCTIONS:
    raise ValueError(f"staleness kind {kind!r} is unknown: use one of {STALENESS_FUNCTIONS}")
  if staleness < 0:
    raise ValueError(f"staleness={staleness} is negative: pass syncer version now − the learner's start version")
  if a < 0:
    raise ValueError(f"staleness a={a} is negative: use a >= 0 so older updates never weigh more")
  if kind == "hinge" and b < 0:
    raise ValueError(f"hinge b={b} is negative: use b >= 0, the staleness tolerated at full weight")
  s = float(staleness)
  if kind == "polynomial":
    return (1.0 + s)**-a
  if kind == "hinge":
    return 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0)
  if kind == "exponential":
    return math.exp(-a * s)
  return 1.0


TOKEN_WEIGHTINGS = ("none", "tokens", "tokens_squared_per_step")


def token_weight(tokens: int, steps: int, kind: str) -> float:
  """Merge weight of a learner that processed `tokens` tokens in `steps` inner steps.

  Counted since the learner last received the merged params (or fragment):
    none                     1                    (plain DiLoCo mean)
    tokens                   tokens               (more data, more signal)
    tokens_squared_per_step  tokens · tokens/steps  (Decoupled DiLoCo: w_m = c_tokens · c_tokens/c_steps)
  The last also rewards large batches: 1000 tokens in 10 steps weigh 100,000; the same tokens
  in 100 steps of smaller, noisier batches weigh 10,000. Normalise with `normalized_weights`.
  """
  if kind not in TOKEN_WEIGHTINGS:
    raise ValueError(f"token weighting {kind!r} is unknown: use one of {TOKEN_WEIGHTINGS}")
  if tokens < 0:
    raise ValueError(f"tokens={tokens} is negative: pass the tokens processed since the last merge")
  if steps < 1:
    raise ValueError(f"steps={steps} must be >= 1: pass the inner steps taken since the last merge")
  if kind == "tokens":
    return float(tokens)
  if kind == "tokens_squared_per_step":
    return float(tokens) * (float(tokens) / float(steps))
  return 1.0


def _norm(x):
  """L2 norm of a whole tensor, accumulated in float32 so bfloat16 deltas do not overflow."""
  return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def _direction(x):
  """φ(x) = x/‖x‖ in float32, with φ(0) = 0 (dividing by 1 instead of 0 keeps it NaN-free)."""
  n = _norm(x)
  return x.astype(jnp.float32) / jnp.where(n > 0, n, 1.0)


def _rda_leaf(weights, *leaves):
  """RDA of one tensor: the weighted mean norm times the direction of the weighted mean direction."""
  radius = sum(weights[m] * _norm(leaf) for m, leaf in enumerate(leaves))
  direction = _direction(sum(weights[m] * _direction(leaf) for m, leaf in enumerate(leaves)))
  return (radius * direction).astype(leaves[0].dtype)


def radial_directional_average(deltas: Sequence, weights):
  """Radial-directional average (Decoupled DiLoCo) per tensor, for weights that sum to one.

  Δ = (Σ w_m ‖Δ_m‖) · φ(Σ w_m φ(Δ_m)), φ(x) = x/‖x‖ (φ(0) = 0, so a zero average direction
  gives 0). The plain mean of M near-orthogonal pseudo-gradients of norm r has norm r/√M
  (two orthogonal unit vectors: 1/√2 ≈ 0.71); RDA keeps norm r (here 1) and the mean's
  direction, so adding learners does not silently shrink the outer step. Identical inputs
  are returned unchanged.

  Norms are per tensor (per leaf), not over the whole tree: tensor scales differ a lot
  (an embedding and a norm scale move by very different amounts), and a global norm would
  let the largest tensor's scale decide every tensor's step length.
  Jit-friendly (weights may be traced); normalise them first with `normalized_weights`.
  """
  return jax.tree.map(lambda *leaves: _rda_leaf(weights, *leaves), *deltas)


BATCH_RULES = ("mean", "rda")  # What `merge_deltas` defines; the robust rules are `robust`'s.
MERGE_RULES = (*BATCH_RULES, "clip", "trimmed_mean")  # syncer.merge_rule; clip and trimmed_mean merge by the mean.


def _is_embedding_path(path) -> bool:
  return any("embed" in str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def embedding_mask(params):
  """True for leaves whose key path contains 'embed' (the model's 'token_embed', 'pos_embed').

  Decoupled DiLoCo merges embeddings with the weighted mean and every other tensor with RDA,
  so this is the `averaged_mask` for `merge_deltas`. Works on params or `abstract_params` shapes.
  """
  return jax.tree_util.tree_map_with_path(lambda path, _: _is_embedding_path(path), params)


def merge_deltas(deltas: Sequence, weights, rule: str, averaged_mask=None):
  """Merge pseudo-gradients with `rule`, for weights that sum to one (may be traced).

  'mean' is `weighted_average` (the mask is not needed). 'rda' is `radial_directional_average`
  for every leaf except those where `averaged_mask` (a pytree of Python bools with the params'
  structure, e.g. `embedding_mask(params)`) is True, which get the weighted mean; no mask = RDA
  everywhere. Under jit, rule and mask are static: close over them, do not pass them as args.
  """
  if rule not in BATCH_RULES:
    raise ValueError(f"merge rule {rule!r} has no batch form here: use one of {BATCH_RULES} (robust rules: `robust`)")
  if len(deltas) == 0 or len(deltas) != len(weights):
    raise ValueError(f"got {len(deltas)} deltas, {len(weights)} weights: pass one weight per delta (at least one)")
  if rule == "mean":
    return weighted_average(deltas, weights)
  if averaged_mask is None:
    return radial_directional_average(deltas, weights)

  def leaf_rule(use_mean, *leaves):
    if not isinstance(use_mean, (bool, np.bool_)):
      raise ValueError(f"averaged_mask leaf is a {type(use_mean).__name__}: close over the mask, do not trace it")
    if use_mean:
      return sum(weights[m] * leaf for m, leaf in enumerate(leaves))
    return _rda_leaf(weights, *leaves)

  return jax.tree.map(leaf_rule, averaged_mask, *deltas)


class Accumulator(NamedTuple):
  """One fragment's open pushes as running sums: what a merge needs, whatever their number.

  With a_i = f(s_i)·t_i / t_ref (staleness factor × token weight, relative to the first
  push's token weight t_ref, so equal weights fold with a_i = 1 exactly):
    sums[k]   Σ a_i Δ_i[k]      for leaves merged by the weighted mean (every leaf under 'mean',
                                 embeddings under 'rda'), float32;
              Σ a_i φ(Δ_i[k])   for RDA leaves;
    radii[k]  Σ a_i ‖Δ_i[k]‖    for RDA leaves (float32 scalar), None for mean leaves;
    total     Σ t_i / t_ref     (float64): the token shares t_i / Σ t_j depend on the whole set,
                                 so they are applied once, at merge time, from this sum.
  """
  sums: list
  radii: list
  total: float
  ref: float


def fold_scale(weight: float, damping: float, ref: float) -> np.float32:
  """a_i = f(s_i)·t_i / t_ref in float32 (`weight` = t_i): the factor a push is folded with."""
  return np.float32(damping * (weight / ref))


def accumulate_leaf(total, radius, delta, scale, rda: bool):
  """One tensor of one push folded into its running sums: (Σ + a·Δ or a·φ(Δ), radius + a·‖Δ‖).

  `total` None starts the sums with this push. Jit-friendly; `rda` is static.
  """
  x = delta.astype(jnp.float32)
  term = scale * (_direction(x) if rda else x)
  total = term if total is None else total + term
  if not rda:
    return total, None
  step = scale * _norm(x)
  return total, step if radius is None else radius + step


def merged_leaf(total, radius, inverse_total, rda: bool, dtype):
  """The merge of one tensor from its sums; `inverse_total` = t_ref / Σ t_j (float32).

  Mean: Σ a_i Δ_i · t_ref/Σt = Σ f(s_i)·(t_i/Σt)·Δ_i. RDA: the radius scales the same way,
  and the direction is φ of the scaled direction sum (φ ignores the scale up to rounding;
  scaling first keeps the batch merge's rounding when the shares are powers of two).
  """
  if not rda:
    return total * inverse_total
  return ((radius * inverse_total) * _direction(total * inverse_total)).astype(dtype)


def rda_leaves(rule: str, averaged: Sequence[bool]) -> tuple[bool, ...]:
  """Per leaf (in `jax.tree.leaves` order): True where `rule` merges it by RDA, False where by the mean.

  `averaged`: the embedding mask's leaves (averaged plainly under 'rda'). The robust rules ('clip',
  'trimmed_mean') bound each push, then average: no leaf is merged by RDA.
  """
  if rule not in MERGE_RULES:
    raise ValueError(f"merge rule {rule!r} is unknown: use one of {MERGE_RULES}")
  return tuple(rule == "rda" and not bool(a) for a in averaged)

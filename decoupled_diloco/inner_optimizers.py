"""The inner optimizer a learner group trains with: AdamW (DiLoCo's) or Muon (MuLoCo's, Moonlight's recipe).

MuLoCo (Thérien et al. 2025) shows the inner optimizer is a DiLoCo knob of its own: Muon inside DiLoCo
compresses better. Both optimizers here are pure optax transformations behind one global-norm clip and
one warmup + cosine schedule (`inner.inner_optimizer`), so the train step, the sharding of the state, the
checkpoints and the plan's byte count do not change with the choice. Equations: docs/research.md.
"""

import inspect

import jax
import optax

from decoupled_diloco import model as model_lib
from decoupled_diloco.errors import ConfigError

OPTIMIZERS = ("adamw", "muon")
# The keyword arguments of optax.contrib.muon this module relies on (optax 0.2.8 has them all).
_MUON_KEYWORDS = ("ns_steps", "beta", "weight_decay", "adam_b1", "adam_b2", "adam_weight_decay",
                  "muon_weight_dimension_numbers", "consistent_rms")
# Leaves of a block that project the heads back to the residual stream: [heads, head_dim, d_model].
_HEADS_IN = ("attn", "out")


def decays(path, param) -> bool:
  """Whether weight decay applies to a leaf: matrices, not vectors (norm scales, biases), as is standard for
  Transformers; a leaf of stacked blocks (scan_layers) counts its leading layer axis out."""
  return param.ndim - model_lib.layer_axes(path) > 1


def adamw(settings, schedule) -> optax.GradientTransformation:
  """DiLoCo's inner AdamW (decoupled weight decay on matrices only)."""
  return optax.adamw(schedule, b1=settings.b1, b2=settings.b2, weight_decay=settings.weight_decay,
                     mask=lambda params: jax.tree_util.tree_map_with_path(decays, params))


def muon_dimensions(params):
  """Per leaf, how Muon sees it as a matrix (`optax.contrib.MuonDimensionNumbers`), or None for AdamW.

  Muon takes every weight matrix inside a Transformer block (attention's query, key, value and output
  projections, the MLP's); AdamW takes the rest: token and position embeddings, the output layer
  (lm_head) and norm scales, as in Moonlight and MuLoCo, because an embedding row or a logit row is a
  vector per token, not a linear map to orthogonalise. An attention projection is one matrix between
  the residual stream (d_model) and all heads together (heads × head_dim), not one per head; the
  leading layer axis of stacked blocks (scan_layers) is a batch axis: each layer is its own matrix.
  """
  dimensions = optax.contrib.MuonDimensionNumbers

  def leaf(path, param):
    first = model_lib.layer_axes(path)
    keys = tuple(getattr(entry, "key", None) for entry in path)
    in_block = keys[0] == model_lib.STACKED or str(keys[0]).startswith("block_")
    if not in_block or param.ndim - first < 2:
      return None
    if keys[-3:-1] == _HEADS_IN:
      return dimensions(tuple(range(first, param.ndim - 1)), param.ndim - 1)
    return dimensions(first, tuple(range(first + 1, param.ndim)))

  return jax.tree_util.tree_map_with_path(leaf, params)


def muon(settings, schedule) -> optax.GradientTransformation:
  """`optax.contrib.muon`: Nesterov momentum β on the gradient, then each block matrix's update
  orthogonalised by `muon_ns_steps` Newton–Schulz iterations (Keller Jordan's coefficients) on
  X/‖X‖_F; the other leaves (`muon_dimensions`) take optax's AdamW inside it (Nesterov too, b1, b2).

  Why `muon_consistent_rms` (Moonlight, Liu et al. 2025): the orthogonalised update times
  0.2·√max(fan_in, fan_out) has AdamW's update RMS, so both halves share one lr, one schedule and
  one weight decay (decoupled, times lr; on every leaf, embeddings and norm scales too, as Moonlight
  and optax apply it). 0 keeps Keller Jordan's √max(1, fan_out/fan_in), which needs its own, larger lr.
  """
  return optax.contrib.muon(schedule, ns_steps=settings.muon_ns_steps, beta=settings.muon_beta,
                            weight_decay=settings.weight_decay, adam_b1=settings.b1, adam_b2=settings.b2,
                            adam_weight_decay=settings.weight_decay, muon_weight_dimension_numbers=muon_dimensions,
                            consistent_rms=settings.muon_consistent_rms or None)


def require_optax_muon() -> None:
  """A clear refusal where the installed optax lacks what `muon` calls (optax.contrib is not a stable API)."""
  function = getattr(getattr(optax, "contrib", None), "muon", None)
  missing = [name for name in _MUON_KEYWORDS if function and name not in inspect.signature(function).parameters]
  if function is None or missing or not hasattr(optax.contrib, "MuonDimensionNumbers"):
    raise ConfigError(f"inner.optimizer='muon' needs optax.contrib.muon with {missing or list(_MUON_KEYWORDS)} "
                      f"(optax {optax.__version__} is installed): pip install 'optax>=0.2.8', or use "
                      "--config.inner.optimizer=adamw")


BUILDERS = {"adamw": adamw, "muon": muon}

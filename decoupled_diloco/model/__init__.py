"""Decoder-only Transformer language model, exposed as pure functions over pure-dict params.

Why pure dicts: the rest of the framework averages, checkpoints and ships params over the
wire, so it must not depend on NNX objects; NNX only declares the parameters (with logical
sharding annotations) and applies them. No dropout, so runs are bit-for-bit repeatable.
Because the axes tuples of `param_axes` are pytree nodes, always map with params FIRST
(`jax.tree.map(f, params, param_axes)`), or pass `is_leaf=is_axes_leaf`. Architecture and
param tree layout: docs/scale.md.
"""

from typing import Any

from flax import nnx

from decoupled_diloco.model.sizing import Settings, count_params, flops_per_token, idle_expert_params, with_defaults
from decoupled_diloco.model.stacking import STACKED, layer_axes, stack_blocks, stack_shardings, unstack_blocks
from decoupled_diloco.model.transformer import LanguageModel, Transformer

__all__ = [
    'LanguageModel', 'STACKED', 'Settings', 'abstract_params', 'active_params', 'build_model', 'count_params',
    'flops_per_token', 'is_axes_leaf', 'layer_axes', 'stack_blocks', 'stack_shardings', 'unstack_blocks']


def is_axes_leaf(x: Any) -> bool:
  """Marks axes tuples as leaves, so param_axes can be traversed without params alongside."""
  return isinstance(x, tuple)


def _split(module: Transformer, loss_chunk: int) -> tuple[LanguageModel, dict, dict]:
  """Separates a (real or abstract) module into model, pure-dict values and logical axes."""
  graphdef, state = nnx.split(module)
  values = nnx.to_pure_dict(state)
  axes = nnx.to_pure_dict(state, lambda v: tuple(v.get_metadata()['out_sharding']))
  return LanguageModel(graphdef, loss_chunk, module.num_layers if module.scan_layers else 0), values, axes


def build_model(model_cfg: Any, seed: int) -> tuple[LanguageModel, dict, dict]:
  """Validates model_cfg and initialises float32 params deterministically from seed.

  Returns (model, params, param_axes); see the module docstring for the tree layout and how
  to map over params and param_axes together.
  """
  cfg = with_defaults(model_cfg)
  return _split(Transformer(cfg, nnx.Rngs(seed)), cfg.loss_chunk)


def abstract_params(model_cfg: Any) -> tuple[LanguageModel, dict, dict]:
  """Like build_model but returns jax.ShapeDtypeStruct leaves, allocating no parameter memory.

  Lets 1B-parameter TPU configs be checked on a laptop and gives checkpoint restore its targets.
  """
  cfg = with_defaults(model_cfg)
  return _split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))), cfg.loss_chunk)


def active_params(model_cfg: Any) -> int:
  """Params one token runs through: all of a dense model's, an MoE model's but its unchosen experts.

  Why: an MoE model is compared with a dense one at equal active params (equal FLOPs per token);
  its step time follows them, its memory follows count_params.
  """
  return count_params(abstract_params(model_cfg)[1]) - idle_expert_params(model_cfg)

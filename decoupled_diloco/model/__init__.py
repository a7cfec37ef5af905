"""Decoder-only Transformer language model, exposed as pure functions over pure-dict params.

Architecture (defaults GPT-2-like, no dropout so runs are bit-for-bit repeatable):
  token embedding (+ learned position embedding, or rotary positions: model.position)
  -> num_layers x [RMSNorm -> causal grouped-query attention -> residual,
                   RMSNorm -> GELU or SwiGLU MLP -> residual]
  -> final RMSNorm -> output projection to vocab logits (untied, or the embedding: tie_embeddings).
There are no bias terms. Params are always float32; `model.dtype` only sets the compute dtype.
Softmaxes, norms and the output logits are computed in float32 for stability under bfloat16.
How it runs at scale (remat, scan_layers, attention kernels, chunked loss) changes no result
beyond float rounding; see docs/scale.md.

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
"""

from typing import Any

from flax import nnx

from decoupled_diloco.model.sizing import Settings, count_params, flops_per_token, with_defaults
from decoupled_diloco.model.stacking import STACKED, layer_axes, stack_blocks, stack_shardings, unstack_blocks
from decoupled_diloco.model.transformer import LanguageModel, Transformer

__all__ = [
    'LanguageModel', 'STACKED', 'Settings', 'abstract_params', 'build_model', 'count_params', 'flops_per_token',
    'is_axes_leaf', 'layer_axes', 'stack_blocks', 'stack_shardings', 'unstack_blocks']


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

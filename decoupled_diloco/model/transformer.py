"""The decoder-only Transformer and `LanguageModel`, its pure-function face over pure-dict params.

Layers are `block_0 .. block_{L-1}` in the params tree whatever `scan_layers` says: with scan the
blocks' params are stacked at trace time and one compiled block runs under jax.lax.scan, so
checkpoints, fragments (which split by block index) and the merge rules see the same tree, and a
run may switch scan on or off between resumes. `remat` wraps each block in jax.checkpoint.
Blocks chosen by model.moe route tokens to experts (model/moe.py); every block of an MoE model
returns its router stats beside the stream, and `train_loss` adds their penalty to the loss.
"""

import dataclasses
import math
from typing import Any

import jax
from flax import nnx
import jax.numpy as jnp

from decoupled_diloco.model import attention, layers, moe, stacking
from decoupled_diloco.model.layers import INIT_STDDEV, RMSNorm, constrain

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_STREAM_AXES = ('batch', 'length', 'embed')

# What a rematerialised block keeps for the backward pass (everything else is recomputed):
# 'full' nothing but its input; 'dots_saveable' every matmul output; 'minimal' the matmuls
# against weights (no batch dimension in the contraction: not the T x T attention ones);
# 'offload' those same matmuls, moved to pinned host memory instead of kept on the chip.
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots_saveable': jax.checkpoint_policies.dots_saveable,
    'minimal': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'offload': jax.checkpoint_policies.offload_dot_with_no_batch_dims('device', 'pinned_host'),}


class Block(nnx.Module):
  """Pre-norm residual block: attention then MLP (or, when `routed`, a mixture of expert MLPs)."""

  def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs, routed: bool = False):
    # GPT-2 scaling: residual-output projections shrink with depth so the stream's variance at
    # init does not grow with num_layers.
    out_stddev = INIT_STDDEV / math.sqrt(2 * cfg.num_layers)
    self.attn_norm = RMSNorm(cfg.d_model, dtype)
    self.attn = attention.CausalSelfAttention(cfg, cfg.num_kv_heads or cfg.num_heads, out_stddev, dtype, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, dtype)
    self.routed, self.reports = routed, bool(cfg.moe.num_experts)
    self.mlp = (moe.MoE(cfg, out_stddev, dtype, rngs)
                if routed else layers.MLP(cfg.d_model, cfg.d_ff, cfg.mlp, out_stddev, dtype, rngs))

  def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """The new stream and the router stats (moe.STAT_KEYS; zeros in a dense block of an MoE model, {} in a
    dense model), so that every block of a model returns one structure, which scan needs."""
    x = constrain(x, _STREAM_AXES)
    x = x + constrain(self.attn(self.attn_norm(x), segments), _STREAM_AXES)
    out = self.mlp(self.mlp_norm(x))
    out, stats = out if self.routed else (out, moe.zero_stats() if self.reports else {})
    return constrain(x + constrain(out, _STREAM_AXES), _STREAM_AXES), stats


def _apply_block(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array,
                 segments: jax.Array | None) -> tuple[jax.Array, dict]:
  """One block as a pure function of its state, so it can be checkpointed and scanned."""
  return nnx.merge(graphdef, state)(x, segments)


def document_segments(tokens: jax.Array, eod_id: int) -> jax.Array:
  """int32 [B, T] segment ids of packed documents: each end-of-document token starts a new segment.

  Why the end-of-document token opens the next segment rather than closing its own: it is the
  separator the next document's first token is predicted from (the role of a BOS token), so
  within a segment every target is predicted from its own document only, no target needs
  masking, and the end of a document is still predicted from that document.
  """
  return jnp.cumsum(tokens == eod_id, axis=1, dtype=jnp.int32)


class Transformer(nnx.Module):
  """Token ids [B, T] -> final hidden states [B, T, d]; `head` turns them into logits."""

  def __init__(self, cfg: Any, rngs: nnx.Rngs):
    dtype = DTYPES[cfg.dtype]
    self.num_layers = cfg.num_layers
    self.seq_len = cfg.seq_len
    self.dtype = dtype
    self.remat = cfg.remat
    self.scan_layers = cfg.scan_layers
    self.document_eod_id = cfg.document_eod_id
    self.moe = moe.Settings.from_config(cfg.moe)
    self.token_embed = layers.param(rngs, INIT_STDDEV, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'))
    if cfg.position == 'learned':
      self.pos_embed = layers.param(rngs, INIT_STDDEV, (cfg.seq_len, cfg.d_model), (None, 'embed'))
    for i in range(cfg.num_layers):
      setattr(self, f'block_{i}', Block(cfg, dtype, rngs, self.moe.is_moe_block(i)))
    self.final_norm = RMSNorm(cfg.d_model, dtype)
    if not cfg.tie_embeddings:
      self.lm_head = layers.param(rngs, INIT_STDDEV, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'))

  def forward(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """(the final-normed residual stream [B, T, d] in the compute dtype, the routers' penalty to add to
    the training loss, router metrics); a dense model's penalty is 0 and its metrics {}."""
    t = tokens.shape[1]
    if t > self.seq_len:
      raise ValueError(f'tokens have length {t} > model.seq_len {self.seq_len}')
    x = jnp.take(self.token_embed[...], tokens, axis=0)
    if hasattr(self, 'pos_embed'):
      x = x + self.pos_embed[...][:t]
    x = constrain(x.astype(self.dtype), _STREAM_AXES)
    segments = document_segments(tokens, self.document_eod_id) if self.document_eod_id >= 0 else None
    graphdefs, states = zip(*(nnx.split(getattr(self, f'block_{i}')) for i in range(self.num_layers)))
    block = _apply_block
    if self.remat != 'none':
      block = jax.checkpoint(_apply_block, policy=REMAT_POLICIES[self.remat], static_argnums=(0,))
    if self.scan_layers:  # Every block has block_0's structure (moe.check_model).
      stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
      x, stats = jax.lax.scan(lambda carry, state: block(graphdefs[0], state, carry, segments), x, stacked)
      stats = jax.tree.map(lambda s: jnp.sum(s, axis=0), stats)
    else:
      stats = {}
      for graphdef, state in zip(graphdefs, states):
        x, block_stats = block(graphdef, state, x, segments)
        stats = jax.tree.map(jnp.add, stats, block_stats) if stats else block_stats
    if not stats:
      return self.final_norm(x), jnp.zeros((), jnp.float32), {}
    return self.final_norm(x), *moe.summarize(stats, self.moe.moe_blocks(self.num_layers), self.moe)

  def head_kernel(self) -> jax.Array:
    """[d, vocab] output projection: lm_head, or the token embedding transposed when tied."""
    return self.lm_head[...] if hasattr(self, 'lm_head') else self.token_embed[...].T

  def project(self, hidden: jax.Array) -> jax.Array:
    """float32 logits [B, T, vocab] of the final-normed stream."""
    return jnp.einsum('btd,dv->btv', hidden, self.head_kernel().astype(self.dtype), preferred_element_type=jnp.float32)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.project(self.forward(tokens)[0])


def _chunk_losses(kernel: jax.Array, hidden: jax.Array, targets: jax.Array) -> jax.Array:
  """Summed cross-entropy of one chunk of tokens; its float32 logits are never saved."""
  logits = jnp.einsum('btd,dv->btv', hidden, kernel, preferred_element_type=jnp.float32)
  logits = constrain(logits, ('batch', 'length', 'vocab'))
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - target_logits)


@dataclasses.dataclass(frozen=True)
class LanguageModel:
  """Applies the Transformer to pure-dict params; hashable, so it can be a jit static arg.

  Holds only the NNX graphdef (module structure + variable metadata, no arrays), the
  cross-entropy chunk, and the depth when the layers are scanned (0 when they are a loop), which
  tells the inner step to hold the blocks' params stacked. Methods take either params layout, are
  pure and not jitted: callers wrap them in their own jitted train/eval steps.
  """
  graphdef: nnx.GraphDef
  loss_chunk: int = 0
  scanned_layers: int = 0

  def module(self, params: dict) -> Transformer:
    """The Transformer holding `params`: block_0..block_{L-1}, or the inner step's stacked `blocks`.

    Why both: the inner step keeps scanned blocks stacked (its compiled size then does not grow
    with depth); they are dealt out here at trace time, and the scan stacks the slices again,
    which XLA folds away.
    """
    if stacking.STACKED in params:
      params = stacking.unstack_blocks(params, self.scanned_layers)
    return nnx.merge(self.graphdef, params)

  def logits(self, params: dict, tokens: jax.Array) -> jax.Array:
    """float32 logits [B, T, vocab] for int32 tokens [B, T]; logits at t depend only on <= t."""
    return self.module(params)(tokens)

  def loss(self, params: dict, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats for an int32 batch [B, T+1]: what evaluation reports."""
    return self._losses(params, batch)[0]

  def train_loss(self, params: dict, batch: jax.Array) -> tuple[jax.Array, dict]:
    """(what the inner step minimises, its metrics {'loss': the cross-entropy, router metrics}).

    Why apart from `loss`: an MoE model also minimises its routers' load-balance and z penalties,
    computed from this batch alone, while every loss it reports stays the cross-entropy, comparable
    with a dense model's and with ln(vocab). A dense model minimises its cross-entropy as such.
    """
    cross_entropy, penalty, metrics = self._losses(params, batch)
    return (cross_entropy + penalty if metrics else cross_entropy), {'loss': cross_entropy, **metrics}

  def _losses(self, params: dict, batch: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """(cross-entropy, router penalty, router metrics) of one batch.

    With loss_chunk = c > 0 the sequence is cut into chunks of c tokens and each chunk's
    logits are computed, reduced and (in the backward pass) recomputed on their own, so a
    large vocabulary never holds [B, T, V] float32 logits at once.
    """
    module = self.module(params)
    (hidden, penalty, metrics), targets = module.forward(batch[:, :-1]), batch[:, 1:]
    if not self.loss_chunk:
      log_probs = jax.nn.log_softmax(module.project(hidden), axis=-1)
      return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)), penalty, metrics
    b, t = targets.shape
    if t % self.loss_chunk:
      raise ValueError(f'sequence length {t} is not a multiple of model.loss_chunk {self.loss_chunk}')
    chunks = t // self.loss_chunk
    hidden = hidden.reshape(b, chunks, self.loss_chunk, -1).swapaxes(0, 1)
    targets = targets.reshape(b, chunks, self.loss_chunk).swapaxes(0, 1)
    kernel = module.head_kernel().astype(module.dtype)
    step = jax.checkpoint(_chunk_losses)
    total, _ = jax.lax.scan(lambda acc, xs: (acc + step(kernel, *xs), None), jnp.zeros((), jnp.float32),
                            (hidden, targets))
    return total / (b * t), penalty, metrics

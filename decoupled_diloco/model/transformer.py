"""The decoder-only Transformer and `LanguageModel`, its pure-function face over pure-dict params.

Layers are `block_0 .. block_{L-1}` in the params tree whatever `scan_layers` says: with scan the
blocks' params are stacked at trace time and one compiled block runs under jax.lax.scan, so
checkpoints, fragments (which split by block index) and the merge rules see the same tree, and a
run may switch scan on or off between resumes. `remat` wraps each block in jax.checkpoint.
"""

import dataclasses
import math
from typing import Any

import jax
from flax import nnx
import jax.numpy as jnp

from decoupled_diloco.model import attention, layers, stacking
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
  """Pre-norm residual block: attention then MLP."""

  def __init__(self, cfg: Any, dtype: jnp.dtype, rngs: nnx.Rngs):
    # GPT-2 scaling: residual-output projections shrink with depth so the stream's variance at
    # init does not grow with num_layers.
    out_stddev = INIT_STDDEV / math.sqrt(2 * cfg.num_layers)
    self.attn_norm = RMSNorm(cfg.d_model, dtype)
    self.attn = attention.CausalSelfAttention(cfg, cfg.num_kv_heads or cfg.num_heads, out_stddev, dtype, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, dtype)
    self.mlp = layers.MLP(cfg.d_model, cfg.d_ff, cfg.mlp, out_stddev, dtype, rngs)

  def __call__(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
    x = constrain(x, _STREAM_AXES)
    x = x + constrain(self.attn(self.attn_norm(x), segments), _STREAM_AXES)
    return constrain(x + constrain(self.mlp(self.mlp_norm(x)), _STREAM_AXES), _STREAM_AXES)


def _apply_block(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, segments: jax.Array | None) -> jax.Array:
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
    self.token_embed = layers.param(rngs, INIT_STDDEV, (cfg.vocab_size, cfg.d_model), ('vocab', 'embed'))
    if cfg.position == 'learned':
      self.pos_embed = layers.param(rngs, INIT_STDDEV, (cfg.seq_len, cfg.d_model), (None, 'embed'))
    for i in range(cfg.num_layers):
      setattr(self, f'block_{i}', Block(cfg, dtype, rngs))
    self.final_norm = RMSNorm(cfg.d_model, dtype)
    if not cfg.tie_embeddings:
      self.lm_head = layers.param(rngs, INIT_STDDEV, (cfg.d_model, cfg.vocab_size), ('embed', 'vocab'))

  def hidden(self, tokens: jax.Array) -> jax.Array:
    """The final-normed residual stream [B, T, d] in the compute dtype."""
    t = tokens.shape[1]
    if t > self.seq_len:
      raise ValueError(f'tokens have length {t} > model.seq_len {self.seq_len}')
    x = jnp.take(self.token_embed[...], tokens, axis=0)
    if hasattr(self, 'pos_embed'):
      x = x + self.pos_embed[...][:t]
    x = constrain(x.astype(self.dtype), _STREAM_AXES)
    segments = document_segments(tokens, self.document_eod_id) if self.document_eod_id >= 0 else None
    graphdef, _ = nnx.split(self.block_0)
    states = [nnx.split(getattr(self, f'block_{i}'))[1] for i in range(self.num_layers)]
    block = _apply_block
    if self.remat != 'none':
      block = jax.checkpoint(_apply_block, policy=REMAT_POLICIES[self.remat], static_argnums=(0,))
    if self.scan_layers:
      stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
      x, _ = jax.lax.scan(lambda carry, state: (block(graphdef, state, carry, segments), None), x, stacked)
    else:
      for state in states:
        x = block(graphdef, state, x, segments)
    return self.final_norm(x)

  def head_kernel(self) -> jax.Array:
    """[d, vocab] output projection: lm_head, or the token embedding transposed when tied."""
    return self.lm_head[...] if hasattr(self, 'lm_head') else self.token_embed[...].T

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.einsum('btd,dv->btv', self.hidden(tokens),
                      self.head_kernel().astype(self.dtype), preferred_element_type=jnp.float32)


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
    """Mean next-token cross-entropy in nats for an int32 batch [B, T+1].

    With loss_chunk = c > 0 the sequence is cut into chunks of c tokens and each chunk's
    logits are computed, reduced and (in the backward pass) recomputed on their own, so a
    large vocabulary never holds [B, T, V] float32 logits at once.
    """
    if not self.loss_chunk:
      logits = self.logits(params, batch[:, :-1])
      log_probs = jax.nn.log_softmax(logits, axis=-1)
      target_log_probs = jnp.take_along_axis(log_probs, batch[:, 1:, None], axis=-1)
      return -jnp.mean(target_log_probs)
    module = self.module(params)
    hidden, targets = module.hidden(batch[:, :-1]), batch[:, 1:]
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
    return total / (b * t)

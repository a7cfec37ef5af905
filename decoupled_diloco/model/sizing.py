"""Model options, their validation and the model's size: what can be known before anything is built.

Params count (V=vocab_size, T=seq_len, d=d_model, L=num_layers, f=d_ff, h=d/num_heads, K=num_kv_heads):
  N = V*d (token embedding) + [T*d learned positions] + [d*V untied output projection] + d (final norm)
      + L * (2*d*d (q, out) + 2*d*K*h (k, v) + (2 or 3 for SwiGLU)*d*f (MLP) + 2*d (two norms)).
An MoE block's MLP term is its router d*E plus (E + shared) experts of (2 or 3)*d*f_e; a token runs
through k of them, so its active params (and FLOPs) count k + shared experts (moe.mlp_params).
"""

import dataclasses
import math
from typing import Any

import jax
import ml_collections

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model import attention, layers, moe as moe_lib
from decoupled_diloco.model.transformer import DTYPES, REMAT_POLICIES

_CHOICES = dict(position=attention.POSITIONS, mlp=layers.MLP_KINDS, remat=tuple(REMAT_POLICIES),
                attention=attention.IMPLEMENTATIONS, dtype=tuple(DTYPES))
_SHAPE = ('vocab_size', 'seq_len', 'd_model', 'num_layers', 'num_heads', 'd_ff')


def _refuse(message: str) -> None:
  raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.model`, validated: impossible shapes and unknown options are refused before anything is traced.

  The shape fields are required; the options default to the GPT-2-style model (older configs
  and tests leave them out). Every field is described in configs/default.py.
  """
  vocab_size: int
  seq_len: int
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int
  dtype: str = 'float32'
  position: str = 'learned'
  rope_theta: float = 10_000.0
  mlp: str = 'gelu'
  num_kv_heads: int = 0
  tie_embeddings: bool = False
  attention: str = 'xla'
  remat: str = 'none'
  scan_layers: bool = False
  loss_chunk: int = 0
  document_eod_id: int = -1
  moe: Any = moe_lib.Settings()  # config.model.moe (a ConfigDict) becomes moe.Settings here.

  def __post_init__(self):
    object.__setattr__(self, 'moe', moe_lib.Settings.from_config(self.moe))
    for name in _SHAPE:
      value = getattr(self, name)
      if not settings_lib.is_int(value) or value <= 0:
        _refuse(f'model.{name} is {value!r}: set --config.model.{name} to a positive int')
    if self.d_model % self.num_heads:
      _refuse(f'model.d_model {self.d_model} is not divisible by model.num_heads {self.num_heads}: '
              'pick num_heads that divides d_model')
    for name, choices in _CHOICES.items():
      if getattr(self, name) not in choices:
        _refuse(f'model.{name} is {getattr(self, name)!r}: set --config.model.{name} to one of {list(choices)}')
    kv = self.num_kv_heads
    if not isinstance(kv, int) or kv < 0 or (kv and self.num_heads % kv):
      _refuse(f'model.num_kv_heads is {kv!r}: use 0 (= num_heads) or a divisor of num_heads {self.num_heads}')
    self._check_options()
    moe_lib.check_model(self.moe, self.num_layers, self.scan_layers)

  def _check_options(self) -> None:
    """Options that only some shapes or backends support."""
    head_dim = self.d_model // self.num_heads
    if self.position == 'rope' and head_dim % 2:
      _refuse(f'model.position=rope needs an even head dim, got d_model/num_heads = {head_dim}')
    if self.position == 'rope' and not self.rope_theta > 0:
      _refuse(f'model.rope_theta is {self.rope_theta!r}: set it > 0 (10000 is standard)')
    if self.loss_chunk < 0 or (self.loss_chunk and self.seq_len % self.loss_chunk):
      _refuse(f'model.loss_chunk is {self.loss_chunk}: use 0 (no chunking) or a divisor of seq_len {self.seq_len}')
    if not -1 <= self.document_eod_id < self.vocab_size:
      _refuse(f'model.document_eod_id is {self.document_eod_id}: it is set from data.mask_document_boundaries, '
              'leave it at -1')
    if self.attention.startswith('splash') and self.seq_len % 128:
      _refuse(f'model.attention=splash needs seq_len a multiple of 128 (its block), got {self.seq_len}: '
              "use --config.model.attention=xla or 'dot_product'")
    # Only an offload config asks the backend: validating must not start JAX's backend (a sweep
    # sets the number of virtual CPU devices after validating its points).
    if self.remat == 'offload' and 'pinned_host' not in {m.kind for m in jax.devices()[0].addressable_memories()}:
      _refuse(f'model.remat=offload needs pinned host memory, which {jax.default_backend()} lacks: '
              "use --config.model.remat=minimal or 'full'")

  @classmethod
  def from_config(cls, model_cfg: Any) -> 'Settings':
    """The model group of a config (or a Settings already); unknown fields are refused by name."""
    return settings_lib.from_config(cls, model_cfg, 'model')


def with_defaults(model_cfg: Any) -> ml_collections.ConfigDict:
  """model_cfg validated, with every option it leaves out at its default: the ConfigDict the Transformer reads."""
  return ml_collections.ConfigDict(dataclasses.asdict(Settings.from_config(model_cfg)))


def count_params(params_or_shapes: Any) -> int:
  """Total number of scalars in a params (or ShapeDtypeStruct) tree, for sizing and logging."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params_or_shapes))


def flops_per_token(model_cfg: Any) -> float:
  """Training FLOPs per token (forward + backward) for hardware step-time models and MFU.

  FLOPs = 6 * N_matmul + 12 * L * d * T, where N_matmul is every param except the token and
  position embeddings (lookups, not matmuls) plus the output projection d*V (a matmul whether
  tied to the embedding or not), and 12*L*d*T counts the QK^T and attention-times-V matmuls
  (2 * 2*d*T forward per layer, times 3 for forward+backward; full T x T, ignoring the causal
  mask savings, the convention of PaLM's and MaxText's MFU).
  """
  cfg = with_defaults(model_cfg)
  v, t, d = cfg.vocab_size, cfg.seq_len, cfg.d_model
  l = cfg.num_layers
  kv_width = (cfg.num_kv_heads or cfg.num_heads) * (d // cfg.num_heads)
  n_matmul = d * v + d + l * (2 * d * d + 2 * d * kv_width + 2 * d) + _mlp_params(cfg, active=True)
  return float(6 * n_matmul + 12 * l * d * t)


def idle_expert_params(model_cfg: Any) -> int:
  """Params of the experts a token does not run through (0 for a dense model): total minus active params."""
  cfg = with_defaults(model_cfg)
  return _mlp_params(cfg, active=False) - _mlp_params(cfg, active=True)


def _mlp_params(cfg: ml_collections.ConfigDict, active: bool) -> int:
  """Every block's feed-forward params (`active`: those a token runs through)."""
  settings = moe_lib.Settings.from_config(cfg.moe)
  matrices = 3 if cfg.mlp == 'swiglu' else 2
  return sum(moe_lib.mlp_params(settings, i, cfg.d_model, cfg.d_ff, matrices, active) for i in range(cfg.num_layers))

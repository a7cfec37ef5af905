"""Pseudo-gradient compression: what a learner puts on the wire, byte for byte.

Each format turns a float tensor into a payload dict whose arrays are exactly the bytes
sent, so `Compressed.nbytes` is the wire size and `wire_bytes` reproduces it from the shapes
alone (why: the cost models price 12B-parameter pushes without allocating them). Formats
(fp32, bf16, blockwise int8/int4/int2, fp4 E3M0, top-k) and their layouts: docs/streaming.md.
Error feedback (Karimireddy et al. 2019) keeps what a lossy format lost, e = β e + Δ, and
sends it later; each learner keeps its own residual per fragment (docs/exchange.md, "Error feedback").
"""

import dataclasses
import fractions
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.errors import ConfigError

FORMATS = ("fp32", "bf16", "int8", "int4", "fp4", "int2", "topk")
LOSSLESS = ("fp32", "bf16")  # Nothing (bf16: rounding at 2^-8 relative) for error feedback to keep.
DOWNLINK_FORMATS = ("fp32", "bf16")  # Θ_p sent back to learners; the syncer keeps fp32.
_LEVELS = {"int8": 127, "int4": 7, "int2": 1}  # q in [-L, L]; codes are q + L.
_PACKED_BITS = {"int4": 4, "fp4": 4, "int2": 2}
_FP4_POWERS = 7  # fp4 magnitudes 2^0 .. 2^-6.


@dataclasses.dataclass(frozen=True)
class Codec:
  """How pseudo-gradients are compressed; hashable, so kernels can take it as static."""
  format: str = "fp32"
  block_size: int = 64
  topk_fraction: float = 0.01
  error_feedback: bool = False
  error_feedback_beta: float = 1.0

  def __post_init__(self):
    if self.format not in FORMATS:
      raise ConfigError(f"compression.format={self.format!r} is unknown: set --config.compression.format "
                        f"to one of {FORMATS}")
    if (not settings_lib.is_int(self.block_size) or self.block_size < 2 or self.block_size % 2):
      raise ConfigError(f"compression.block_size={self.block_size!r} must be an even int >= 2 (two 4-bit codes "
                        f"share a byte): set --config.compression.block_size, e.g. 64")
    if not 0 < self.topk_fraction <= 1:
      raise ConfigError(f"compression.topk_fraction={self.topk_fraction} must be in (0, 1]: "
                        f"set --config.compression.topk_fraction, e.g. 0.01")
    if not 0 < self.error_feedback_beta <= 1:
      raise ConfigError(f"compression.error_feedback_beta={self.error_feedback_beta} must be in (0, 1]: "
                        f"set --config.compression.error_feedback_beta, e.g. 1.0")
    if self.error_feedback and self.format in LOSSLESS:
      raise ConfigError(f"compression.error_feedback=True has nothing to feed back with format {self.format!r} "
                        f"(lossless, or about so): set --config.compression.error_feedback=False or a lossy format "
                        f"({', '.join(f for f in FORMATS if f not in LOSSLESS)})")
    if not self.error_feedback and self.error_feedback_beta != 1.0:
      raise ConfigError(f"compression.error_feedback_beta={self.error_feedback_beta} applies with error feedback "
                        "only: set --config.compression.error_feedback=True or leave the beta at 1.0")

  @classmethod
  def from_config(cls, cfg) -> "Codec":
    """The uplink codec of `config.compression`, checked (with its downlink_format) before any training starts."""
    if isinstance(cfg, cls):
      return cfg
    codec = settings_lib.from_config(cls, cfg, "compression", extra_keys=("downlink_format",))
    downlink = cfg.get("downlink_format", "fp32")
    if downlink not in DOWNLINK_FORMATS:
      raise ConfigError(f"compression.downlink_format={downlink!r} is unknown: use one of {DOWNLINK_FORMATS} "
                        "(Θ itself is never quantized harder)")
    return dataclasses.replace(codec, error_feedback=bool(codec.error_feedback))


class Compressed(NamedTuple):
  """One push's payload: the format, each tensor's shape, and each tensor's wire arrays.

  A pytree whose leaves are only the payload arrays (format and shapes are static), so
  `jax.device_put` and `jax.tree.map` move or inspect it like any other delta.
  """
  format: str
  shapes: tuple[tuple[int, ...], ...]
  leaves: tuple[dict[str, jax.Array], ...]

  @property
  def nbytes(self) -> int:
    """Exact bytes on the wire: the payload arrays and nothing else."""
    return sum(int(array.nbytes) for payload in self.leaves for array in payload.values())


jax.tree_util.register_pytree_node(Compressed, lambda c: (c.leaves, (c.format, c.shapes)),
                                   lambda static, leaves: Compressed(static[0], static[1], tuple(leaves)))


def topk_count(fraction: float, size: int) -> int:
  """k = ceil(fraction * n) in exact arithmetic: 0.07 * 100 is 7, not 7.000000000000001 -> 8."""
  return min(size, math.ceil(fractions.Fraction(repr(float(fraction))) * size))


def _payload_spec(codec: Codec, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """Key -> (shape, dtype) of every array a tensor of `shape` sends: the wire format itself."""
  size = math.prod(shape)
  if codec.format in ("fp32", "bf16"):
    return {"values": (tuple(shape), np.dtype(jnp.float32 if codec.format == "fp32" else jnp.bfloat16))}
  if codec.format == "topk":
    k = topk_count(codec.topk_fraction, size)
    return {"indices": ((k,), np.dtype(np.int32)), "values": ((k,), np.dtype(np.float32))}
  blocks = -(-size // codec.block_size)
  scales = ((blocks,), np.dtype(np.float32))
  if codec.format == "int8":
    return {"codes": ((blocks * codec.block_size,), np.dtype(np.int8)), "scales": scales}
  per_byte = 8 // _PACKED_BITS[codec.format]
  return {"codes": ((blocks * -(-codec.block_size // per_byte),), np.dtype(np.uint8)), "scales": scales}


def wire_bytes(codec: Codec, shapes) -> int:
  """Bytes `encode` would send for tensors of these shapes; arithmetic only, so 12B params are free."""
  return sum(
      math.prod(shape) * dtype.itemsize for shape_ in shapes
      for shape, dtype in _payload_spec(codec, tuple(shape_)).values())


def _blocks(x, block_size):
  """The flattened tensor as float32 [B, block_size], the tail block zero-padded."""
  flat = x.reshape(-1).astype(jnp.float32)
  blocks = -(-flat.size // block_size)
  return jnp.pad(flat, (0, blocks * block_size - flat.size)).reshape(blocks, block_size)


@functools.partial(jax.jit, static_argnames=("block_size",))
def _block_absmax(x, block_size):
  """Per-block absmax, as a tree of maxima of contiguous half-blocks.

  Its own jit on purpose: on CPU this runs at copy speed where a row `reduce` is ~3x
  slower, and inside the quantizer's jit XLA fuses the tree into the per-value loop
  and recomputes part of it for every value.
  """
  values = jnp.abs(_blocks(x, block_size))
  while values.shape[1] > 1:
    half = (values.shape[1] + 1) // 2  # Odd widths overlap by one column: max is idempotent.
    values = jnp.maximum(values[:, :half], values[:, values.shape[1] - half:])
  return values[:, 0]


def _rounded_bits(y, offset):
  """Bits of round-half-even(y) + offset in the low bits, for |y + offset| < 2^22.

  Adding 1.5 * 2^23 leaves the rounded integer in the float's mantissa: one add and a
  bitcast instead of round + float-to-int convert, which XLA CPU does not vectorize well.
  """
  return jax.lax.bitcast_convert_type(y + np.float32(1.5 * 2**23 + offset), jnp.uint32)


def _fp4_codes(blocks, inverse):
  """Sign bit 8 and c = k + 1 for |x|/scale ~ 2^-k (k = 0..6) rounded in the log domain, else 0.

  m = 2^e * 1.f rounds up to 2^(e+1) iff 1.f >= sqrt(2), i.e. mantissa bits >= 3474676:
  adding 2^23 - 3474676 to m's bits carries into the exponent exactly then. Integer ops only.
  """
  magnitude = jax.lax.bitcast_convert_type(jnp.abs(blocks) * inverse, jnp.uint32)
  exponent = jnp.minimum((magnitude + np.uint32(2**23 - 3474676)) >> 23, 127)  # Biased: 127 is 2^0.
  power = jnp.where(exponent > 127 - _FP4_POWERS, 128 - exponent, 0)
  sign = (jax.lax.bitcast_convert_type(blocks, jnp.uint32) >> 28) & 8
  return power | sign


def _pack(blocks, code, bits):
  """code(values) of each block into bytes: 8/bits adjacent codes per byte, the first in the low bits.

  Blocks are padded to a multiple of 8/bits values, so every block owns whole bytes. The
  values are split into their byte slots *before* coding and the codes combined with
  shifts and ORs: one fused loop, no gathers (slicing the codes after coding is 2-5x
  slower on XLA CPU).
  """
  per_byte = 8 // bits
  slots = jnp.pad(blocks, ((0, 0), (0, -blocks.shape[1] % per_byte)))
  slots = slots.reshape(blocks.shape[0], slots.shape[1] // per_byte, per_byte)
  codes = [code(slots[..., i]) << (i * bits) for i in range(per_byte)]
  return functools.reduce(jnp.bitwise_or, codes).astype(jnp.uint8).reshape(-1)


def _unpack(packed, bits, block_size):
  """Inverse of `_pack`: codes as int32 [B, block_size]."""
  block_bytes = -(-block_size * bits // 8)
  shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)
  codes = (packed.reshape(-1, block_bytes)[..., None] >> shifts) & jnp.uint8(2**bits - 1)
  return codes.reshape(codes.shape[0], block_bytes * shifts.size)[:, :block_size].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("fmt", "block_size"))
def _quantize(x, scales, fmt, block_size):
  """int8/int4/int2/fp4 codes of one tensor given its block scales (0 scale: all zeros)."""
  blocks = _blocks(x, block_size)
  inverse = jnp.where(scales > 0, 1 / jnp.where(scales > 0, scales, 1), 0)[:, None]
  if fmt == "fp4":
    return _pack(blocks, lambda values: _fp4_codes(values, inverse), 4)
  levels = _LEVELS[fmt]
  if fmt == "int8":  # The low byte of q's two's complement is q as int8.
    return _rounded_bits(blocks * (inverse * levels), 0).astype(jnp.uint8).reshape(-1).view(jnp.int8)
  bits = _PACKED_BITS[fmt]
  return _pack(blocks, lambda values: _rounded_bits(values * (inverse * levels), levels) & np.uint32(2**bits - 1), bits)


def _encode_blockwise(x, fmt, block_size):
  scales = _block_absmax(x, block_size)
  return {"codes": _quantize(x, scales, fmt, block_size), "scales": scales}


@functools.partial(jax.jit, static_argnames=("fmt", "block_size", "shape"))
def _decode_blockwise(payload, fmt, block_size, shape):
  """float32 tensor of `shape` from blockwise codes and scales."""
  scales = payload["scales"][:, None]
  if fmt == "fp4":
    codes = _unpack(payload["codes"], 4, block_size)
    power = codes & 7  # 2^(1 - c) built from its exponent bits: exact, no transcendental.
    magnitude = jax.lax.bitcast_convert_type((128 - power) << 23, jnp.float32)
    values = jnp.where(power == 0, 0.0, jnp.where(codes >= 8, -magnitude, magnitude)) * scales
  else:
    levels = _LEVELS[fmt]
    if fmt == "int8":
      q = payload["codes"].reshape(-1, block_size).astype(jnp.int32)
    else:
      q = _unpack(payload["codes"], _PACKED_BITS[fmt], block_size) - levels
    values = q.astype(jnp.float32) * (scales / levels)
  return values.reshape(-1)[:math.prod(shape)].reshape(shape)


@functools.partial(jax.jit, static_argnames=("k",))
def _encode_topk(x, k):
  """The k largest-magnitude entries of the flattened tensor and their flat indices."""
  flat = x.reshape(-1).astype(jnp.float32)
  _, indices = jax.lax.top_k(jnp.abs(flat), k)
  return {"indices": indices.astype(jnp.int32), "values": flat[indices]}


@functools.partial(jax.jit, static_argnames=("shape",))
def _decode_topk(payload, shape):
  """Zeros except the sent entries (indices already checked to be in range)."""
  flat = jnp.zeros(math.prod(shape), jnp.float32).at[payload["indices"]].set(payload["values"], mode="drop")
  return flat.reshape(shape)


_to_float32 = jax.jit(lambda x: x.astype(jnp.float32))
_to_bfloat16 = jax.jit(lambda x: x.astype(jnp.bfloat16))
_index_range = jax.jit(lambda indices: (jnp.min(indices), jnp.max(indices)))


def _encode_leaf(codec: Codec, x) -> dict[str, jax.Array]:
  if codec.format == "fp32":
    return {"values": _to_float32(x)}
  if codec.format == "bf16":
    return {"values": _to_bfloat16(x)}
  if codec.format == "topk":
    if x.size >= 2**31:
      raise ValueError(f"topk of a tensor of {x.size} values needs int64 indices: split the tensor")
    return _encode_topk(x, topk_count(codec.topk_fraction, x.size))
  return _encode_blockwise(x, codec.format, codec.block_size)


def encode(codec: Codec, leaves) -> Compressed:
  """Compresses each tensor of a push; the payload is exactly what goes on the wire."""
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  return Compressed(codec.format, tuple(tuple(int(d) for d in leaf.shape) for leaf in leaves),
                    tuple(_encode_leaf(codec, leaf) for leaf in leaves))


def _check_payload(codec: Codec, index: int, shape, payload) -> None:
  """ValueError unless `payload` is exactly what `encode` makes for a tensor of `shape`."""
  if not isinstance(payload, dict):
    raise ValueError(f"compressed leaf {index} is a {type(payload).__name__}, not a dict of arrays")
  spec = _payload_spec(codec, shape)
  if set(payload) != set(spec):
    raise ValueError(f"compressed leaf {index} has keys {sorted(payload)}, {codec.format} sends {sorted(spec)}")
  for key, (want_shape, want_dtype) in spec.items():
    array = payload[key]
    if not isinstance(array, (np.ndarray, jax.Array)):
      raise ValueError(f"compressed leaf {index} {key!r} is a {type(array).__name__}, not an array")
    if tuple(array.shape) != want_shape or np.dtype(array.dtype) != want_dtype:
      raise ValueError(f"compressed leaf {index} {key!r} is {array.dtype}{list(array.shape)}, "
                       f"{codec.format} of shape {shape} sends {want_dtype}{list(want_shape)}")
  if codec.format == "topk" and payload["indices"].size:
    low, high = (int(bound) for bound in _index_range(payload["indices"]))
    if low < 0 or high >= math.prod(shape):
      raise ValueError(f"compressed leaf {index} has top-k indices in [{low}, {high}], "
                       f"outside a tensor of {math.prod(shape)} values")


def _valid_shapes(shapes) -> bool:
  return isinstance(shapes, tuple) and all(
      isinstance(shape, tuple) and all(settings_lib.is_int(d) and d >= 0 for d in shape) for shape in shapes)


def check(codec: Codec, compressed: Compressed) -> None:
  """Raises ValueError (never a crash) unless `compressed` is a well-formed payload of `codec`.

  The syncer turns the ValueError into a rejected push, so a garbage payload from a
  faulty learner can never corrupt or kill the global parameters.
  """
  if not isinstance(compressed, Compressed):
    raise ValueError(f"expected a Compressed payload, got a {type(compressed).__name__}")
  if compressed.format != codec.format:
    raise ValueError(f"payload is {compressed.format!r} but the codec expects {codec.format!r}")
  if not _valid_shapes(compressed.shapes):
    raise ValueError(f"payload shapes {compressed.shapes!r} are not tuples of non-negative ints")
  if not isinstance(compressed.leaves, (tuple, list)) or len(compressed.leaves) != len(compressed.shapes):
    count = len(compressed.leaves) if isinstance(compressed.leaves, (tuple, list)) else "no"
    raise ValueError(f"payload has {count} leaves for {len(compressed.shapes)} shapes")
  for index, (shape, payload) in enumerate(zip(compressed.shapes, compressed.leaves)):
    _check_payload(codec, index, shape, payload)


def decode(codec: Codec, compressed: Compressed) -> list[jax.Array]:
  """float32 tensors back from a payload; ValueError (see `check`) if it is malformed."""
  check(codec, compressed)
  return [decode_leaf(codec, shape, payload) for shape, payload in zip(compressed.shapes, compressed.leaves)]


def decode_leaf(codec: Codec, shape, payload) -> jax.Array:
  """One float32 tensor of a payload that `check` accepted.

  Why one at a time: the syncer folds each decoded tensor into its running sums at once, so
  a push never exists decoded whole.
  """
  if codec.format in ("fp32", "bf16"):
    return _to_float32(payload["values"])
  if codec.format == "topk":
    return _decode_topk(payload, tuple(shape))
  return _decode_blockwise(payload, codec.format, codec.block_size, tuple(shape))


_accumulate = jax.jit(lambda residual, delta, beta: beta * residual + delta.astype(jnp.float32))
_subtract = jax.jit(lambda a, b: a - b)


def encode_with_feedback(codec: Codec, leaves, residual=None):
  """(payload, new residual): sends e = β residual + Δ and keeps e − decode(payload) for later.

  Without error feedback this is `encode(Δ)` and the residual stays None. With it nothing
  is lost for β = 1: what was sent over the rounds plus the residual sums to the Δs.
  """
  if not codec.error_feedback:
    return encode(codec, leaves), None
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  if residual is None:
    errors = [_to_float32(leaf) for leaf in leaves]
  else:
    if len(residual) != len(leaves) or any(r.shape != d.shape for r, d in zip(residual, leaves)):
      raise ValueError(f"residual shapes {[r.shape for r in residual]} do not match the delta's "
                       f"{[d.shape for d in leaves]}")
    errors = [_accumulate(r, d, codec.error_feedback_beta) for r, d in zip(residual, leaves)]
  sent = encode(codec, errors)
  return sent, [_subtract(e, d) for e, d in zip(errors, decode(codec, sent))]

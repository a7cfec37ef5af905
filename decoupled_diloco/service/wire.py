"""The syncer service's wire format: msgpack headers and self-describing array payloads.

No protoc: every gRPC method carries plain bytes, so the format is defined here (layout:
docs/exchange.md). Why so strict: headers are checked against a schema (exact keys and
types) before anything reads them, and a payload's arrays must follow each other at the
next 64-byte boundary with zero padding, so a payload cannot alias or hide bytes; 64, so
that every decoded array is aligned as XLA's CPU client needs to take it without a copy.
Any violation raises WireError (a ValueError) with a message naming it.
"""

import math
import struct
from collections.abc import Callable, Iterable, Iterator

import ml_dtypes
import msgpack
import numpy as np

from decoupled_diloco import compression
from decoupled_diloco.settings import is_int

MAX_HEADER_BYTES = 64 << 10
MAX_SKELETON_BYTES = 16 << 20
MAX_DEPTH = 32
ALIGNMENT = 64
_ARRAY_EXT = 1
_PREFIX = struct.Struct("<I")
# Every dtype a params tree or a compression payload uses; nothing else is decoded.
DTYPES = {
    name: np.dtype(getattr(ml_dtypes, name, name))
    for name in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "float16", "float32",
                 "float64", "bfloat16")}


class WireError(ValueError):
  """A malformed, oversized or truncated message; nothing derived from it was applied."""


class PayloadTooLarge(WireError):
  """A payload or chunk over the configured limits."""


def pack_header(fields: dict) -> bytes:
  """A header map as bytes (the first message of every call and reply)."""
  return msgpack.packb(fields, use_bin_type=True)


def parse_header(data: bytes, schema: dict[str, type]) -> dict:
  """The header in `data`, checked key by key against `schema` (float fields accept ints).

  Why strict: every field steers the syncer's state machine, so an unknown, missing or
  mistyped field is rejected here rather than deep inside a merge.
  """
  if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_HEADER_BYTES:
    raise WireError(f"header must be at most {MAX_HEADER_BYTES} bytes of msgpack")
  try:
    fields = msgpack.unpackb(data, raw=False, max_bin_len=0, max_ext_len=0, max_array_len=64, max_map_len=64)
  except Exception as error:  # msgpack raises several unrelated types for bad input.
    raise WireError(f"header is not msgpack ({type(error).__name__}: {error})") from error
  if not isinstance(fields, dict) or set(fields) != set(schema):
    got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
    raise WireError(f"header fields are {got}, expected {sorted(schema)}")
  for name, kind in schema.items():
    value = fields[name]
    ok = (isinstance(value,
                     (int, float)) and not isinstance(value, bool) if kind is float else isinstance(value, kind) and
          (kind is bool or not isinstance(value, bool)))
    if not ok:
      raise WireError(f"header field {name!r} is {type(value).__name__}, expected {kind.__name__}")
    if kind is float and not np.isfinite(value):
      raise WireError(f"header field {name!r} is {value}, expected a finite number")
  return fields


def _to_skeleton(node, arrays: list, offset: list, depth: int = 0):
  """`node` with arrays swapped for ext references; collects (offset, array) in order, each
  non-empty array at the next multiple of ALIGNMENT (`offset[0]`: where the last one ended)."""
  if depth > MAX_DEPTH:
    raise WireError(f"payload nests deeper than {MAX_DEPTH} levels")
  if isinstance(node, dict):
    if not all(isinstance(k, str) for k in node):
      raise WireError("payload maps must have str keys")
    return {k: _to_skeleton(v, arrays, offset, depth + 1) for k, v in node.items()}
  if isinstance(node, (list, tuple)):
    return [_to_skeleton(v, arrays, offset, depth + 1) for v in node]
  if node is None or isinstance(node, (bool, int, float, str)):
    return node
  array = np.ascontiguousarray(node)  # jax.Array on the host and numpy alike; no copy if contiguous.
  if array.dtype.name not in DTYPES:
    raise WireError(f"dtype {array.dtype} cannot go on the wire; allowed: {sorted(DTYPES)}")
  start = _aligned(offset[0]) if array.nbytes else offset[0]
  arrays.append((start, array))
  offset[0] = start + array.nbytes
  return msgpack.ExtType(_ARRAY_EXT, msgpack.packb([array.dtype.name, list(array.shape), start]))


def _aligned(offset: int) -> int:
  """The first multiple of ALIGNMENT at or after `offset`."""
  return -(-offset // ALIGNMENT) * ALIGNMENT


def encode(payload) -> list[memoryview]:
  """`payload` (pytree of arrays, or Compressed) as byte parts, without copying arrays.

  Why parts: a 100 MB push is chunked straight from the arrays' memory; only the
  chunker copies, once.
  """
  arrays, offset = [], [0]
  if isinstance(payload, compression.Compressed):
    value = [payload.format, [list(s) for s in payload.shapes], list(payload.leaves)]
    skeleton = {"kind": "compressed", "value": _to_skeleton(value, arrays, offset)}
  else:
    skeleton = {"kind": "tree", "value": _to_skeleton(payload, arrays, offset)}
  skeleton_bytes = msgpack.packb(skeleton, use_bin_type=True)
  head = _PREFIX.pack(len(skeleton_bytes)) + skeleton_bytes
  parts, end = [memoryview(head.ljust(_aligned(len(head)), b"\0"))], 0
  for start, array in arrays:
    if start > end:  # Zero padding up to the offset the skeleton gave this array.
      parts.append(memoryview(bytes(start - end)))
    if array.nbytes:  # As bytes: the buffer protocol knows no ml_dtypes type (bfloat16), a uint8 view does.
      parts.append(memoryview(array.reshape(-1).view(np.uint8)))
    end = start + array.nbytes
  return parts


def encoded_size(parts: list[memoryview]) -> int:
  """Bytes `encode` produced: what `payload_bytes` announces."""
  return sum(p.nbytes for p in parts)


def chunks(parts: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes]:
  """The parts re-cut into messages of exactly `chunk_bytes` (the last may be shorter).

  Each message is built with one copy (a join of memoryview slices), whatever the part
  boundaries.
  """
  pending, filled = [], 0
  for part in parts:
    start = 0
    while start < part.nbytes:
      take = min(chunk_bytes - filled, part.nbytes - start)
      pending.append(part[start:start + take])
      filled, start = filled + take, start + take
      if filled == chunk_bytes:
        yield b"".join(pending)
        pending, filled = [], 0
  if filled:
    yield b"".join(pending)


def check_payload_size(payload_bytes: int, max_payload_bytes: int) -> None:
  """PayloadTooLarge unless a header's announced size is within the limit (before any byte is read)."""
  if not 0 <= payload_bytes <= max_payload_bytes:
    raise PayloadTooLarge(f"payload of {payload_bytes} bytes is outside the limit [0, {max_payload_bytes}] bytes")


def assemble(messages: Iterator[bytes], payload_bytes: int, max_payload_bytes: int, chunk_bytes: int) -> np.ndarray:
  """Reads exactly `payload_bytes` from the chunk messages into one 64-byte-aligned uint8
  buffer (one copy); WireError on any mismatch, checked as messages arrive."""
  check_payload_size(payload_bytes, max_payload_bytes)
  buffer = aligned_buffer(payload_bytes)
  reader(messages, payload_bytes, chunk_bytes)(memoryview(buffer))
  return buffer


def reader(messages: Iterator[bytes], payload_bytes: int, chunk_bytes: int) -> Callable[[memoryview], None]:
  """`read(view)`, which fills `view` with the next bytes of a payload streamed as chunk messages, so that a
  receiver can take it a piece at a time (a `wal.Spool`: never whole in memory) or whole (`assemble`).

  WireError as soon as the stream breaks its header's word: a message over `chunk_bytes`, an end before
  `payload_bytes`, or bytes after them (checked when the last view is filled).
  """
  rest, received = memoryview(b""), 0

  def read(view: memoryview) -> None:
    nonlocal rest, received
    filled = 0
    while filled < view.nbytes:
      if not rest:
        message = next(messages, None)
        if message is None:
          raise WireError(f"stream ended after {received + filled} of the announced {payload_bytes} payload bytes")
        if len(message) > chunk_bytes:
          raise PayloadTooLarge(f"chunk of {len(message)} bytes exceeds chunk_bytes={chunk_bytes}")
        rest = memoryview(message)
      step = min(rest.nbytes, view.nbytes - filled)
      view[filled:filled + step] = rest[:step]
      rest, filled = rest[step:], filled + step
    received += filled
    if received == payload_bytes and (rest or next(messages, None) is not None):
      raise WireError(f"stream carries more than the announced {payload_bytes} payload bytes")

  return read


def aligned_buffer(nbytes: int) -> np.ndarray:
  """An uninitialised uint8 buffer whose first byte sits at a multiple of ALIGNMENT."""
  raw = np.empty(nbytes + ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % ALIGNMENT
  return raw[start:start + nbytes]


def decode(data) -> object:
  """The payload in `data` (bytes-like): arrays are read-only views, nothing is copied."""
  view = memoryview(data)
  if view.nbytes < _PREFIX.size:
    raise WireError("payload is shorter than its length prefix")
  (length,) = _PREFIX.unpack_from(view)
  if length > min(MAX_SKELETON_BYTES, view.nbytes - _PREFIX.size):
    raise WireError(f"payload skeleton length {length} exceeds the payload or {MAX_SKELETON_BYTES} bytes")
  body_start = _aligned(_PREFIX.size + length)
  if body_start > view.nbytes or any(view[_PREFIX.size + length:body_start]):
    raise WireError("payload skeleton must be followed by zero padding to a multiple of 64 bytes")
  body = view[body_start:]
  refs = []

  def ext_hook(code, ext_data):
    if code != _ARRAY_EXT:
      raise WireError(f"unknown msgpack ext type {code} in payload")
    refs.append(msgpack.unpackb(ext_data, raw=False, max_array_len=MAX_DEPTH, max_map_len=0))
    return _ArrayRef(len(refs) - 1)

  try:
    skeleton = msgpack.unpackb(view[_PREFIX.size:_PREFIX.size + length], raw=False, ext_hook=ext_hook,
                               strict_map_key=True)
  except WireError:
    raise
  except Exception as error:
    raise WireError(f"payload skeleton is not msgpack ({type(error).__name__}: {error})") from error
  arrays, end = [], 0
  for ref in refs:
    arrays.append(_array(ref, body, end))
    end = ref[2] + arrays[-1].nbytes
  if end != body.nbytes:
    raise WireError(f"payload carries {body.nbytes} array bytes but its arrays describe {end}")
  if not isinstance(skeleton, dict) or set(skeleton) != {"kind", "value"}:
    raise WireError("payload skeleton must be a map with 'kind' and 'value'")
  value = _resolve(skeleton["value"], arrays, 0)
  if skeleton["kind"] == "tree":
    return value
  if skeleton["kind"] == "compressed":
    return _compressed(value)
  raise WireError(f"payload kind {skeleton['kind']!r} is unknown: expected 'tree' or 'compressed'")


class _ArrayRef(int):
  """Placeholder for the i-th array while the skeleton is unpacked."""


def _array(ref, body: memoryview, previous_end: int) -> np.ndarray:
  """One array reference checked against the bytes it claims (dtype, shape, position: the
  next multiple of 64 after the previous array, zeros in between; empty arrays take no room)."""
  if not (isinstance(ref, list) and len(ref) == 3 and isinstance(ref[0], str) and isinstance(ref[1], list) and
          isinstance(ref[2], int)):
    raise WireError("array reference must be [dtype, shape, offset]")
  name, shape, offset = ref
  if name not in DTYPES:
    raise WireError(f"array dtype {name!r} is not allowed; allowed: {sorted(DTYPES)}")
  if not all(is_int(d) and d >= 0 for d in shape):
    raise WireError(f"array shape {shape} must be non-negative ints")
  dtype = DTYPES[name]
  count = math.prod(shape)  # Python ints: a product that overflows int64 is just too large, never negative.
  nbytes = count * dtype.itemsize
  if nbytes > body.nbytes:
    raise WireError(f"array {name}{shape} needs {nbytes} bytes; the payload has {body.nbytes}")
  expected_offset = _aligned(previous_end) if nbytes else previous_end
  if offset != expected_offset:
    raise WireError(f"array at offset {offset} does not follow the previous one (expected {expected_offset})")
  if any(body[previous_end:offset]):
    raise WireError(f"payload has non-zero bytes between its arrays at offset {previous_end}")
  if offset + nbytes > body.nbytes:
    raise WireError(f"array {name}{shape} needs {nbytes} bytes at offset {offset}; the payload has {body.nbytes}")
  array = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
  array.flags.writeable = False
  return array


def _resolve(node, arrays: list, depth: int):
  """The skeleton with references replaced by their arrays (and a depth limit)."""
  if depth > MAX_DEPTH:
    raise WireError(f"payload nests deeper than {MAX_DEPTH} levels")
  if isinstance(node, _ArrayRef):
    return arrays[node]
  if isinstance(node, dict):
    return {k: _resolve(v, arrays, depth + 1) for k, v in node.items()}
  if isinstance(node, list):
    return [_resolve(v, arrays, depth + 1) for v in node]
  return node


def _compressed(value) -> compression.Compressed:
  """[format, shapes, leaves] back into a Compressed, with its static parts checked."""
  if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and isinstance(value[1], list) and
          isinstance(value[2], list) and len(value[1]) == len(value[2])):
    raise WireError("compressed payload must be [format, shapes, leaves] with one shape per leaf")
  fmt, shapes, leaves = value
  if fmt not in compression.FORMATS:
    raise WireError(f"compression format {fmt!r} is unknown; known: {compression.FORMATS}")
  for shape, leaf in zip(shapes, leaves):
    if not (isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape)):
      raise WireError(f"compressed shape {shape} must be a list of non-negative ints")
    if not (isinstance(leaf, dict) and all(isinstance(a, np.ndarray) for a in leaf.values())):
      raise WireError("each compressed leaf must be a map of arrays")
  return compression.Compressed(fmt, tuple(tuple(s) for s in shapes), tuple(leaves))

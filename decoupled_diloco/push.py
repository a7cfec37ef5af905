"""A push, and the checks it passes before the syncer lets it change anything.

A learner's push arrives from another process, maybe another machine, maybe a buggy or
hostile one: everything here runs before any state changes, so a refused push leaves the
syncer exactly as it was (and, in the service, never reaches the write-ahead log).
"""

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from decoupled_diloco import compression


class PushRejected(ValueError):
  """A malformed push; the syncer's state is untouched."""


@dataclasses.dataclass
class Push:
  """What a learner hands the syncer at the end of its local work."""
  learner: int
  delta: Any  # Pseudo-gradient Θ_base − θ of the fragment, or its compression.Compressed.
  base_version: int  # Syncer version the learner started from.
  tokens: int  # Tokens processed since that pull.
  local_steps: int  # Inner steps since that pull.
  compute_seconds: float = 0.0  # Time those steps took (feeds the grace window's step EMA).
  fragment: int = 0  # Which parameter fragment `delta` covers (streaming); 0 when P = 1.
  wire_bytes: int = 0  # Exact bytes of the payload as sent (compressed or not).
  host_views: bool = False  # Set by Syncer.check: its delta is device views of host memory (`release`).
  drop_pages: Any = None  # A payload mapped from disk (service `wal.Spool`): called after each tensor is read.
  delta_norm: float | None = None  # ‖Δ‖ before compression as the learner claims it (records, TensorBoard), or None.
  checked_norm: float | None = None  # ‖Δ‖ as the syncer decoded it (set by Syncer.check; robust merges use it).


def delta_leaves(push: Push, codec: compression.Codec) -> Iterator:
  """The push's float tensors in leaf order, a compressed one decoded one tensor at a time (never whole); a
  payload mapped from disk lets go of each tensor's pages once the next is asked for."""
  if isinstance(push.delta, compression.Compressed):
    leaves = (
        compression.decode_leaf(codec, shape, payload) for shape, payload in zip(push.delta.shapes, push.delta.leaves))
  else:
    leaves = iter(jax.tree.leaves(push.delta))
  return leaves if push.drop_pages is None else _dropping_pages(leaves, push.drop_pages)


def _dropping_pages(leaves: Iterator, drop_pages) -> Iterator:
  for leaf in leaves:
    yield leaf
    drop_pages()  # The caller is done with `leaf` (a fold blocks on each tensor).


def on_device(push: Push, codec: compression.Codec, device: jax.Device) -> Push:
  """The push with its delta on `device`; a compressed one's payload checked and left encoded
  (it is decoded tensor by tensor straight into the accumulator). Raises TypeError/ValueError.

  A delta of numpy arrays (a decoded wire payload) becomes device views of the same memory
  (`host_view`), which `release` deletes.
  """
  delta = push.delta
  payload = delta.leaves if isinstance(delta, compression.Compressed) else delta
  host_views = all(isinstance(x, np.ndarray) for x in jax.tree.leaves(payload))
  payload = jax.tree.map(lambda x: host_view(x, device), payload) if host_views else jax.device_put(payload, device)
  if isinstance(delta, compression.Compressed):
    delta = delta._replace(leaves=payload)
    compression.check(codec, delta)
    return dataclasses.replace(push, delta=delta, host_views=host_views)
  return dataclasses.replace(push, delta=payload, host_views=host_views)


class _Writable:
  """A host array's memory exported as writable (DLPack cannot say read-only); XLA only reads it."""

  def __init__(self, array: np.ndarray):
    self.array = array  # Keeps the memory alive.
    self.__array_interface__ = {**array.__array_interface__, "data": (array.ctypes.data, False)}


def host_view(array: np.ndarray, device: jax.Device) -> jax.Array:
  """`array` on `device` without a copy when it is aligned and on the host, through DLPack.

  Why DLPack, not `device_put(may_alias=True)`: XLA frees an imported buffer's owner once the
  view is deleted and no computation reads it any more, while an aliased numpy array was let go
  of from a runtime thread and dropped only at JAX's next `gc` pass, so the syncer had to collect
  until it was (under the service's lock). The fold never donates a push, so XLA never writes this memory. Dtypes
  DLPack lacks (bfloat16) are imported as unsigned integers and bit-cast (one copy of that leaf).
  """
  exported = np.asarray(_Writable(array))
  try:
    return jax.dlpack.from_dlpack(exported.view(array.dtype), device=device)
  except BufferError:  # Not a DLPack dtype.
    raw = jax.dlpack.from_dlpack(exported.view(f"u{array.dtype.itemsize}"), device=device)
    view = jax.block_until_ready(jax.lax.bitcast_convert_type(raw, array.dtype))
    raw.delete()
    return view


def release(push: Push) -> None:
  """Deletes a checked push's device views of its receive buffer, so that the caller's reference is the last.

  XLA lets go of DLPack-imported memory without a gc pass (`host_view`), from its worker thread
  just after the last computation reading it is done: nothing to wait for. Only views `on_device`
  made are deleted: a caller's own device arrays are never touched.
  """
  if push.host_views:
    payload = push.delta.leaves if isinstance(push.delta, compression.Compressed) else push.delta
    for leaf in jax.tree.leaves(payload):
      leaf.delete()


def validate(push: Push, learners: Sequence[int], fragments: Sequence, codec: compression.Codec,
             max_norm: float = 0.0) -> float:
  """Raises PushRejected, naming the problem, for anything that must not be merged; returns ‖Δ‖ as decoded.

  `fragments`: the syncer's, each with its `version`, its Θ_p tree `params` and the
  (shape, dtype) `leaf_specs` every pushed leaf must have. `max_norm` > 0: a bound without
  statistics (`syncer.max_push_norm`); a push whose decoded norm exceeds it is refused. The norm
  comes from the NaN/Inf pass every push takes anyway (Σ x²), so it costs no extra read.
  """
  who = f"push from learner {push.learner}"
  if push.learner not in learners:
    raise PushRejected(f"{who} rejected: unknown learner; registered learners are {sorted(learners)}")
  if not (isinstance(push.fragment, int) and 0 <= push.fragment < len(fragments)):
    raise PushRejected(f"{who} rejected: fragment {push.fragment!r} is not in [0, {len(fragments)})")
  fragment = fragments[push.fragment]
  fragment_params, leaf_specs, version = fragment.params, fragment.leaf_specs, fragment.version
  if not 0 <= push.base_version <= version:
    raise PushRejected(f"{who} rejected: base version {push.base_version} is not in [0, {version}] "
                       "(a version from the future means a misrouted or corrupt push)")
  if push.tokens < 1 or push.local_steps < 1:
    raise PushRejected(f"{who} rejected: tokens={push.tokens}, local_steps={push.local_steps}; "
                       "need tokens >= 1 and local_steps >= 1")
  if isinstance(push.delta, compression.Compressed):  # Decoded: float32 tensors of the payload's shapes.
    if len(push.delta.shapes) != len(leaf_specs):
      raise PushRejected(f"{who} rejected: {len(push.delta.shapes)} tensors for fragment {push.fragment}'s "
                         f"{len(leaf_specs)}")
    specs = [(tuple(shape), np.dtype(np.float32)) for shape in push.delta.shapes]
  elif jax.tree.structure(push.delta) != jax.tree.structure(fragment_params):
    raise PushRejected(f"{who} rejected: pseudo-gradient tree structure differs from fragment "
                       f"{push.fragment}'s params")
  else:
    specs = [
        (tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", type(leaf)))) for leaf in jax.tree.leaves(push.delta)]
  for (path, _), got, (shape, dtype) in zip(jax.tree_util.tree_leaves_with_path(fragment_params), specs, leaf_specs):
    if got != (shape, dtype):
      raise PushRejected(f"{who} rejected: {jax.tree_util.keystr(path)} is {got[1]}{list(got[0])}, "
                         f"expected {dtype}{list(shape)}")
  norm = checked_norm(push, codec)
  if np.isnan(norm):
    raise PushRejected(f"{who} rejected: the pseudo-gradient holds NaN or Inf (did the learner diverge?)")
  if max_norm > 0 and norm > max_norm:
    raise PushRejected(f"{who} rejected: its pseudo-gradient norm {norm:.4g} exceeds syncer.max_push_norm={max_norm:g} "
                       "(a corrupt or hostile push; raise the bound if honest pushes reach it)")
  return norm


def one_at_a_time(push: Push) -> bool:
  """Whether the push's tensors come one by one (decoded from a compressed payload, or mapped from disk):
  then a check or a fold takes them in turn and never holds the whole push."""
  return isinstance(push.delta, compression.Compressed) or push.drop_pages is not None


def checked_norm(push: Push, codec: compression.Codec) -> float:
  """‖Δ‖ of the push as the syncer decodes it: NaN when a value is NaN or Inf, inf when only Σ x² overflows.

  One pass over a tree, or tensor by tensor (decoded, or mapped from disk). Why the syncer's own
  norm, not the learner's `delta_norm`: a faulty or hostile learner's claim cannot be trusted.
  """
  leaves = delta_leaves(push, codec) if one_at_a_time(push) else jax.tree.leaves(push.delta)
  total = 0.0
  for leaf in leaves:
    total += squared_norm(leaf)
    if np.isnan(total):
      return total
  return float(np.sqrt(total))


def all_finite(tree) -> bool:
  """True when no leaf holds NaN or Inf (see `squared_norm`)."""
  return not np.isnan(sum(squared_norm(leaf) for leaf in jax.tree.leaves(tree)))


def squared_norm(leaf) -> float:
  """Σ x² of one tensor: NaN when it holds NaN or Inf, inf when its values are finite but Σ x² overflows.

  It runs on every push, so the common case takes one fast pass: Σ x² over a float32 leaf
  (BLAS's dot on the host memory: no temporary; ~3x faster on this CPU than XLA's jitted dot with
  its dispatch, itself ~3x faster than a fused Σ x·0) is finite exactly when every x is, unless it
  overflows (|x| ~ 1e19): only then is the leaf checked value by value. Other dtypes take Σ x² in
  float32 in XLA, and the exact Σ x·0 pass only when that is not finite.
  """
  if np.dtype(leaf.dtype) == np.float32:
    return _float32_squares(leaf)
  squares = float(_others_squares(leaf))
  if np.isfinite(squares):
    return squares
  return np.inf if bool(_others_finite(leaf)) else np.nan


def _float32_squares(leaf, chunk: int = 1 << 20) -> float:
  # DLPack: a view of a host array's memory, ~20x cheaper than np.asarray's first call on a new array.
  exportable = not isinstance(leaf, np.ndarray) and leaf.device.platform == "cpu"
  values = (np.from_dlpack(leaf) if exportable else np.asarray(leaf)).reshape(-1)
  with np.errstate(over="ignore", invalid="ignore"):
    squares = float(np.dot(values, values))
  if np.isfinite(squares):
    return squares
  return np.inf if all(np.isfinite(values[i:i + chunk]).all() for i in range(0, values.size, chunk)) else np.nan


@jax.jit
def _others_squares(leaf):
  return jnp.sum(jnp.square(leaf.astype(jnp.float32)))


@jax.jit
def _others_finite(leaf):
  # x·0 is 0 for finite x and NaN for NaN/±Inf, and a sum keeps a NaN (it never overflows).
  return jnp.isfinite(jnp.sum(leaf * 0, dtype=jnp.float32))

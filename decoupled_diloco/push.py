"""A push, and the checks it passes before the syncer lets it change anything.

A learner's push arrives from another process, maybe another machine, maybe a buggy or
hostile one: everything here runs before any state changes, so a refused push leaves the
syncer exactly as it was (and, in the service, never reaches the write-ahead log).
"""

import dataclasses
import gc
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from absl import logging
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
  delta: Any             # Pseudo-gradient Θ_base − θ of the fragment, or its compression.Compressed.
  base_version: int      # Syncer version the learner started from.
  tokens: int            # Tokens processed since that pull.
  local_steps: int       # Inner steps since that pull.
  compute_seconds: float = 0.0  # Time those steps took (feeds the grace window's step EMA).
  fragment: int = 0      # Which parameter fragment `delta` covers (streaming); 0 when P = 1.
  wire_bytes: int = 0    # Exact bytes of the payload as sent (compressed or not).
  host_views: tuple = ()  # Set by Syncer.check: weak references to the host memory its device views hold.


def delta_leaves(push: Push, codec: compression.Codec) -> Iterator:
  """The push's float tensors in leaf order, a compressed one decoded one tensor at a time (never whole)."""
  if isinstance(push.delta, compression.Compressed):
    return (compression.decode_leaf(codec, shape, payload) for shape, payload in zip(push.delta.shapes,
                                                                                      push.delta.leaves))
  return iter(jax.tree.leaves(push.delta))


def on_device(push: Push, codec: compression.Codec, to_host: Callable) -> Push:
  """The push with its delta moved by `to_host`; a compressed one's payload checked and left encoded
  (it is decoded tensor by tensor straight into the accumulator). Raises TypeError/ValueError.

  A delta of numpy arrays (a decoded wire payload) becomes device arrays made here, which XLA
  may alias without a copy: `host_views` lets `release` free them and wait until XLA let go.
  """
  delta = push.delta
  payload = delta.leaves if isinstance(delta, compression.Compressed) else delta
  host_views = ()
  if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(payload)):
    owners = jax.tree.map(_HostOwner, payload)
    host_views = tuple(weakref.ref(owner) for owner in jax.tree.leaves(owners))
    payload = to_host(jax.tree.map(_HostOwner.view, owners))
  else:
    payload = to_host(payload)
  if isinstance(delta, compression.Compressed):
    delta = delta._replace(leaves=payload)
    compression.check(codec, delta)
    return dataclasses.replace(push, delta=delta, host_views=host_views)
  return dataclasses.replace(push, delta=payload, host_views=host_views)


class _HostOwner:
  """Stands for a host array's memory while XLA aliases it: alive exactly as long as a view of it is."""

  def __init__(self, array: np.ndarray):
    self.array = array  # Keeps the memory alive.
    self.__array_interface__ = array.__array_interface__

  def view(self) -> np.ndarray:
    """The array again, through this owner (dtype restored: the interface spells bfloat16 as raw bytes)."""
    return np.asarray(self).view(self.array.dtype)


def release(push: Push, timeout_seconds: float = 10.0) -> None:
  """Deletes a checked push's device views and returns once XLA let go of the host memory they alias.

  Why: XLA aliases a read-only payload without a copy and drops its reference only after the
  views are deleted, from a runtime thread (maybe after the fold returned), into a list that
  JAX empties at its next `gc` pass. Without waiting here, a folded push's receive buffer
  could outlive the next push's arrival and the syncer hold two. Only views `on_device` made
  are deleted: a caller's own arrays are never touched.
  """
  if not push.host_views:
    return
  payload = push.delta.leaves if isinstance(push.delta, compression.Compressed) else push.delta
  for leaf in jax.tree.leaves(payload):
    leaf.delete()
  deadline = time.monotonic() + timeout_seconds
  while True:
    gc.collect(0)  # Young generation only: cheap; JAX's gc callback drops the references XLA released.
    if all(ref() is None for ref in push.host_views):
      return
    if time.monotonic() > deadline:
      logging.warning("XLA still holds a push's host memory after %.0f s; going on without it", timeout_seconds)
      return
    time.sleep(0)  # Lets the runtime thread that holds the last reference run.


def validate(push: Push, learners: Sequence[int], fragments: Sequence, codec: compression.Codec) -> None:
  """Raises PushRejected, naming the problem, for anything that must not be merged.

  `fragments`: the syncer's, each with its `version`, its Θ_p tree `params` and the
  (shape, dtype) `leaf_specs` every pushed leaf must have.
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
    specs = [(tuple(np.shape(leaf)), np.dtype(getattr(leaf, "dtype", type(leaf)))) for leaf in
             jax.tree.leaves(push.delta)]
  for (path, _), got, (shape, dtype) in zip(jax.tree_util.tree_leaves_with_path(fragment_params), specs,
                                            leaf_specs):
    if got != (shape, dtype):
      raise PushRejected(f"{who} rejected: {jax.tree_util.keystr(path)} is {got[1]}{list(got[0])}, "
                         f"expected {dtype}{list(shape)}")
  if not finite(push, codec):
    raise PushRejected(f"{who} rejected: the pseudo-gradient holds NaN or Inf (did the learner diverge?)")


def finite(push: Push, codec: compression.Codec) -> bool:
  """No NaN or Inf in the push: one pass over a tree, or decoded tensor by tensor (never whole)."""
  if isinstance(push.delta, compression.Compressed):
    return all(all_finite(leaf) for leaf in delta_leaves(push, codec))
  return all_finite(push.delta)


def all_finite(tree) -> bool:
  """True when no leaf holds NaN or Inf; it runs on every push, so the common case takes one fast pass.

  Σ x² over float32 leaves (XLA's dot: no temporary, ~3x faster on CPU than a fused Σ x·0,
  which keeps a leaf-sized temporary) is finite exactly when every x is, unless it overflows
  (|x| ~ 1e19): only then are those leaves checked value by value, on the host (no compile).
  """
  squares_finite, others_finite = _fast_finite(tree)
  return bool(others_finite) and (bool(squares_finite) or _values_finite(tree))


@jax.jit
def _fast_finite(tree):
  leaves = jax.tree.leaves(tree)
  squares = sum(jnp.vdot(x, x) for x in leaves if x.dtype == jnp.float32)
  # x·0 is 0 for finite x and NaN for NaN/±Inf, and a sum keeps a NaN (it never overflows).
  others = sum(jnp.sum(x * 0, dtype=jnp.float32) for x in leaves if x.dtype != jnp.float32)
  return jnp.isfinite(squares), jnp.isfinite(others)


def _values_finite(tree, chunk: int = 1 << 20) -> bool:
  """Every float32 value finite, a chunk at a time (no leaf-sized temporary); DLPack views, no copy."""
  for leaf in jax.tree.leaves(tree):
    if np.dtype(leaf.dtype) == np.float32:
      values = (leaf if isinstance(leaf, np.ndarray) else np.from_dlpack(leaf)).reshape(-1)
      if not all(np.isfinite(values[i:i + chunk]).all() for i in range(0, values.size, chunk)):
        return False
  return True

"""Robust merges: a merge that one faulty or hostile learner cannot wreck.

The weighted mean has no bound: one learner pushing its pseudo-gradient ×100 (a bf16 overflow,
corrupted memory, a hostile learner) moves Θ a hundred honest steps. Two rules bound it:

  clip          push by push, as it arrives: Δ_i ← min(1, c · median(‖Δ‖ of recent pushes) / ‖Δ_i‖) · Δ_i,
                then the weighted mean. The median is over the fragment's last W push norms, this
                push's own included (before W pushes arrived: over all of them so far, so the first
                push is never clipped, c >= 1). Works on one push at a time: memory flat in M.
  trimmed_mean  per coordinate j over the n pushes of one merge: drop the k = ⌊β·n⌋ lowest and k
                highest values, then Δ[j] = Σ_{kept} f_i t_i Δ_i[j] / Σ_{kept} t_i (token shares
                renormalised over the pushes kept at j, staleness damping f_i applied as the mean's).
                Computed tensor by tensor and, within a tensor, in chunks of coordinates, so that the
                working set is a chunk however many pushes there are.

Both compose with the merge weights (docs/syncer.md, "Robust merges"): a push is clipped on its raw
norm before its staleness and token weights apply; trimming decides per coordinate which pushes
count, then the same weights apply to those. Everything here is a pure function; the syncer decides
when each runs.
"""

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ROBUST_RULES = ("clip", "trimmed_mean")
CHUNK_FLOATS = 1 << 20  # Floats of all pushes together in one trimmed chunk (4 MB), whatever their number.


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What the syncer made of one push: its norm as decoded, and the factor the clip rule scaled it by."""
  norm: float
  clip_factor: float = 1.0

  def fields(self) -> dict:
    """The `push` record's fields (docs/records.md)."""
    return {"checked_norm": self.norm, "clip_factor": self.clip_factor, "clipped": int(self.clip_factor < 1)}


def clip_factor(norm: float, recent: Sequence[float], multiple: float) -> float:
  """The factor a push of norm `norm` is scaled by: min(1, multiple · median(recent) / norm).

  `recent`: the fragment's last W push norms, this push's own included, so a push is judged by
  its peers, and an attacker is one voice of W in the median. A zero push is never scaled.
  """
  if not recent:
    raise ValueError("clip_factor needs the recent norms, this push's own included")
  if norm <= 0:
    return 1.0
  bound = multiple * float(np.median(np.asarray(recent, np.float64)))
  return 1.0 if norm <= bound else bound / norm


def trim_count(pushes: int, fraction: float) -> int:
  """Pushes dropped at each end of every coordinate: ⌊fraction · pushes⌋ (never half or more of them)."""
  if not 0 <= fraction < 0.5:
    raise ValueError(f"trim fraction {fraction} must be in [0, 0.5): trimming half of each end leaves nothing")
  return int(np.floor(fraction * pushes + 1e-9))


@functools.partial(jax.jit, static_argnums=3)
def _trimmed_chunk(stack, tokens, damping, trim: int):
  """(trimmed weighted mean of a chunk, per push: coordinates of the chunk where it was trimmed).

  `stack`: (n, c) float32, one row per push. Ties are ranked by push order (a stable sort), so
  the result is deterministic.
  """
  n = stack.shape[0]
  ranks = jnp.argsort(jnp.argsort(stack, axis=0, stable=True), axis=0, stable=True)
  kept = (ranks >= trim) & (ranks < n - trim)
  weights = jnp.where(kept, tokens[:, None], 0.0)
  merged = jnp.sum(weights * damping[:, None] * stack, axis=0) / jnp.sum(weights, axis=0)
  return merged, jnp.sum(~kept, axis=1)


def trimmed_mean_leaf(leaves: Sequence, tokens: np.ndarray, damping: np.ndarray, trim: int,
                      chunk_floats: int = CHUNK_FLOATS) -> tuple[np.ndarray, np.ndarray]:
  """One tensor's trimmed mean over the pushes' `leaves` (same shape), chunk by chunk of coordinates.

  `tokens`: each push's token weight t_i; `damping`: its staleness factor f_i. Returns (merged
  float32 tensor, per push the number of its coordinates that were trimmed). A chunk holds
  `chunk_floats` // n coordinates of every push, so the working set does not grow with n.
  """
  n = len(leaves)
  flat = [np.asarray(leaf).reshape(-1) for leaf in leaves]
  size = flat[0].size
  step = max(1, chunk_floats // n)
  merged = np.empty(size, np.float32)
  trimmed = np.zeros(n, np.int64)
  tokens, damping = jnp.asarray(tokens, jnp.float32), jnp.asarray(damping, jnp.float32)
  for start in range(0, size, step):
    stack = np.stack([x[start:start + step].astype(np.float32, copy=False) for x in flat])
    chunk, counts = _trimmed_chunk(stack, tokens, damping, trim)
    merged[start:start + step] = np.asarray(chunk)
    trimmed += np.asarray(counts)
  return merged.reshape(np.shape(leaves[0])), trimmed


def trimmed_merge(sources: Sequence[Iterator], tokens: Sequence[float], damping: Sequence[float],
                  fraction: float) -> tuple[list, list[float]]:
  """The trimmed mean of a merge's pushes, tensor by tensor: (merged float32 tensors, per push the
  share of its coordinates that were trimmed).

  `sources`: one iterator per push over its float tensors in leaf order; all are advanced together,
  so one tensor of each push is read at a time. With fewer pushes than 1/fraction nothing is
  trimmed (k = 0): the merge is the weighted mean.
  """
  tokens, damping = np.asarray(tokens, np.float64), np.asarray(damping, np.float64)
  tokens = tokens / tokens.max()  # Only ratios matter; float32 must not overflow on large counts.
  trim = trim_count(len(sources), fraction)
  merged, trimmed, total = [], np.zeros(len(sources), np.int64), 0
  for leaves in zip(*sources, strict=True):
    leaf, counts = trimmed_mean_leaf(leaves, tokens, damping, trim)
    merged.append(leaf)
    trimmed += counts
    total += leaf.size
  return merged, [float(c) / total if total else 0.0 for c in trimmed]

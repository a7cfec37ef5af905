"""Merging pseudo-gradients from several learners into one.

Learners that processed more tokens carry more signal, so the synchronous merge is a
token-weighted mean; with equal shards it is the plain mean of DiLoCo.
"""

from collections.abc import Sequence

import jax
import numpy as np


def normalized_weights(weights: Sequence[float]) -> np.ndarray:
  """Weights scaled to sum to one; rejects all-zero or negative weights early."""
  w = np.asarray(weights, np.float64)
  if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
    raise ValueError(f"merge weights must be finite, non-negative and not all zero, got {w.tolist()}")
  return w / w.sum()


def weighted_average(deltas: Sequence, weights):
  """Σ w_m Δ_m over pytrees of identical structure, for weights that sum to one.

  Jit-friendly (weights may be traced); normalise them first with `normalized_weights`.
  """
  return jax.tree.map(lambda *leaves: sum(weights[m] * leaf for m, leaf in enumerate(leaves)), *deltas)

"""The syncer's streaming accumulation, jitted: folding a push into running sums, merging them.

The math is `merge`'s (`merge.Accumulator`, `accumulate_leaf`, `merged_leaf`); this module
runs it on the syncer's host with the buffers donated, so a fold is in place, the merge
becomes the new Θ in the sums' buffers and the outer state is updated in place: the syncer
holds Θ, its outer state and one set of sums per fragment with open pushes, whatever the
number of pushes.
"""

import functools

import jax
import numpy as np

from decoupled_diloco import merge, outer


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(1, 2))
def _jit_accumulate(rda, total, radius, delta, scale):
  return merge.accumulate_leaf(total, radius, delta, scale, rda)


def fold(rda: tuple, sums, radii, leaves, scale) -> tuple[list, list]:
  """Running sums (None: none yet) with one push's tensors folded in, factor `scale`, one tensor at a time:
  each tensor's sums are donated, so the fold is in place and a decoded tensor is dropped before the next
  is decoded. `rda`: per tensor, whether RDA merges it."""
  sums = list(sums) if sums is not None else [None] * len(rda)
  radii = list(radii) if radii is not None else [None] * len(rda)
  for k, (flag, leaf) in enumerate(zip(rda, leaves, strict=True)):
    sums[k], radii[k] = _jit_accumulate(flag, sums[k], radii[k], leaf, scale)
  return sums, radii


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=1)
def _jit_merged(rda, sums, radii, inverse_total, dtypes):
  return [merge.merged_leaf(total, radius, inverse_total, flag, dtype)
          for total, radius, flag, dtype in zip(sums, radii, rda, dtypes, strict=True)]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def _jit_outer_step(optimizer, params, merged, opt_state):
  # JAX pairs donated buffers with outputs in argument order: the merge's become the new Θ and the outer
  # state's its own update, so each output is written where its elementwise inputs are (no copy).
  return outer.outer_step(optimizer, params, opt_state, merged)


def merge_and_step(optimizer, rda: tuple, params, opt_state, accumulator: merge.Accumulator, inverse_total):
  """(Θ, outer state) after one outer step with the merge of `accumulator`'s pushes.

  Two jits, the merge materialised in between, in the sums' buffers (donated): fused into the
  outer step, XLA contracts its multiply-adds differently from the batch merge's, which the
  demo's final loss showed (1.3405 → 1.3407); apart, the mean of equal shares is the batch
  merge bit for bit. Donated too: the outer state (updated in place) and the merge (its
  buffers become the new Θ). Θ itself is not: in-process runtimes hand it to learners as
  their anchor, and it is freed once nobody holds it.
  """
  leaves, treedef = jax.tree.flatten(params)
  merged = _jit_merged(rda, accumulator.sums, accumulator.radii, inverse_total,
                       tuple(np.dtype(leaf.dtype) for leaf in leaves))
  return _jit_outer_step(optimizer, params, jax.tree.unflatten(treedef, merged), opt_state)

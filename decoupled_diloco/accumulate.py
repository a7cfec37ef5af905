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
def _jit_accumulate(rda, sums, radii, deltas, scale):
  folded = [
      merge.accumulate_leaf(total, radius, delta, scale, flag)
      for flag, total, radius, delta in zip(rda, sums, radii, deltas, strict=True)]
  return [total for total, _ in folded], [radius for _, radius in folded]


def fold(rda: tuple, sums, radii, leaves, scale, one_at_a_time: bool, wait_each: bool = False) -> tuple[list, list]:
  """Running sums (None: none yet) with one push's tensors folded in, factor `scale`; the sums are
  donated, so the fold is in place. `rda`: per tensor, whether RDA merges it.

  A push's tensors are folded in one call (one dispatch, not one per tensor: on the host CPU a
  dispatch costs about half the arithmetic of a 0.5M-float tensor), or `one_at_a_time` for tensors
  decoded or read on the way (`leaves` a generator), each done before the next is asked for, so that
  one tensor of the push is in memory at a time; `wait_each` waits for each tensor's fold before asking
  for the next (a payload mapped from disk then lets go of the pages it has read).
  """
  sums = list(sums) if sums is not None else [None] * len(rda)
  radii = list(radii) if radii is not None else [None] * len(rda)
  if not one_at_a_time:
    return _jit_accumulate(rda, sums, radii, list(leaves), scale)
  for k, leaf in enumerate(leaves):
    (sums[k],), (radii[k],) = _jit_accumulate(rda[k:k + 1], sums[k:k + 1], radii[k:k + 1], [leaf], scale)
    if wait_each:
      jax.block_until_ready(sums[k])
  return sums, radii


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=1)
def _jit_merged(rda, sums, radii, inverse_total, dtypes):
  return [
      merge.merged_leaf(total, radius, inverse_total, flag, dtype)
      for total, radius, flag, dtype in zip(sums, radii, rda, dtypes, strict=True)]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3))
def _jit_outer_step(optimizer, params, merged, opt_state, arrivals):
  # JAX pairs donated buffers with outputs in argument order: the merge's become the new Θ and the outer
  # state's its own update, so each output is written where its elementwise inputs are (no copy).
  return outer.outer_step(optimizer, params, opt_state, merged, arrivals)


def outer_step_scratch_bytes(optimizer, params_shape) -> int:
  """XLA's scratch bytes for the outer step over `params_shape` (abstract: compiled, never run), beyond Θ, the outer
  state and the merge's buffers (all donated but Θ): what the syncer's host needs on top of them at a merge.

  Why compiled rather than counted: each optimizer's update keeps its own temporaries (Delayed
  Nesterov: its window sum's new value, read twice, 4 B/param; SGD and Adam: none), so the plan
  asks XLA instead of keeping a table per optimizer.
  """
  state = jax.eval_shape(optimizer.init, params_shape)
  return int(
      _jit_outer_step.lower(optimizer, params_shape, params_shape, state,
                            np.int32(1)).compile().memory_analysis().temp_size_in_bytes)


def merge_and_step(optimizer, rda: tuple, params, opt_state, accumulator: merge.Accumulator, inverse_total,
                   arrivals: int):
  """(Θ, outer state) after one outer step with the merge of `accumulator`'s pushes.

  Two jits, the merge materialised in between, in the sums' buffers (donated): fused into the
  outer step, XLA contracts its multiply-adds differently from the batch merge's, which the
  demo's final loss showed (1.3405 → 1.3407); apart, the mean of equal shares is the batch
  merge bit for bit. Donated too: the outer state (updated in place) and the merge (its
  buffers become the new Θ). Θ itself is not: in-process runtimes hand it to learners as
  their anchor, and it is freed once nobody holds it. `arrivals`: the pushes merged (a traced
  value: one compiled step serves every merge size).
  """
  leaves, treedef = jax.tree.flatten(params)
  merged = _jit_merged(rda, accumulator.sums, accumulator.radii, inverse_total,
                       tuple(np.dtype(leaf.dtype) for leaf in leaves))
  return _jit_outer_step(optimizer, params, jax.tree.unflatten(treedef, merged), opt_state, np.int32(arrivals))

"""The blocks' params stacked along a leading layer axis, and back: how scanned layers are held.

The params tree keeps `block_0 .. block_{L-1}` (checkpoints, fragments and merges see one tree
whatever `scan_layers` says). A step over that tree, though, reads, updates and writes every
block's leaves separately: L times the buffers and kernels, so its compile time grows with depth.
With scan_layers the inner step's state holds the blocks stacked under one `blocks` key instead
([L, ...] leaves), and the tree is dealt back only where it leaves the step.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

STACKED = 'blocks'


def block_key(index: int) -> str:
  """The params-tree key of block `index`."""
  return f'block_{index}'


def stack_blocks(tree: dict, num_layers: int) -> dict:
  """`tree` (params-shaped) with block_0..block_{L-1} replaced by one `blocks` subtree of [L, ...] leaves."""
  rest = {k: v for k, v in tree.items() if not k.startswith('block_')}
  rest[STACKED] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(tree[block_key(i)] for i in range(num_layers)))
  return rest


def unstack_blocks(tree: dict, num_layers: int) -> dict:
  """Inverse of stack_blocks: the `blocks` subtree dealt back to block_0..block_{L-1}."""
  rest = {k: v for k, v in tree.items() if k != STACKED}
  for i in range(num_layers):
    rest[block_key(i)] = jax.tree.map(lambda leaf, i=i: leaf[i], tree[STACKED])
  return rest


def stack_shardings(shardings: dict) -> dict:
  """The NamedShardings of `stack_blocks(tree)` given `tree`'s: a stacked leaf is its block's, unsplit over layers."""
  rest = {k: v for k, v in shardings.items() if not k.startswith('block_')}
  rest[STACKED] = jax.tree.map(lambda s: NamedSharding(s.mesh, PartitionSpec(None, *s.spec)), shardings[block_key(0)])
  return rest


def layer_axes(path: tuple[Any, ...]) -> int:
  """1 for a leaf under the stacked `blocks` key (its leading axis is the layer), else 0."""
  return int(bool(path) and getattr(path[0], 'key', None) == STACKED)

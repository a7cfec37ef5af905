"""Parameter fragments and their staggered sync schedule (Streaming DiLoCo).

Syncing the whole model at once makes wide-area traffic bursty: every H steps all of it
goes out and the learner waits. Streaming splits the params into P fragments, each with
its own offset t_p inside the H-step period, so at most ~1/P of the model is on the wire
at any time. A fragment is described by an assignment: one fragment id per leaf, in
`jax.tree.leaves` order. Fragment subtrees keep the params' dict structure with `None`
in place of leaves they do not own, so names (and the embedding mask of the merge rule)
survive, and P = 1 gives back the tree itself.
"""

import dataclasses
import re
from collections.abc import Sequence

import jax
import numpy as np

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.errors import ConfigError

STRATEGIES = ("strided", "tensor", "balanced")
_BLOCK = re.compile(r"block_(\d+)")


@dataclasses.dataclass(frozen=True)
class Streaming:
  """`config.streaming`, validated on its own; `partition` checks P against the model's tensors."""
  num_fragments: int = 1  # P: fragments, each synced once per H steps.
  strategy: str = "strided"
  overlap_steps: int = 0  # τ: inner steps a learner trains before the merged fragment must be in (< H).
  alpha: float = 0.0  # θ_p ← α θ_p + (1 − α) Θ_p.

  def __post_init__(self):
    settings_lib.check((
        (settings_lib.is_int(self.num_fragments) and self.num_fragments >= 1,
         f"streaming.num_fragments={self.num_fragments!r} must be an int >= 1: set --config.streaming.num_fragments"),
        (self.strategy in STRATEGIES, f"streaming.strategy={self.strategy!r} is unknown: use one of {STRATEGIES}"),
        (0.0 <= self.alpha <= 1.0, f"streaming.alpha = {self.alpha} must be in [0, 1]"),
    ))

  @classmethod
  def from_config(cls, streaming_cfg) -> "Streaming":
    """The streaming group of a config (or a Streaming already); unknown fields are refused by name."""
    return settings_lib.from_config(cls, streaming_cfg, "streaming")

  @property
  def streams(self) -> bool:
    """Whether any fragment syncs apart from the rest or overlaps compute: what needs a clock."""
    return self.num_fragments > 1 or self.overlap_steps > 0


def _layer_of(path) -> int | None:
  """Transformer block index of a leaf, from its path ('block_3/...'), or None."""
  match = _BLOCK.fullmatch(str(getattr(path[0], "key", "")))
  return int(match.group(1)) if match else None


def partition(params, num_fragments: int, strategy: str = "strided") -> tuple[int, ...]:
  """Fragment id of every leaf: the unit in which a learner syncs and the syncer merges.

  'strided' (Streaming DiLoCo): block i goes to fragment i mod P; embeddings join the
  first fragment and the final norm and head the last, so each fragment is a slice of
  depth. 'tensor': leaves dealt round-robin. 'balanced' (Decoupled DiLoCo): greedy
  bin-packing of tensors by size, largest first, so fragments cost about the same to send.
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  if strategy not in STRATEGIES:
    raise ConfigError(f"streaming.strategy={strategy!r} is unknown: use one of {STRATEGIES}")
  if not 1 <= num_fragments <= len(leaves):
    raise ConfigError(f"streaming.num_fragments={num_fragments} must be in [1, {len(leaves)}] "
                      f"(the model has {len(leaves)} tensors): lower --config.streaming.num_fragments")
  if strategy == "tensor":
    return tuple(i % num_fragments for i in range(len(leaves)))
  if strategy == "balanced":
    sizes = [int(np.size(leaf)) for _, leaf in leaves]
    loads, assignment = [0] * num_fragments, [0] * len(leaves)
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], i)):
      lightest = min(range(num_fragments), key=lambda p: (loads[p], p))
      assignment[i] = lightest
      loads[lightest] += sizes[i]
    return tuple(assignment)
  layers = [_layer_of(path) for path, _ in leaves]
  num_layers = len({l for l in layers if l is not None})
  if num_fragments > max(num_layers, 1):
    raise ConfigError(f"streaming.num_fragments={num_fragments} exceeds the {num_layers} layers that 'strided' "
                      "deals out: lower it or use --config.streaming.strategy=balanced")
  inputs = ["embed" in jax.tree_util.keystr(path) for path, _ in leaves]
  return tuple((l % num_fragments) if l is not None else (0 if is_input else num_fragments - 1)
               for l, is_input in zip(layers, inputs))


def fragment_bytes(params, assignment: Sequence[int]) -> list[int]:
  """Bytes each fragment holds: what one uncompressed sync of it puts on the wire."""
  totals = [0] * (max(assignment) + 1)
  for fragment, leaf in zip(assignment, jax.tree.leaves(params)):
    totals[fragment] += int(np.size(leaf)) * np.dtype(leaf.dtype).itemsize
  return totals


def select(tree, assignment: Sequence[int], fragment: int):
  """The subtree fragment `fragment` owns: same structure, `None` where it owns nothing."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [leaf if f == fragment else None for f, leaf in zip(assignment, leaves)])


def combine(fragment_trees: Sequence, assignment: Sequence[int]):
  """Inverse of `select`: one tree from every fragment's subtree (in fragment order).

  A leaf that no fragment holds (one of another syncer shard's fragments: shards.py) stays None.
  """
  is_hole = lambda x: x is None
  flat = [jax.tree.flatten(tree, is_leaf=is_hole)[0] for tree in fragment_trees]
  owners = iter(assignment)
  leaves = [None if all(x is None for x in column) else column[next(owners)] for column in zip(*flat)]
  return jax.tree.unflatten(jax.tree.structure(fragment_trees[0], is_leaf=is_hole), leaves)


def sync_offsets(num_fragments: int, period: int) -> tuple[int, ...]:
  """t_p: the step inside each H-step period at which fragment p syncs.

  Evenly staggered and ending at the period's last step, so P = 1 syncs every H steps
  exactly like plain DiLoCo; when a learner's period is shorter than P (DyLU on a slow
  learner) several fragments share a step rather than some never syncing.
  """
  return tuple(max(1, round((p + 1) * period / num_fragments)) for p in range(num_fragments))


def due(step_in_period: int, num_fragments: int, period: int) -> list[int]:
  """Fragments that sync after the `step_in_period`-th step of the period (1-based)."""
  return [p for p, t in enumerate(sync_offsets(num_fragments, period)) if t == step_in_period]

"""Syncer shards: the fragments of Θ split over S syncers, each merging its own with no coordination.

One syncer process holds Θ, its outer state and every open push; at scale that is more
host memory and merge work than one machine should carry. Fragments are independent (each
has its own version, pending pushes and outer state), so S syncers can each own a subset:
`assign` deals fragments to shards balanced by bytes, `owned` names what a shard holds,
and a shard's syncer is a plain `Syncer` over the leaves of its fragments (the others'
leaves are `None`), with local fragment ids 0..k-1 (`ShardMap` translates both ways).
`ShardedSyncer` puts S such syncers behind the one-syncer interface the in-process
runtimes drive, so the same S the service runs is testable on the virtual clock.
"""

import dataclasses
from collections.abc import Sequence

import jax

from decoupled_diloco import fragments as fragments_lib
from decoupled_diloco import settings as settings_lib
from decoupled_diloco import syncer as syncer_lib
from decoupled_diloco.errors import ConfigError


def check_count(num_shards, num_fragments: int) -> None:
  """Refuses a shard count that leaves a shard without a fragment (or is no count at all)."""
  if not (settings_lib.is_int(num_shards) and 1 <= num_shards <= num_fragments):
    raise ConfigError(f"service.shards={num_shards!r} must be an int in [1, {num_fragments}] (the run has "
                      f"{num_fragments} fragments): lower --config.service.shards or raise "
                      "--config.streaming.num_fragments")


def assign(fragment_bytes: Sequence[int], num_shards: int) -> tuple[int, ...]:
  """The shard of every fragment: greedy bin-packing by bytes (largest first onto the lightest shard).

  Shards are then numbered by their lowest fragment, so shard 0 always owns fragment 0: the
  learners' budget count rides on the pushes of shard 0 (docs/syncer-shards.md).
  """
  num_fragments = len(fragment_bytes)
  check_count(num_shards, num_fragments)
  loads, raw = [0] * num_shards, [0] * num_fragments
  for p in sorted(range(num_fragments), key=lambda p: (-fragment_bytes[p], p)):
    lightest = min(range(num_shards), key=lambda s: (loads[s], s))
    raw[p], loads[lightest] = lightest, loads[lightest] + fragment_bytes[p]
  order = sorted(set(raw), key=raw.index)  # Each raw shard in the order of its lowest fragment.
  return tuple(order.index(s) for s in raw)


@dataclasses.dataclass(frozen=True)
class ShardMap:
  """Where each fragment lives: `shard_of[p]`, and its id inside that shard (`local[p]`)."""
  shard_of: tuple[int, ...]

  @property
  def num_shards(self) -> int:
    """S."""
    return max(self.shard_of) + 1

  def owned(self, shard: int) -> tuple[int, ...]:
    """The global ids of the fragments `shard` owns, in order: local id q is owned(shard)[q]."""
    return tuple(p for p, s in enumerate(self.shard_of) if s == shard)

  def local(self, fragment: int) -> int:
    """Fragment `fragment`'s id inside its shard."""
    return self.owned(self.shard_of[fragment]).index(fragment)

  def subtree(self, tree, assignment: Sequence[int], shard: int):
    """(the shard's part of `tree`, its local leaf assignment): leaves of other shards' fragments become None,
    so the shard's syncer sees the model's structure (names, embedding mask) but holds only its bytes."""
    owned = self.owned(shard)
    leaves, treedef = jax.tree.flatten(tree)
    part = jax.tree.unflatten(treedef, [leaf if f in owned else None for f, leaf in zip(assignment, leaves)])
    return part, tuple(owned.index(f) for f in assignment if f in owned)

  @classmethod
  def of(cls, params, assignment: Sequence[int], num_shards: int) -> "ShardMap":
    """The run's map: its fragments (by `assignment`) dealt to `num_shards` shards by bytes."""
    return cls(assign(fragments_lib.fragment_bytes(params, assignment), num_shards))


def build(make_syncer, params, assignment: Sequence[int], num_shards: int, shard: int | None = None):
  """The syncer(s) of a run with `num_shards` shards; `make_syncer(params, assignment)` builds one over a part.

  `shard` given: that shard's own syncer (a shard process). None: all of them behind one
  `ShardedSyncer` (in-process runtimes), or the plain syncer when there is one shard.
  """
  if num_shards == 1 and shard is None:
    return make_syncer(params, assignment)
  shard_map = ShardMap.of(params, assignment, num_shards)
  if shard is not None:
    return make_syncer(*shard_map.subtree(params, assignment, shard))
  return ShardedSyncer([make_syncer(*shard_map.subtree(params, assignment, s)) for s in range(num_shards)], shard_map,
                       assignment)


class ShardedSyncer(syncer_lib.Syncer):
  """S shard syncers behind one syncer's interface: what the in-process runtimes drive with service.shards = S.

  Why: the service runs each shard in its own process; in one process the same split is
  testable deterministically against S = 1. `fragments` are the shards' own fragment states in
  global order, so everything `Syncer` derives from them (Θ, versions, deadlines, pending,
  flush, on_deadline, state) holds as is; pushes and merges go to the owning shard under its
  local id and their reports come back under the global one. The push tally is shared; each
  shard keeps its own ξ estimates (grace windows), as a shard process does.
  """

  def __init__(self, shard_syncers: Sequence[syncer_lib.Syncer], shard_map: ShardMap, assignment: Sequence[int]):
    # Syncer.__init__ is not called: the shards own the state it would build.
    self.shards, self.map, self.assignment = list(shard_syncers), shard_map, tuple(assignment)
    first = self.shards[0]
    self.optimizer, self.settings, self.codec, self.device = first.optimizer, first.settings, first.codec, first.device
    self.learners = first.learners
    self.fragments = [self.shards[s].fragments[shard_map.local(p)] for p, s in enumerate(shard_map.shard_of)]
    self._counts = first.counts
    self.verdict = None  # The last push's, from the shard that took it.
    for shard in self.shards:
      shard.counts = self._counts

  @property
  def counts(self) -> dict:
    """Pushes accepted, dropped and rejected and merges, over all shards."""
    return self._counts

  @counts.setter
  def counts(self, counts: dict) -> None:
    self._counts.clear()
    self._counts.update(counts)

  def _route(self, fragment: int) -> tuple[syncer_lib.Syncer, int]:
    return self.shards[self.map.shard_of[fragment]], self.map.local(fragment)

  def _named_back(self, report: syncer_lib.MergeReport | None, fragment: int) -> syncer_lib.MergeReport | None:
    """A shard's report under the global fragment id and version (merges of all shards), as S = 1 writes it."""
    return report and dataclasses.replace(report, version=self.version, fragment=fragment)

  def receive(self, push, now: float, checked: bool = False):
    """`Syncer.receive`, checked against the global fragments and applied by the owning shard."""
    if not checked:
      push = self.check(push)
    shard, local = self._route(push.fragment)
    accepted, report = shard.receive(dataclasses.replace(push, fragment=local), now, checked=True)
    self.verdict = shard.verdict
    return accepted, self._named_back(report, push.fragment)

  def merge(self, now: float, fragment: int = 0):
    """`Syncer.merge` of `fragment`, by its shard."""
    shard, local = self._route(fragment)
    return self._named_back(shard.merge(now, local), fragment)

  def restore(self, state: syncer_lib.SyncerState) -> None:
    """Each shard takes back its part of a checkpointed state."""
    for s, shard in enumerate(self.shards):
      owned = self.map.owned(s)
      part = self.map.subtree(state.params, self.assignment, s)[0]
      shard.restore(
          syncer_lib.SyncerState(part, tuple(state.opt_state[p] for p in owned),
                                 tuple(state.version[p] for p in owned)))

  def warm_up(self) -> None:
    """Every shard compiles its own folds and merges."""
    for shard in self.shards:
      shard.warm_up()

  @property
  def estimates(self) -> dict[str, float]:
    """Every shard's ξ EMAs, keyed 'shard:name'."""
    return {f"{s}:{name}": value for s, shard in enumerate(self.shards) for name, value in shard.estimates.items()}

  def restore_estimates(self, estimates: dict[str, float]) -> None:
    """Takes `estimates` (as `estimates` wrote them) back into every shard."""
    for s, shard in enumerate(self.shards):
      shard.restore_estimates({
          key.split(":", 1)[1]: value for key, value in estimates.items() if key.split(":", 1)[0] == str(s)})

  def observe_sync_seconds(self, seconds: float) -> None:
    """A merge + broadcast's duration, seen by every shard (their learners share the links)."""
    for shard in self.shards:
      shard.observe_sync_seconds(seconds)

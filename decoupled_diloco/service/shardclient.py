"""A learner's calls to S syncer shards, behind the one-syncer client interface the learner loop uses.

Each fragment lives on one shard (`shards.ShardMap`) under a local id; this client keeps a
`SyncerClient` per shard, sends each push and pull of fragment p to its owner under its
local id, and answers with the run's status as one syncer would: `versions` per global
fragment from the shards' latest replies, `version` their sum, the budget (`steps_left`,
`done`) and `max_speed` from shard 0, which alone counts the budget (service/shardrun.py),
and `acked_seq` the highest any shard acknowledged (a learner's seqs rise across shards, so
each shard's exactly-once check holds on its own subsequence).
"""

from decoupled_diloco import fragments, shards
from decoupled_diloco.service import client as client_lib


class ShardedClient:
  """`SyncerClient`'s interface over one client per syncer shard."""

  def __init__(self, clients: list[client_lib.SyncerClient], shard_map: shards.ShardMap, assignment):
    self.clients, self.map = clients, shard_map
    self.leaf_shards = tuple(shard_map.shard_of[f] for f in assignment)  # Owner of every leaf of Θ.
    self._statuses: list[dict | None] = [None] * len(clients)  # Each shard's latest status.

  def _status(self, shard: int, status: dict) -> dict:
    """The run's status after `status` came from `shard` (with that reply's own fields kept)."""
    self._statuses[shard] = status
    known = [s for s in self._statuses if s is not None]
    versions = [0] * len(self.map.shard_of)
    for p, s in enumerate(self.map.shard_of):
      if self._statuses[s] is not None:
        versions[p] = self._statuses[s]["versions"][self.map.local(p)]
    budget = self._statuses[0] or status
    return {**status, "versions": versions, "version": sum(versions),
            "acked_seq": max(s["acked_seq"] for s in known),
            "steps_left": budget["steps_left"], "done": budget["done"], "max_speed": budget["max_speed"]}

  def join(self) -> tuple[dict, object]:
    """Joins every shard: (the run's status, Θ assembled from every shard's part)."""
    parts = []
    for shard, client in enumerate(self.clients):
      status, part = client.join()
      status = self._status(shard, status)
      parts.append(part)
    return status, fragments.combine(parts, self.leaf_shards)

  def pull(self, have_version: int, fragment: int = 0) -> tuple[dict, object]:
    """Θ_fragment from its shard (None when `have_version` is still current there)."""
    shard = self.map.shard_of[fragment]
    status, theta = self.clients[shard].pull(have_version, self.map.local(fragment))
    return self._status(shard, status), theta

  def push(self, seq: int, delta, *, fragment: int = 0, **header) -> dict:
    """The push of `fragment`, to its shard under its local id; the reply carries the run's status."""
    shard = self.map.shard_of[fragment]
    return self._status(shard, self.clients[shard].push(seq, delta, fragment=self.map.local(fragment), **header))

  def heartbeat(self, retry: bool = True) -> dict:
    """Renews this learner's lease on every shard; the run's status."""
    for shard, client in enumerate(self.clients):
      status = self._status(shard, client.heartbeat(retry))
    return status

  def abandon(self) -> None:
    """Every shard's client stops retrying (see `SyncerClient.abandon`)."""
    for client in self.clients:
      client.abandon()

  def close(self) -> None:
    """Closes every channel."""
    for client in self.clients:
      client.close()

  @property
  def retries(self) -> int:
    """Failed attempts retried, over all shards."""
    return sum(client.retries for client in self.clients)

  @property
  def syncer_restarts(self) -> int:
    """Shard restarts this learner noticed, over all shards."""
    return sum(client.syncer_restarts for client in self.clients)

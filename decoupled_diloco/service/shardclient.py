"""A learner's calls to S syncer shards, behind the one-syncer client interface the learner loop uses.

Why one interface: the learner loop (and the evaluator) stay as they are with one syncer.
Each fragment lives on one shard (`shards.ShardMap`) under a local id; this client keeps a
`SyncerClient` per shard, sends each push and pull of fragment p to its owner, and answers
with the run's status as one syncer would, merged from the shards' replies (the budget from
shard 0, which alone counts it; `final` only once every shard says so). How each field is
merged: docs/syncer-shards.md.
"""

from decoupled_diloco import fragments, shards
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import security

# Fields of the run's status that shard 0 alone knows: it counts the budget (service/shardrun.py).
_RUN_FIELDS = ("steps_left", "done", "max_speed", "inner_step", "tokens", "wall_time")


def connect(target: str, service, identity: int, shard_map: shards.ShardMap, assignment, link=None):
  """A client of the syncer at `target`, or of every shard (`target`: their addresses, comma-separated, shard 0's
  first), for learner `identity` (or security.EVALUATOR) with the credential in service.token_file."""
  targets = target.split(",")
  if len(targets) != service.shards:
    raise ConfigError(f"--syncer names {len(targets)} address(es) but service.shards={service.shards}: give "
                      "every shard's HOST:PORT, comma-separated, shard 0's first")
  clients = [
      client_lib.SyncerClient(address, security.load_token(service.token_file), identity,
                              chunk_bytes=service.chunk_bytes, timeout_seconds=service.rpc_timeout_seconds,
                              retry_seconds=service.retry_seconds,
                              credentials=security.channel_credentials(service.tls_ca), data_channel=service.data_port
                              >= 0, data_tls=security.client_tls_context(service.tls_ca), link=link)
      for address in targets]
  return clients[0] if len(clients) == 1 else ShardedClient(clients, shard_map, assignment)


class ShardedClient:
  """`SyncerClient`'s interface over one client per syncer shard."""

  def __init__(self, clients: list[client_lib.SyncerClient], shard_map: shards.ShardMap, assignment):
    self.clients, self.map = clients, shard_map
    self.leaf_shards = tuple(shard_map.shard_of[f] for f in assignment)  # Owner of every leaf of Θ.
    self._statuses: list[dict | None] = [None] * len(clients)  # Each shard's latest status.
    self._final: set[int] = set()  # Fragments pulled in a reply that said Θ is final (an evaluator's).

  def _status(self, shard: int, status: dict) -> dict:
    """The run's status after `status` came from `shard` (with that reply's own fields kept)."""
    self._statuses[shard] = status
    known = [s for s in self._statuses if s is not None]
    versions = [0] * len(self.map.shard_of)
    for p, s in enumerate(self.map.shard_of):
      if self._statuses[s] is not None:
        versions[p] = self._statuses[s]["versions"][self.map.local(p)]
    budget = self._statuses[0] or status
    merged = {
        **status, "versions": versions, "version": sum(versions), "acked_seq": max(s["acked_seq"] for s in known),
        **{name: budget[name] for name in _RUN_FIELDS if name in budget}}
    if "final" in status:  # An evaluator's status (service/reader.py).
      merged["final"] = len(known) == len(self.clients) and all(s["final"] for s in known)
    return merged

  def join(self, fingerprint: dict | None = None) -> tuple[dict, object]:
    """Joins every shard (each compares the config `fingerprint`): (the run's status, Θ assembled from every
    shard's part)."""
    parts = []
    for shard, client in enumerate(self.clients):
      status, part = client.join(fingerprint)
      status = self._status(shard, status)
      parts.append(part)
    return status, fragments.combine(parts, self.leaf_shards)

  def pull(self, have_version: int, fragment: int = 0) -> tuple[dict, object]:
    """Θ_fragment from its shard (None when `have_version` is still current there)."""
    shard = self.map.shard_of[fragment]
    if fragment in self._final:  # Held at its final version: nothing to ask (its shard may have stopped).
      return self._status(shard, self._statuses[shard]), None
    status, theta = self.clients[shard].pull(have_version, self.map.local(fragment))
    if status.get("final"):
      self._final.add(fragment)
    return self._status(shard, status), theta

  def push(self, seq: int, delta, *, fragment: int = 0, **header) -> dict:
    """The push of `fragment`, to its shard under its local id; the reply carries the run's status."""
    shard = self.map.shard_of[fragment]
    return self._status(shard, self.clients[shard].push(seq, delta, fragment=self.map.local(fragment), **header))

  def heartbeat(self, retry: bool = True) -> dict:
    """Renews this learner's lease on every shard (asks every shard whose final Θ an evaluator does not hold yet);
    the run's status."""
    for shard, client in enumerate(self.clients):
      settled = set(self.map.owned(shard)) <= self._final
      status = self._status(shard, self._statuses[shard] if settled else client.heartbeat(retry))
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

  @property
  def pulled_bytes(self) -> int:
    """Θ bytes pulled, over all shards."""
    return sum(client.pulled_bytes for client in self.clients)

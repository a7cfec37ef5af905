"""`config.service` as a typed, frozen group: addresses, secrets, stream sizes, checkpoints and timeouts.

The syncer and every learner process build it from the same config, and `experiment.validate`
builds it for runtime='service' before anything is written, so a bad port or timeout costs one
error line naming the flag, in the launcher as in each process.
"""

import dataclasses

from decoupled_diloco import settings as settings_lib

EVALUATE_ON = ("syncer", "evaluator", "none")
_TIMEOUTS = ("lease_seconds", "linger_seconds", "rpc_timeout_seconds", "retry_seconds", "keepalive_seconds",
             "keepalive_timeout_seconds")


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.service`, validated; every field is described in configs/default.py."""
  host: str
  port: int  # 0 = a free one.
  data_port: int  # 0 = a free one, -1 = pushes over gRPC.
  token_file: str
  tls_cert: str
  tls_key: str
  tls_ca: str
  chunk_bytes: int
  checkpoint_every_merges: int
  truncate_corrupt_log: bool
  lease_seconds: float
  linger_seconds: float
  rpc_timeout_seconds: float
  retry_seconds: float
  keepalive_seconds: float  # The syncer pings a connection silent this long...
  keepalive_timeout_seconds: float  # ...and closes it if the ping is unanswered this long.
  max_concurrent_rpcs: int  # Calls in the syncer at once (checked against its threads in runconfig).
  link_mbps: tuple  # Per learner, pacing its data-channel traffic (checked in link.validate).
  link_latency_ms: tuple
  local_dir: str  # The log and locks when the workdir is gs:// (checked by storage.local_dir).
  evaluate_on: str  # 'syncer' (its host runs the loss), 'evaluator' (--role=evaluator), 'none'.
  learner_checkpoint_every: int  # 0 = never.
  max_refusals_in_a_row: int  # A learner process stops after this many refused pushes in a row.
  evaluator_devices: int  # 0 = learner group 0's devices and layout; N = N devices, fsdp over all of them.
  shards: int  # Syncer shards (docs/syncer-shards.md); <= fragments, checked by experiment.validate.

  def __post_init__(self):
    settings_lib.check((
        (0 <= self.port <= 65535, f"service.port={self.port} must be in [0, 65535] (0 = a free port)"),
        (-1 <= self.data_port <= 65535,
         f"service.data_port={self.data_port} must be in [-1, 65535] (0 = a free port, -1 = pushes over gRPC)"),
        (64 << 10 <= self.chunk_bytes <= 64 << 20,
         f"service.chunk_bytes={self.chunk_bytes} must be in [64 KiB, 64 MiB]: set --config.service.chunk_bytes"),
        (self.checkpoint_every_merges
         >= 1, f"service.checkpoint_every_merges={self.checkpoint_every_merges} must be >= 1"),
        *((getattr(self, name) > 0, f"service.{name}={getattr(self, name)} must be > 0: set --config.service.{name}")
          for name in _TIMEOUTS),
        (self.evaluate_on in EVALUATE_ON, f"service.evaluate_on={self.evaluate_on!r} must be one of {EVALUATE_ON}"),
        (self.evaluator_devices
         >= 0, f"service.evaluator_devices={self.evaluator_devices} must be >= 0 (0 = learner group 0's devices)"),
        (self.learner_checkpoint_every
         >= 0, f"service.learner_checkpoint_every={self.learner_checkpoint_every} must be >= 0 (0 = never)"),
        (settings_lib.is_int(self.max_refusals_in_a_row) and self.max_refusals_in_a_row >= 1,
         f"service.max_refusals_in_a_row={self.max_refusals_in_a_row!r} must be an int >= 1: set "
         "--config.service.max_refusals_in_a_row"),
        (settings_lib.is_int(self.shards) and
         self.shards >= 1, f"service.shards={self.shards!r} must be an int >= 1: set --config.service.shards"),
        (self.shards == 1 or self.evaluate_on != "syncer",
         f"service.shards={self.shards} leaves no syncer holding Θ whole to evaluate: set "
         "--config.service.evaluate_on=evaluator (it reads every shard) or none"),
    ))

  @classmethod
  def from_config(cls, service_cfg) -> "Settings":
    """The service group of a config (or a Settings already); unknown fields are refused by name."""
    return settings_lib.from_config(cls, service_cfg, "service")

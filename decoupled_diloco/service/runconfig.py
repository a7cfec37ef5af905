"""What the syncer and learner processes derive from a config, and the checks they share."""

import os
import socket

import jax
import numpy as np

from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError

ADDRESS_FILE = "syncer_address"


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def validate(config) -> None:
  """Rejects service settings that cannot work, with the flag to fix."""
  s = config.service
  _require(config.mode in ("diloco", "decoupled"),
           f"mode={config.mode!r} has no syncer to serve: use --config.mode=diloco or decoupled with --role")
  _require(0 <= s.port <= 65535, f"service.port={s.port} must be in [0, 65535] (0 = a free port)")
  _require(-1 <= s.data_port <= 65535,
           f"service.data_port={s.data_port} must be in [-1, 65535] (0 = a free port, -1 = pushes over gRPC)")
  _require(64 << 10 <= s.chunk_bytes <= 64 << 20,
           f"service.chunk_bytes={s.chunk_bytes} must be in [64 KiB, 64 MiB]: set --config.service.chunk_bytes")
  _require(s.checkpoint_every_merges >= 1,
           f"service.checkpoint_every_merges={s.checkpoint_every_merges} must be >= 1")
  for name in ("lease_seconds", "linger_seconds", "rpc_timeout_seconds", "retry_seconds"):
    _require(s[name] > 0, f"service.{name}={s[name]} must be > 0: set --config.service.{name}")
  _require(s.learner_checkpoint_every >= 0,
           f"service.learner_checkpoint_every={s.learner_checkpoint_every} must be >= 0 (0 = never)")


def check_ports_free(host: str, *ports: int) -> None:
  """Refuses fixed ports that something already listens on, before the syncer writes anything.

  The servers bind only once the syncer is built (and its workdir written); probing first turns
  a busy port into one error line. Ports 0 (the OS picks) and -1 (no data channel) need no check.
  """
  for port in (p for p in ports if p > 0):
    try:
      family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
      with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # As the servers do: TIME_WAIT is no conflict.
        probe.bind(address)
    except OSError as error:
      raise ConfigError(f"cannot listen on {host}:{port} ({error.strerror or error}): stop what holds it, or set "
                        "--config.service.port / --config.service.data_port to a free port (0 = any free port)"
                        ) from error


def budget_steps(config) -> int:
  """The run's inner steps over all learners: outer_steps × inner_steps × M, as in the simulator."""
  return config.outer_steps * config.inner_steps * len(config.learners.devices)


def max_payload_bytes(params) -> int:
  """Largest push or Θ accepted: twice the fp32 model (top-k at fraction 1 sends index + value) + 1 MiB."""
  return 2 * sum(int(np.size(x)) * 4 for x in jax.tree.leaves(params)) + (1 << 20)


def write_address(workdir: str, address: str) -> None:
  """Publishes 'host:port' atomically, so a launcher never reads half of it."""
  storage.replace_text(os.path.join(workdir, ADDRESS_FILE), address)


def read_address(workdir: str) -> str | None:
  """The address a syncer in `workdir` published, or None before it has."""
  path = storage.path(workdir) / ADDRESS_FILE
  if not path.exists():
    return None
  return path.read_text(encoding="utf-8").strip() or None

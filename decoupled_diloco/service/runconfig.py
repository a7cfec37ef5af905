"""What the syncer and learner processes derive from a config, and the checks they share."""

import os
import socket

import jax
import numpy as np

from decoupled_diloco import mesh
from decoupled_diloco import model as model_lib
from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import schedule
from decoupled_diloco.service import settings
from decoupled_diloco.service import server
from decoupled_diloco.service import link

# Above this the syncer's host CPU must not evaluate the model (at 1B one eval is ~4e15 FLOPs and
# 150 GB of temporaries for XLA on a CPU: issue 16).
SYNCER_EVAL_MAX_PARAMS = 100_000_000

ADDRESS_FILE = "syncer_address"


def validate(config) -> settings.Settings:
  """The service group of a config the syncer and learner processes can serve; ConfigError naming the flag if not."""
  schedule.require_supported(config.mode, "service")
  service = settings.Settings.from_config(config.service)
  threads = bulk_workers(len(config.learners.devices)) + server.CONTROL_WORKERS
  if service.max_concurrent_rpcs < threads:
    raise ConfigError(f"service.max_concurrent_rpcs={service.max_concurrent_rpcs} is below the {threads} calls the "
                      f"syncer's threads serve at once with {len(config.learners.devices)} learners: set "
                      f"--config.service.max_concurrent_rpcs >= {threads}")
  link.validate(config.service, len(config.learners.devices))
  if service.evaluate_on == "syncer":
    _, shapes, _ = model_lib.abstract_params(config.model)
    size = model_lib.count_params(shapes)
    if size > SYNCER_EVAL_MAX_PARAMS:
      raise ConfigError(f"service.evaluate_on='syncer' would run the {size / 1e9:.2f}B-param model on the syncer "
                        f"host's CPU (over {SYNCER_EVAL_MAX_PARAMS / 1e6:.0f}M params, every learner waits on it): "
                        "set --config.service.evaluate_on=evaluator (a process on its own devices) or none")
  if service.evaluate_on == "evaluator":
    evaluator_layout(config)
  return service


def evaluator_layout(config) -> mesh.Layout:
  """The evaluator's mesh layout: fsdp over service.evaluator_devices, or (0) learner group 0's, whose training
  batches fit on its devices as the eval batches must; ConfigError when the eval batch does not split over it."""
  count = config.service.evaluator_devices
  layout = mesh.Layout(fsdp=count) if count else mesh.layouts_from_config(config.learners)[0]
  if config.eval_batch_size % layout.batch_shards:
    raise ConfigError(f"eval_batch_size={config.eval_batch_size} does not split over the evaluator's {layout} "
                      f"({layout.batch_shards} batch shards): set --config.eval_batch_size to a multiple, or "
                      "--config.service.evaluator_devices")
  return layout


def bulk_workers(num_learners: int) -> int:
  """The syncer's bulk slots (Join/Pull/Push at once): each learner's PER_CALLER_BULK + 4 spare."""
  return server.PER_CALLER_BULK * num_learners + 4


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
      raise ConfigError(
          f"cannot listen on {host}:{port} ({error.strerror or error}): stop what holds it, or set "
          "--config.service.port / --config.service.data_port to a free port (0 = any free port)") from error


def max_payload_bytes(params) -> int:
  """Largest push or Θ accepted: twice the fp32 model (top-k at fraction 1 sends index + value) + 1 MiB."""
  return 2 * sum(int(np.size(x)) * 4 for x in jax.tree.leaves(params)) + (1 << 20)


def cache_compiled_programs(directory: str) -> None:
  """Keeps what XLA compiles from here on in `directory`, however quick: a restarted syncer's log replay and
  warm-up, and a restarted learner's train step, load their programs instead of compiling them (10 s for
  3 replayed pushes, most of a learner's rejoin, on a loaded host)."""
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def write_address(workdir: str, address: str) -> None:
  """Publishes 'host:port' atomically, so a launcher never reads half of it."""
  storage.replace_text(os.path.join(workdir, ADDRESS_FILE), address)

"""The launcher's options (its flags, parsed) and the checks that refuse a plan before anything is created."""

import dataclasses
import os
import re

from decoupled_diloco.errors import ConfigError
from experiments.launch.hosts import NAME, ZONE, Slice

@dataclasses.dataclass(frozen=True)
class Options:
  """Everything the plan depends on (the flags, parsed)."""
  config_path: str
  overrides: tuple[str, ...]
  slices: tuple[Slice, ...]
  project: str
  run_name: str
  reuse: bool = False
  syncer_vm: str = ""
  machine_type: str = "e2-standard-8"
  port: int = 50051
  syncer_address: str = ""
  workdir: str = ""
  token_file: str = ""
  token_secret: str = ""
  tls_cert: str = ""
  tls_key: str = ""
  version: str = ""
  spot: bool = False
  archive: str = "/tmp/dd_src.tar.gz"
  insecure: bool = False
  local_dir: str = "/tmp/dd_run"  # This machine's files of the run: learner credentials, tls/.

  @property
  def tls(self) -> str:
    """'given' (--tls_cert), 'generated' (the default) or 'none' (--insecure)."""
    return "given" if self.tls_cert else "none" if self.insecure else "generated"


def check(options: Options, learner_groups: tuple[int, ...]) -> None:
  """Rejects plans that cannot work, before anything is created; `learner_groups` = learners.devices."""
  if not options.project:
    raise ConfigError("--project is required: the Google Cloud project that gets the slices")
  if not NAME.fullmatch(options.run_name):
    raise ConfigError(f"--run_name={options.run_name!r}: use lowercase letters, digits and hyphens, starting "
                      "with a letter (at most 47 characters)")
  if len(options.slices) != len(learner_groups):
    raise ConfigError(f"--slices lists {len(options.slices)} slices but the config has {len(learner_groups)} "
                      "learner groups: give one slice per group (or set --config.learners.devices)")
  for i, (tpu, devices) in enumerate(zip(options.slices, learner_groups)):
    if tpu.chips != devices:
      raise ConfigError(f"slice {i} ({tpu.accelerator}) has {tpu.chips} chips but learners.devices[{i}]={devices}: "
                        f"pass --config.learners.devices with {tpu.chips} for it")
  if not 1 <= options.port <= 65534:
    raise ConfigError(f"--port={options.port} must be in [1, 65534] (the data channel takes port + 1)")
  if options.syncer_vm and not re.fullmatch(rf"{NAME.pattern}@{ZONE.pattern}", options.syncer_vm):
    raise ConfigError(f"--syncer_vm={options.syncer_vm!r}: expected NAME@ZONE, e.g. dd-syncer@us-central1-a")
  if options.insecure and options.tls_cert:
    raise ConfigError("--insecure and --tls_cert contradict each other: drop --insecure to serve TLS")
  if bool(options.tls_cert) != bool(options.tls_key):
    raise ConfigError("TLS needs both --tls_cert and --tls_key (the syncer's certificate and private key)")
  for path in (options.tls_cert, options.tls_key):
    if path and not os.path.isfile(path):
      raise ConfigError(f"{path!r} does not exist: point --tls_cert/--tls_key at PEM files")


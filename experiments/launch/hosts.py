"""Where the launcher's commands run: TPU slices (type, size, zone), hosts reached over gcloud, and steps."""

import dataclasses
import re

from decoupled_diloco.errors import ConfigError

TPU_TYPES = {"v4": ("tpu-ubuntu2204-base", 0.5), "v5litepod": ("v2-alpha-tpuv5-lite", 1),
             "v5p": ("v2-alpha-tpuv5", 0.5), "v6e": ("v2-alpha-tpuv6e", 1)}
SYNCER_IP = "SYNCER_IP"  # Stands for the address a lookup step prints, until it has run.
NAME = re.compile(r"[a-z]([-a-z0-9]{0,45}[a-z0-9])?")
ZONE = re.compile(r"[a-z]+-[a-z]+\d+-[a-z]")
EXAMPLE = "e.g. v5p-32@us-east5-a,v6e-32@us-east1-d"


@dataclasses.dataclass(frozen=True)
class Slice:
  """One TPU slice: its accelerator type (generation-size) and zone."""
  generation: str
  size: int
  zone: str

  @property
  def accelerator(self) -> str:
    """The name gcloud's --accelerator-type takes, e.g. 'v5p-32'."""
    return f"{self.generation}-{self.size}"

  @property
  def chips(self) -> int:
    """JAX devices of the slice (v4/v5p sizes count TensorCores, two per chip)."""
    return int(self.size * TPU_TYPES[self.generation][1])


def parse_slices(spec: str) -> list[Slice]:
  """`v5p-32@us-east5-a,v6e-32@us-east1-d` -> slices; ConfigError naming the bad entry."""
  entries = [e.strip() for e in spec.split(",") if e.strip()]
  if not entries:
    raise ConfigError(f"--slices is empty: list one TYPE-SIZE@ZONE per learner group, {EXAMPLE}")
  slices = []
  for entry in entries:
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)@(\S+)", entry)
    if not match or match.group(1) not in TPU_TYPES:
      raise ConfigError(f"bad --slices entry {entry!r}: expected TYPE-SIZE@ZONE with TYPE in {tuple(TPU_TYPES)}, "
                        f"{EXAMPLE}")
    generation, size, zone = match.group(1), int(match.group(2)), match.group(3)
    if not ZONE.fullmatch(zone):
      raise ConfigError(f"bad zone {zone!r} in --slices entry {entry!r}: expected a zone like us-east5-a")
    if size < 1 or size * TPU_TYPES[generation][1] != int(size * TPU_TYPES[generation][1]):
      raise ConfigError(f"bad size in --slices entry {entry!r}: {generation} sizes count TensorCores, two per "
                        f"chip: use an even size like {generation}-32")
    slices.append(Slice(generation, size, zone))
  return slices


@dataclasses.dataclass(frozen=True)
class Host:
  """Where remote commands run: all workers of a slice, worker 0 of one, or a CPU VM."""
  name: str
  zone: str
  tpu: bool = True
  worker: str = "all"

  def ssh(self, project: str, command: str) -> list[str]:
    """gcloud running the shell `command` on this host (gcloud manages the SSH keys)."""
    if self.tpu:
      return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", self.name, f"--zone={self.zone}",
              f"--project={project}", f"--worker={self.worker}", f"--command={command}"]
    return ["gcloud", "compute", "ssh", self.name, f"--zone={self.zone}", f"--project={project}",
            f"--command={command}"]

  def scp(self, project: str, local: str, remote: str) -> list[str]:
    """gcloud copying a local file to `remote` (relative to the home directory) on this host."""
    if self.tpu:
      return ["gcloud", "compute", "tpus", "tpu-vm", "scp", local, f"{self.name}:{remote}", f"--zone={self.zone}",
              f"--project={project}", f"--worker={self.worker}"]
    return ["gcloud", "compute", "scp", local, f"{self.name}:{remote}", f"--zone={self.zone}", f"--project={project}"]


@dataclasses.dataclass(frozen=True)
class Step:
  """One command; `captures` names what its stdout is (the syncer's IP), if anything."""
  what: str
  argv: tuple[str, ...]
  captures: str = ""

"""Where the launcher's commands run: TPU slices (type, size, zone), hosts reached over gcloud, and steps.

Accelerator types, their chips and the TPU VM software version come from the one table in
decoupled_diloco/hardware.py (ACCELERATORS), which the simulated clock and the plan also read.
"""

import dataclasses
import re

from decoupled_diloco import hardware
from decoupled_diloco.errors import ConfigError

# gcloud's accelerator-type prefix ('v5litepod') -> the table's chip name ('v5e').
TPU_TYPES = {spec.tpu_type: chip for chip, spec in hardware.ACCELERATORS.items() if spec.tpu_type}
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
  def chip(self) -> str:
    """The chip's name in hardware.ACCELERATORS (learners.hardware), e.g. 'v5e' for v5litepod."""
    return TPU_TYPES[self.generation]

  @property
  def spec(self) -> hardware.Accelerator:
    """The chip's row of the one accelerator table."""
    return hardware.ACCELERATORS[self.chip]

  @property
  def chips(self) -> int:
    """JAX devices of the slice (v4/v5p sizes count TensorCores, two per chip)."""
    return self.size // self.spec.cores_per_chip

  @property
  def region(self) -> str:
    """The zone's region (us-east5-a -> us-east5)."""
    return self.zone.rsplit("-", 1)[0]


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
    tpu = Slice(match.group(1), int(match.group(2)), match.group(3))
    if not ZONE.fullmatch(tpu.zone):
      raise ConfigError(f"bad zone {tpu.zone!r} in --slices entry {entry!r}: expected a zone like us-east5-a")
    if tpu.size < 1 or tpu.size % tpu.spec.cores_per_chip:
      raise ConfigError(f"bad size in --slices entry {entry!r}: {tpu.generation} sizes count TensorCores, two per "
                        f"chip: use an even size like {tpu.generation}-32")
    slices.append(tpu)
  return slices


@dataclasses.dataclass(frozen=True)
class Host:
  """Where remote commands run: all workers of a slice, worker 0 of one, or a CPU VM."""
  name: str
  zone: str
  tpu: bool = True
  worker: str = "all"

  def _gcloud(self, verb: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", verb] if self.tpu else ["gcloud", "compute", verb]

  def _where(self, project: str) -> list[str]:
    return [f"--zone={self.zone}", f"--project={project}"] + ([f"--worker={self.worker}"] if self.tpu else [])

  def ssh(self, project: str, command: str) -> list[str]:
    """gcloud running the shell `command` on this host (gcloud manages the SSH keys)."""
    return [*self._gcloud("ssh"), self.name, *self._where(project), f"--command={command}"]

  def scp(self, project: str, local: str, remote: str) -> list[str]:
    """gcloud copying a local file to `remote` (relative to the home directory) on this host."""
    return [*self._gcloud("scp"), local, f"{self.name}:{remote}", *self._where(project)]

  def gcloud(self, verb: str, *args: str) -> list[str]:
    """`gcloud compute tpus tpu-vm VERB NAME` (or `compute instances` for a VM) in this host's zone and project."""
    noun = ["tpus", "tpu-vm"] if self.tpu else ["instances"]
    return ["gcloud", "compute", *noun, verb, self.name, f"--zone={self.zone}", *args]

  def describe(self, project: str, field: str) -> list[str]:
    """gcloud printing one field of this host's resource (`state`, its internal IP, ...)."""
    return self.gcloud("describe", f"--project={project}", f"--format=value({field})")

  def internal_ip(self, project: str) -> list[str]:
    """gcloud printing the address other hosts of the VPC reach this one at."""
    return self.describe(project, "networkEndpoints[0].ipAddress" if self.tpu else "networkInterfaces[0].networkIP")


@dataclasses.dataclass(frozen=True)
class Step:
  """One command. `captures` names what its stdout is (the syncer's IP); `until` repeats it until its stdout
  is that value (a queued resource becoming ACTIVE); `unless` is a command whose success means the step's
  work is already done (a bucket or a VM that exists), so reruns of a verb skip it."""
  what: str
  argv: tuple[str, ...]
  captures: str = ""
  until: str = ""
  unless: tuple[str, ...] = ()

"""`up` and `down`: the run's bucket, its TPU slices (on demand, Spot or queued) and the syncer's CPU VM.

Every create is skipped when the resource exists already (its `describe` succeeds), so `up`
can be run again after a partial failure. `down` deletes the slices and the VM and keeps
the bucket: it holds the checkpoints, the metrics and the prepared data.
"""

import dataclasses

from experiments.launch import xpk
from experiments.launch.hosts import Host, Step
from experiments.launch.options import Options

# n2-highmem-N: N vCPUs and 8 GB per vCPU; the sizes Compute Engine offers.
HIGHMEM_VCPUS = (2, 4, 8, 16, 32, 48, 64, 80, 96, 128)
GB = 1 << 30


def syncer_machine_type(host_bytes: int) -> str:
  """The smallest n2-highmem VM holding twice the syncer's planned host bytes plus 8 GB: Θ, the outer state,
  merge sums and the push being received (plan.syncer_bytes; measured within 1% of it at 100M params, a
  checkpoint's save adding nothing, docs/syncer-memory.md) with as much again as margin for what was never
  measured at this scale, and room for the OS, Python and the eval batches."""
  need = 2 * host_bytes + 8 * GB
  vcpus = next((n for n in HIGHMEM_VCPUS if n * 8 * GB >= need), None)
  if vcpus is None:
    raise ValueError(f"the syncer needs {need / GB:.0f} GB of host memory, more than n2-highmem-128 has")
  return f"n2-highmem-{vcpus}"


def up(o: Options) -> list[Step]:
  """The bucket, every slice and the syncer's VM, created unless they exist."""
  bucket = ("gcloud", "storage", "buckets")
  steps = [
      Step(f"create the run's bucket {o.bucket} (skipped if it exists)",
           (*bucket, "create", o.bucket, f"--project={o.project}", f"--location={o.slices[0].region}",
            "--uniform-bucket-level-access"), unless=(*bucket, "describe", o.bucket, f"--project={o.project}"))]
  if o.xpk_cluster:
    steps.extend(xpk.up(o))
  for index in range(0 if o.xpk_cluster else len(o.tpus())):
    steps.extend(create_slice(o, index))
  syncer = o.syncer()
  if not syncer.tpu:
    steps.append(
        Step(
            f"create the syncer VM {syncer.name} ({o.machine_type}, no accelerator)",
            tuple(
                syncer.gcloud("create", f"--machine-type={o.machine_type}", "--image-family=ubuntu-2204-lts",
                              "--image-project=ubuntu-os-cloud", "--boot-disk-size=200GB", f"--project={o.project}")),
            unless=tuple(syncer.describe(o.project, "status"))))
  return steps


def create_slice(o: Options, index: int) -> list[Step]:
  """Slice `index` (Options.tpus): a TPU VM (on demand or --spot), or a queued resource waited for until ACTIVE."""
  host, tpu = o.tpus()[index]
  kind = f"{tpu.accelerator}{', Spot' if o.spot else ''}"
  version = f"--version={o.version or tpu.spec.runtime_version}"
  spot = ("--spot",) if o.spot else ()
  if not o.queued:
    return [
        Step(
            f"create slice {host.name} ({kind})",
            (*host.gcloud("create", f"--accelerator-type={tpu.accelerator}", version, f"--project={o.project}"), *spot),
            unless=tuple(host.describe(o.project, "state")))]
  queued = _queued(host, o.project)
  return [
      Step(f"queue slice {host.name} ({kind})",
           (*queued("create"), f"--node-id={host.name}", f"--accelerator-type={tpu.accelerator}",
            f"--runtime-version={version.split('=', 1)[1]}", *spot), unless=tuple(queued("describe"))),
      dataclasses.replace(state_step(o, index), what=f"wait until the queued slice {host.name} is ACTIVE",
                          until="ACTIVE")]


def state_step(o: Options, index: int) -> Step:
  """The command printing slice `index`'s state (its queued resource's with --queued)."""
  host = o.tpus()[index][0]
  if o.queued:
    return Step(f"state of the queued slice {host.name}",
                (*_queued(host, o.project)("describe"), "--format=value(state.state)"))
  return Step(f"state of slice {host.name}", tuple(host.describe(o.project, "state")))


def list_step(o: Options, index: int) -> Step:
  """The command listing the slices (queued resources) in slice `index`'s zone (Options.tpus), one name per line."""
  host = o.tpus()[index][0]
  noun = "queued-resources" if o.queued else "tpu-vm"
  return Step(f"slices in {host.zone}", ("gcloud", "compute", "tpus", noun, "list", f"--zone={host.zone}",
                                         f"--project={o.project}", "--format=value(name.basename())"))


def delete_slice(o: Options, index: int) -> Step:
  """Deletes slice `index` (its queued resource with it)."""
  host = o.tpus()[index][0]
  if o.queued:
    return Step(f"delete the queued slice {host.name}", (*_queued(host, o.project)("delete"), "--force", "--quiet"))
  return Step(f"delete slice {host.name}", (*host.gcloud("delete", f"--project={o.project}"), "--quiet"))


def down(o: Options) -> list[Step]:
  """Deletes every slice (XPK workload and cluster) and the syncer's VM; the bucket (checkpoints, metrics, data)
  stays."""
  steps = xpk.down(o) if o.xpk_cluster else [delete_slice(o, index) for index in range(len(o.tpus()))]
  syncer = o.syncer()
  if not syncer.tpu:
    steps.append(
        Step(f"delete the syncer VM {syncer.name}", (*syncer.gcloud("delete", f"--project={o.project}"), "--quiet")))
  return steps


def _queued(host: Host, project: str):
  """`gcloud compute tpus queued-resources VERB NAME --zone --project` for the slice `host`."""
  return lambda verb: ("gcloud", "compute", "tpus", "queued-resources", verb, host.name, f"--zone={host.zone}",
                       f"--project={project}")

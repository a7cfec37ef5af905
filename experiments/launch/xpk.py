"""The XPK mode (--xpk_cluster=PREFIX): learner slices as XPK workloads on GKE, the syncer on its CPU VM.

XPK (`pip install xpk`; the flags used here are xpk 1.16's) runs a container image on the TPU
node pools of a GKE cluster. Each slice type gets its own cluster (PREFIX-<type>, in the slice's
zone: a GKE cluster lives in one region) and one workload of one slice, built from this
checkout's Dockerfile. A workload
of several slices would join them over DCN into one JAX program (megascale); independent
learners must not be, so the mode takes one slice per type. Every pod of learner i's
workload derives learner i's credential from Secret Manager (--token_secret: no file can be
copied into a pod), fetches the run's CA from the bucket (a public certificate) and runs
`experiments.train --role=learner --group_coordinator=auto`, which finds the slice's hosts
through the GKE TPU environment. XPK restarts a failed or preempted workload itself
(--max-restarts), with the same learner id, so `watch` is for TPU VMs only.
"""

from decoupled_diloco.errors import ConfigError
from experiments.launch import options as options_lib
from experiments.launch.hosts import Step
from experiments.launch.options import Options

MAX_RESTARTS = 100  # Preemptions a workload survives; each restart rejoins from the learner's checkpoint.
CONTAINER_DIR = "/tmp/dd"  # A pod's files of the run: the learner's credential and the CA.


def check(o: Options) -> None:
  """Refuses what the XPK mode cannot do, in one line."""
  types = [s.generation for s in o.slices]
  if len(set(types)) != len(types):
    raise ConfigError(f"--xpk_cluster runs one slice per TPU type but --slices repeats one ({', '.join(types)}): "
                      "an XPK workload of several slices would be one JAX program, not independent learners")
  if not o.token_secret:
    raise ConfigError("--xpk_cluster needs --token_secret=SECRET (Secret Manager): pods derive their learner "
                      "credential from it, no credential file can be copied into them")
  if o.tls == "given":
    raise ConfigError("--xpk_cluster serves TLS with the run's generated CA: drop --tls_cert/--tls_key")


def image(o: Options) -> str:
  """The container image built from this checkout."""
  return o.image or f"gcr.io/{o.project}/decoupled-diloco:{o.run_name}"


def cluster(o: Options, index: int) -> tuple[str, ...]:
  """`--cluster=PREFIX-<type> --zone=Z --project=P` of slice `index`."""
  tpu = o.slices[index]
  return f"--cluster={o.xpk_cluster}-{tpu.generation}", f"--zone={tpu.zone}", f"--project={o.project}"


def workload(o: Options, index: int) -> str:
  """The name of learner `index`'s workload."""
  return f"{o.run_name}-{index}"


def up(o: Options) -> list[Step]:
  """One GKE cluster with one slice's node pool per slice type (Spot with --spot)."""
  return [
      Step(f"create the XPK cluster for slice {i} ({tpu.accelerator})",
           ("xpk", "cluster", "create", *cluster(o, i), f"--tpu-type={tpu.accelerator}", "--num-slices=1",
            "--spot" if o.spot else "--on-demand")) for i, tpu in enumerate(o.slices)]


def build(o: Options) -> list[Step]:
  """The container image, built from this checkout's Dockerfile and pushed."""
  extras = f"--build-arg=EXTRAS={o.extras}" if o.extras else "--build-arg=EXTRAS="
  return [
      Step(f"build the image {image(o)} from this checkout",
           ("docker", "build", extras, "-t", image(o), options_lib.repo())),
      Step(f"push {image(o)}", ("docker", "push", image(o)))]


def publish_ca(o: Options) -> Step:
  """The run's CA (public) into the bucket, where pods fetch it."""
  return Step("copy the run's CA to the bucket",
              ("gcloud", "storage", "cp", options_lib.ca_file(o), f"{o.run_workdir}/tls_ca.pem"))


def publish_files(o: Options) -> list[Step]:
  """The files every process reads besides the code (options.shipped: the config, a tokenizer) into the bucket,
  where pods fetch them: the image holds only the checkout."""
  return [
      Step(f"copy {what} to the bucket", ("gcloud", "storage", "cp", local, f"{o.run_workdir}/launch/{name}"))
      for what, local, name in options_lib.shipped(o)]


def learner_command(o: Options, index: int, address: str) -> str:
  """What every pod of learner `index`'s workload runs."""
  d = CONTAINER_DIR
  args = [*options_lib.train_args(o, d), *options_lib.learner_args(o, index, address, d)]
  fetch = "".join(
      f"gcloud storage cp {o.run_workdir}/launch/{name} {d}/{name}; " for _, _, name in options_lib.shipped(o))
  return (f"set -e; mkdir -p -m 700 {d}; {options_lib.fetch_secret(o)} | python -m experiments.credentials learner "
          f"--secret_file=- --learner={index} --out={d}/token; {fetch}" +
          (f"gcloud storage cp {o.run_workdir}/tls_ca.pem {d}/tls_ca.pem; " if o.tls == "generated" else "") +
          f"python -m experiments.train {' '.join(args)} --config.service.token_file={d}/token "
          f"--config.service.local_dir={d}/local")  # Its lock needs a local disk: the workdir is gs://.


def start_learner(o: Options, index: int, address: str) -> Step:
  """Learner `index` as one XPK workload of one slice."""
  return Step(f"start learner {index} as XPK workload {workload(o, index)} ({o.slices[index].accelerator})",
              ("xpk", "workload", "create", *cluster(o, index), f"--workload={workload(o, index)}",
               f"--tpu-type={o.slices[index].accelerator}", "--num-slices=1", f"--docker-image={image(o)}",
               f"--max-restarts={MAX_RESTARTS}", f"--command={learner_command(o, index, address)}"))


def down(o: Options) -> list[Step]:
  """Every learner workload and its cluster."""
  steps = [
      Step(f"delete the workload {workload(o, i)}",
           ("xpk", "workload", "delete", *cluster(o, i), f"--workload={workload(o, i)}", "--force"))
      for i in range(len(o.slices))]
  return steps + [
      Step(f"delete the XPK cluster of slice {i}", ("xpk", "cluster", "delete", *cluster(o, i), "--force"))
      for i in range(len(o.slices))]

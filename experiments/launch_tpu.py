r"""Runs a networked Decoupled DiLoCo job on Cloud TPU slices of mixed types (v5p, v6e, ...), end to end.

One learner group per slice (every host of the slice runs the learner process: one multi-host
JAX program), the syncer service on its own CPU VM (an n2-highmem sized from the plan's
syncer host bytes), the workdir, the prepared data and the checkpoints in a GCS bucket:

  python -m experiments.launch_tpu up     --config=configs/tpu_1b.py --slices=v5p-128@us-east5-a,v6e-64@us-east1-d \
      --project=my-project --run_name=dd-1b [--spot | --queued] [--dry_run]
  python -m experiments.launch_tpu start  ...same flags...   # code, credentials, TLS, data, syncer, learners
  python -m experiments.launch_tpu status ...                # per learner: steps, version, staleness, last push
  python -m experiments.launch_tpu watch  ...                # recreate preempted slices, restart their learners
  python -m experiments.launch_tpu logs   ...
  python -m experiments.launch_tpu down   ...                # slices and VM deleted, the bucket kept

Without a verb it runs `up` (unless --reuse) then `start`. --dry_run prints every command of
a verb (one per line, after a `#` line saying what it does) and runs nothing; the syncer's IP,
unknown then, shows as SYNCER_IP. --xpk_cluster=PREFIX runs the learner slices as XPK workloads
on GKE instead (a container image from this checkout's Dockerfile). No secret ever appears
on a command line: the syncer's host gets the run secret, slice i's hosts only learner i's
credential. TLS is on by default (a CA made once per run on this machine signs the syncer's
certificate; learners get the CA like their credential); --insecure serves plaintext and
says so loudly. docs/launch.md walks through a run.
"""

from experiments.launch import cli
from experiments.launch.cli import plan
from experiments.launch.hosts import Slice, parse_slices
from experiments.launch.options import Options, check

__all__ = ["Options", "Slice", "check", "parse_slices", "plan"]

if __name__ == "__main__":
  cli.run()

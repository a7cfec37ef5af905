r"""Runs a networked Decoupled DiLoCo job on Cloud TPU VM slices of mixed types (v5p, v6e, ...).

One learner group per slice (all its hosts run the learner process, one multi-host JAX
program), and the syncer service on worker 0 of the first slice (forced onto its CPU) or
on a small CPU VM (--syncer_vm=NAME@ZONE):

  python -m experiments.launch_tpu --config=configs/tpu_1b.py --config.mode=decoupled \
      --slices=v5p-128@us-east5-a,v6e-64@us-east1-d --project=my-project --run_name=dd-1b --dry_run

Steps: create the slices (unless --reuse), upload this checkout and install it in a venv on
every host, deliver the run secret to the syncer's host only and to the hosts of slice i
learner i's own credential (security.learner_credential: derived here from a local 0600
file and copied, or with --token_secret derived on the host from a Secret Manager fetch
that is never stored there), look up the syncer's internal IP, make TLS certificates for
it, start the syncer bound to 0.0.0.0, start learner i on every worker of slice i with
--syncer=IP:PORT (pushes' payloads go to its data channel on PORT + 1). No secret ever
appears on a command line; `--config.*` overrides reach every process. --dry_run prints
each command (one per line, after a `#` line saying what it does) and runs nothing; the
syncer's IP, unknown then, shows as SYNCER_IP.

TLS is on by default: a self-signed CA made once per run on this machine
(~/.config/decoupled_diloco/<run_name>/tls/ca.pem; its key stays here) signs a certificate
naming the syncer's address; learners trust the CA. --tls_cert/--tls_key use your own
certificate instead (it must name the syncer's IP). --insecure serves plaintext, which
sends credentials and parameters in clear over the network: it must be asked for, and the
launcher says so loudly.
"""

from experiments.launch import cli
from experiments.launch.deploy import plan
from experiments.launch.hosts import Slice, parse_slices
from experiments.launch.options import Options, check

__all__ = ["Options", "Slice", "check", "parse_slices", "plan"]

if __name__ == "__main__":
  cli.run()

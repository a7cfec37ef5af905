r"""How much of a learner process's wall-clock goes to waiting on the syncer, with overlap on.

  python -m experiments.benchmarks.learner_blocking

A real local run: the syncer service and two learner processes (experiments.launch_local's
LocalCluster, gRPC over loopback), Decoupled DiLoCo on the demo model. A learner pushes
round r's pseudo-gradient and pulls the newest Θ on a background thread while the next
τ = H − 1 steps compute (streaming.overlap_steps, --overlap_steps); it is blocked only when
that exchange has not finished by then (and for the final acknowledgement). Each learner's `learner_summary` record splits its
wall-clock (from its first step to its exit) into compute and blocked seconds. Key
`blocked_fraction`: the largest learner's blocked / wall (target <= 0.02), next to what the
same exchanges would cost a learner that waited for each one (`exchange_fraction`: its
background push + pull seconds / wall), the figure overlap hides, and the share of the
wall-clock spent on the last push's acknowledgement (`final_ack_fraction`), which no
round can hide.
"""

from experiments import cli
from experiments.benchmarks import common

OVERRIDES = ("--config.mode=decoupled", "--config.learners.devices=(1,1)", "--config.learners.batch_size=(16,16)",
             "--config.syncer.quorum=1", "--config.outer.optimizer=delayed_nesterov", "--config.outer.buffer_size=2",
             "--config.eval_every=1000", "--config.service.learner_checkpoint_every=0")


def main():
  """One local multi-process run; prints each learner's accounting and the JSON line."""
  parser = common.parser(__doc__)
  parser.add_argument("--outer_steps", type=int, default=8, help="Budget: outer_steps x inner_steps x 2 steps.")
  parser.add_argument("--inner_steps", type=int, default=25, help="H: steps per round (one push each).")
  parser.add_argument("--overlap_steps", type=int, default=None, help="τ: steps an exchange may take (H − 1).")
  args = parser.parse_args()
  overlap = args.inner_steps - 1 if args.overlap_steps is None else args.overlap_steps
  if not 0 <= overlap < args.inner_steps:  # Else every learner process would refuse it, after the syncer started.
    cli.fail(f"--overlap_steps={overlap} must be in [0, --inner_steps={args.inner_steps}): a round's exchange must "
             "land before the next round's push")
  summaries = common.service_run([
      *OVERRIDES, f"--config.outer_steps={args.outer_steps}", f"--config.inner_steps={args.inner_steps}",
      f"--config.streaming.overlap_steps={overlap}"], 2, 1800)
  common.emit_keys(
      {
          "blocked_fraction": round(max(s["blocked_fraction"] for s in summaries), 4),
          "blocked_fraction_per_learner": [round(s["blocked_fraction"], 4) for s in summaries],
          "exchange_fraction": round(max(s["exchange_seconds"] / s["wall_seconds"] for s in summaries), 4),
          "final_ack_fraction": round(max(s["final_ack_seconds"] / s["wall_seconds"] for s in summaries), 4),
          "rounds": [s["rounds"] for s in summaries],}, ("blocked_fraction",))


if __name__ == "__main__":
  main()

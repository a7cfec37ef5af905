r"""The service on wide-area links in real time: how long learners wait on plain vs streaming exchanges.

  python -m experiments.benchmarks.wan_service [--inner_steps=8] [--outer_steps=8]

Four learner processes and the syncer (experiments.launch_local's LocalCluster, loopback),
Decoupled DiLoCo on the demo model, each learner's data-channel traffic shaped both ways by
service.link_mbps / link_latency_ms (service/link.py). The bandwidth is set so that one fp32
exchange of the whole model (its push, then its pull) takes about as long as H inner steps:
the paper's regime, scaled down. Two runs on the same links:

  p1_fp32         plain DiLoCo exchanges: P = 1, τ = 0 (the learner waits), fp32 both ways;
  streaming_int4  P = 4 fragments (balanced by bytes), τ = 2, int4 pushes, Θ_p back in
                  --downlink (compression.downlink_format; bf16 by default, the service's
                  smallest: with fp32 a fragment's pull alone takes H/8 steps). Every
learner sleeps `slowdown` × each step's compute after it (learners.slowdown), so four learners
share this machine's cores with little effect on one another's steps; H steps take
H × step_seconds, calibrated in this process on the demo learner alone, times --contention
(four two-device learners on the same cores run slower than one alone; or --step_seconds).
The line before the JSON line reports the step time the runs measured, and each run's exchange
seconds per push, so the regime can be checked. Each learner's
`learner_summary` splits its wall-clock into compute and blocked (waiting on an exchange,
the final acknowledgements included). Key `blocked_fraction` {`p1_fp32`, `streaming_int4`}:
the mean over learners of blocked / wall. Target: streaming_int4 <= 0.05 where p1_fp32 >= 0.30.
"""

import argparse
import statistics

from experiments import cli
from experiments.benchmarks import common

LEARNERS = 4
OVERLAP = 2  # τ of the streaming run: each fragment's exchange may take this many steps.
RUNS = {
    "p1_fp32": ("--config.streaming.num_fragments=1", "--config.streaming.overlap_steps=0",
                "--config.compression.format=fp32", "--config.compression.downlink_format=fp32"),
    "streaming_int4": ("--config.streaming.num_fragments=4", "--config.streaming.strategy=balanced",
                       f"--config.streaming.overlap_steps={OVERLAP}", "--config.compression.format=int4"),
}  # The streaming run's downlink is --downlink.


def parse_args(argv=None) -> argparse.Namespace:
  """Run length, H, the emulated slowdown and the link's latency."""
  parser = common.parser(__doc__)
  parser.add_argument("--inner_steps", type=int, default=8, help="H: steps per round.")
  parser.add_argument("--outer_steps", type=int, default=8, help="Budget: outer_steps x H x 4 steps.")
  parser.add_argument("--slowdown", type=float, default=3.0, help="Each learner sleeps this x its step's compute.")
  parser.add_argument("--latency_ms", type=float, default=10.0, help="One-way latency of every link.")
  parser.add_argument("--step_seconds", type=float, default=0.0, help="A step's wall time (0 = calibrate).")
  parser.add_argument("--contention", type=float, default=2.0, help="A step in the run / a step alone.")
  parser.add_argument("--downlink", default="bf16", choices=("fp32", "bf16"),
                      help="compression.downlink_format of the streaming run.")
  args = parser.parse_args(argv)
  if args.inner_steps <= OVERLAP:  # A merged fragment must land before it syncs again (streaming.overlap_steps).
    cli.fail(f"--inner_steps={args.inner_steps} must be > {OVERLAP}, the streaming run's tau: use "
             f"--inner_steps={OVERLAP + 1} or more")
  return args


def calibrate(slowdown: float) -> tuple[float, int]:
  """(seconds of one slowed inner step of a demo learner, bytes of its fp32 model), measured here."""
  common.use_virtual_devices(2)
  import jax  # pylint: disable=g-import-not-at-top
  from configs import demo  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.run import schedule  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import group, learner_build  # pylint: disable=g-import-not-at-top
  config = demo.get_config()
  learner = learner_build.build_learner(config, schedule.RunPlan.from_config(config), 0, group.GroupLink())
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(learner.state.params))
  for _ in range(3):  # Compiles.
    learner.timed_step()
  seconds = statistics.median(learner.timed_step(slowdown) for _ in range(20))
  learner.batches.close()
  return seconds, model_bytes


def main(argv=None):
  """Calibrates the link, runs both exchanges on it, prints each learner's accounting and the JSON line."""
  args = parse_args(argv)
  alone, model_bytes = calibrate(args.slowdown)
  step_seconds = args.step_seconds or alone * args.contention
  # One fp32 exchange (push + pull of the model) in H steps, latency included.
  transfer_seconds = args.inner_steps * step_seconds / 2 - args.latency_ms / 1e3
  mbps = model_bytes * 8 / transfer_seconds / 1e6
  print(f"step {alone * 1e3:.1f} ms alone, {step_seconds * 1e3:.1f} ms in the run (slowdown {args.slowdown}), "
        f"model {model_bytes} B: links at {mbps:.2f} Mbps, {args.latency_ms} ms, one fp32 exchange ~ "
        f"{args.inner_steps} steps")
  overrides = [
      "--config.mode=decoupled", "--config.syncer.quorum=1", "--config.outer.optimizer=delayed_nesterov",
      f"--config.outer.buffer_size={LEARNERS}", "--config.eval_every=100000",
      "--config.service.learner_checkpoint_every=0", f"--config.inner_steps={args.inner_steps}",
      f"--config.outer_steps={args.outer_steps}", f"--config.learners.slowdown={(args.slowdown,) * LEARNERS}",
      f"--config.service.link_mbps={(round(mbps, 3),) * LEARNERS}",
      f"--config.service.link_latency_ms={(args.latency_ms,) * LEARNERS}"]
  fractions, figures = {}, {}
  for name in RUNS:
    downlink = [f"--config.compression.downlink_format={args.downlink}"] if name == "streaming_int4" else []
    summaries = common.service_run([*overrides, *RUNS[name], *downlink], LEARNERS, 1200, prefix=f"{name} ")
    fractions[name] = round(statistics.mean(s["blocked_fraction"] for s in summaries), 4)
    figures[name] = {
        "max_blocked_fraction": round(max(s["blocked_fraction"] for s in summaries), 4),
        "final_ack_fraction": round(statistics.mean(s["final_ack_seconds"] / s["wall_seconds"] for s in summaries), 4),
        "step_seconds": round(statistics.mean(s["busy_seconds"] / s["steps"] for s in summaries), 4),
        "exchange_seconds_per_push": round(statistics.mean(s["exchange_seconds"] / s["rounds"] for s in summaries), 4)}
  common.emit_keys(
      {
          "benchmark": "wan_service", "blocked_fraction": fractions, "link_mbps": round(mbps, 3), "latency_ms":
              args.latency_ms, "inner_steps": args.inner_steps, "planned_step_seconds": round(step_seconds, 4),
          "model_bytes": model_bytes, "streaming_downlink_format": args.downlink, "runs": figures},
      ("blocked_fraction",))


if __name__ == "__main__":
  main()

r"""Streaming Decoupled DiLoCo on tiny Shakespeare: fragments, overlap and int4 over wide-area links.

Four learners on mixed hardware (two v6e and two v5p slices, timed as for a 1B model with
1M-token batches) sit behind 2–5 Gbit/s links. Each syncs its 3 fragments (one layer
each, strided) at staggered steps, pushes them in int4 with error feedback, keeps
training while they travel and blends the merged fragment in 2 steps later. The metrics
show the bytes each learner sent, how many of its steps ran with fragments in flight and
whether it ever stalled:

  python -m experiments.train --config=configs/streaming_shakespeare.py --workdir=/tmp/dd_streaming
  python -m experiments.train --config=configs/streaming_shakespeare.py --config.streaming.overlap_steps=0 \
    --workdir=/tmp/dd_streaming_blocking
"""

from configs import hetero_shakespeare


def get_config():
  """hetero_shakespeare's decoupled learners with streaming, int4 and WAN links; see configs/default.py."""
  config = hetero_shakespeare.get_config()
  config.learners.speed = ()
  config.learners.hardware = ("v6e", "v6e", "v5p", "v5p")  # A v6e chip has twice a v5p chip's peak.
  config.learners.chips = (16, 16, 16, 16)
  config.sim.simulated_params = 1_000_000_000  # Time steps and transfers as for a 1B model...
  config.sim.simulated_tokens_per_step = 1_048_576  # ...with 1M-token batches (~1.05 s per v6e step).
  config.sim.learner_link_gbps = (5.0, 2.0, 5.0, 2.0)  # Wide-area links between regions.
  config.sim.learner_link_latency_seconds = (0.03, 0.05, 0.03, 0.05)
  config.streaming.num_fragments = 3  # One layer each (strided), synced at steps ~H/3, 2H/3 and H.
  config.streaming.overlap_steps = 2  # tau: the merged fragment must land 2 steps after its push.
  config.streaming.alpha = 0.0
  config.compression.format = "int4"  # 4.5 bits per value with the blockwise scales.
  config.compression.error_feedback = True
  config.compression.downlink_format = "bf16"  # Theta_p comes back in bf16 (the syncer keeps fp32).
  return config

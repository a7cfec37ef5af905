r"""The headline demo: Decoupled DiLoCo across mixed TPU generations on the virtual clock.

Two v5p slices and two v6e slices of 16 chips each: a v6e chip has twice the bf16 peak of
a v5p chip, so the v6e learners step twice as fast. With DyLU they take twice the local
steps per push, the syncer merges whatever arrives (quorum 1, staleness-weighted,
Delayed Nesterov), and nobody waits. Compute and transfers are timed as for a 1B model
with 1M-token batches (~2.1 s per step on v5p-16, ~1.05 s on v6e-16) on 25 Gbit/s links,
while the math trains the small demo model.
One flag switches the mode (`--config.mode=diloco` for the synchronous baseline):

  python -m experiments.train --config=configs/hetero_v5p_v6e.py --workdir=/tmp/dd_hetero
  python -m experiments.train --config=configs/hetero_v5p_v6e.py --config.mode=diloco --workdir=/tmp/dd_hetero_sync

get_sweep() compares the staleness functions of the syncer (4 runs on the virtual clock):

  python -m experiments.sweep --config=configs/hetero_v5p_v6e.py --workdir=/tmp/dd_sweep_staleness
  python -m experiments.report /tmp/dd_sweep_staleness
"""

from configs import default


def get_config():
  """Decoupled DiLoCo (its defaults: DN + DyLU) on v5p + v6e profiles; see configs/default.py for every field."""
  config = default.get_config()
  config.mode = "decoupled"
  config.runtime = "sim"
  config.outer_steps = 24
  config.inner_steps = 20  # H of the fastest learner; DyLU gives slower ones proportionally fewer.
  config.learners.hardware = ("v5p", "v5p", "v6e", "v6e")
  config.learners.chips = (16, 16, 16, 16)
  config.sim.simulated_params = 1_000_000_000  # Time steps and transfers as for a 1B model...
  config.sim.simulated_tokens_per_step = 1_048_576  # ...with 1M-token batches per inner step.
  config.sim.link_gbps = 25.0  # Link per learner: 4 GB of fp32 pseudo-gradient take ~1.3 s.
  config.sim.link_latency_seconds = 0.05
  # Left to mode='decoupled''s defaults (decoupled_diloco/mode_defaults.py): quorum 1, polynomial staleness, token
  # weights, Delayed Nesterov with one momentum step per 4 merges, DyLU.
  config.eval_every = 2
  return config


def get_sweep():
  """One run per staleness function, each with the example parameters of merge.staleness_weight."""
  return [
      {"syncer.staleness": "constant"},
      {"syncer.staleness": "polynomial", "syncer.staleness_a": 0.5},
      {"syncer.staleness": "hinge", "syncer.staleness_a": 1.0, "syncer.staleness_b": 2.0},
      {"syncer.staleness": "exponential", "syncer.staleness_a": 0.69},]

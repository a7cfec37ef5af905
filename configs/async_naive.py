r"""Naive asynchronous DiLoCo on the v5p + v6e profiles: every arrival goes straight through Nesterov.

The baseline that Delayed Nesterov and DyLU fix (Liu et al. 2024): quorum 1, no staleness
weighting, fixed H for every learner, outer Nesterov applied to each single push.

  python -m experiments.train --config=configs/async_naive.py --workdir=/tmp/dd_async_naive
"""

from configs import hetero_v5p_v6e


def get_config():
  """configs/hetero_v5p_v6e.py without DN, DyLU or staleness weighting."""
  config = hetero_v5p_v6e.get_config()
  config.outer.optimizer = "sgd"  # Nesterov on every arrival.
  config.syncer.staleness = "constant"  # No staleness damping.
  config.policy.kind = "fixed"  # Same H for fast and slow learners.
  return config

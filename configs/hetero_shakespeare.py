r"""Decoupled DiLoCo (DN + DyLU) on tiny Shakespeare with two fast and two slow learners (2:1).

The setting of `experiments.benchmarks.hetero_quality`, which derives its rows (ddp, sync
DiLoCo, naive async, homogeneous) from this config by overrides, reading the same text from a
plain file (`--data_path`). Here it comes through TFDS, as in configs/tiny_shakespeare.py:

  python -m experiments.train --config=configs/hetero_shakespeare.py --workdir=/tmp/dd_hetero_shakespeare
  python -m experiments.train --config=configs/hetero_shakespeare.py --config.mode=diloco --workdir=/tmp/dd_hs_sync
"""

from configs import tiny_shakespeare


def get_config():
  """Relative speeds (2, 2, 1, 1) on the virtual clock; see configs/default.py for every field."""
  config = tiny_shakespeare.get_config()
  config.mode = "decoupled"
  config.runtime = "sim"
  config.outer_steps = 10  # Token budget: 10 x 20 x 4 steps of 16 x 128 tokens, as sync DiLoCo's 10 rounds.
  config.inner_steps = 20  # H of the fast learners; DyLU gives the slow ones 10.
  config.learners.speed = (2.0, 2.0, 1.0, 1.0)  # Steps per virtual second.
  config.syncer.quorum = 1
  config.syncer.staleness = "polynomial"
  config.outer.optimizer = "delayed_nesterov"
  config.outer.buffer_size = 4  # One momentum step per 4 merges (each one arrival, quorum 1).
  config.policy.kind = "dylu"
  config.eval_every = 1
  return config

r"""The data-parallel baseline every claim is measured against: one group over all 8 devices.

Its batch (64) is the sum of configs/diloco_sync.py's four groups' batches, and it takes
the same number of steps, so both runs see the same tokens; evals happen every
inner_steps steps, at the same token counts as DiLoCo's outer steps.

  python -m experiments.train --config=configs/ddp_baseline.py --workdir=/tmp/dd_ddp
"""

from configs import diloco_sync


def get_config():
  """Plain data-parallel AdamW; see configs/default.py for every field."""
  config = diloco_sync.get_config()
  config.mode = "ddp"
  config.learners.devices = (8,)  # One group over every device.
  config.learners.batch_size = (64,)  # = 4 DiLoCo groups x 16 sequences.
  return config

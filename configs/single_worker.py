r"""The single-worker baseline: one device, one DiLoCo group's batch, plain AdamW.

DiLoCo's claim is to beat this with M workers at the same per-worker compute.

  python -m experiments.train --config=configs/single_worker.py --workdir=/tmp/dd_single
"""

from configs import diloco_sync


def get_config():
  """One group of one device with one DiLoCo learner's batch; see configs/default.py."""
  config = diloco_sync.get_config()
  config.mode = "ddp"
  config.learners.devices = (1,)  # One device.
  config.learners.batch_size = (16,)  # One DiLoCo group's batch.
  return config

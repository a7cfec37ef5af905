r"""Synchronous DiLoCo with the paper's outer optimizer (Nesterov, lr 0.7, momentum 0.9).

The same model, data and token budget as configs/ddp_baseline.py, so the two compare
directly: 4 learner groups of 2 devices each sync every H = inner_steps steps.

  python -m experiments.train --config=configs/diloco_sync.py --workdir=/tmp/dd_diloco
  python -m experiments.train --config=configs/diloco_sync.py --config.inner_steps=50 --workdir=/tmp/dd_h50
"""

from configs import default


def get_config():
  """DiLoCo M=4; see configs/default.py for every field."""
  config = default.get_config()
  config.outer_steps = 30
  config.inner_steps = 25
  return config

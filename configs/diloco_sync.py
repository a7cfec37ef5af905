r"""Synchronous DiLoCo with the paper's outer optimizer (Nesterov, lr 0.7, momentum 0.9).

The same model, data and token budget as configs/ddp_baseline.py, so the two compare
directly: 4 learner groups of 2 devices each sync every H = inner_steps steps.

  python -m experiments.train --config=configs/diloco_sync.py --workdir=/tmp/dd_diloco
  python -m experiments.train --config=configs/diloco_sync.py --config.inner_steps=50 --workdir=/tmp/dd_h50

get_sweep() is the outer-lr x H ablation at this token budget (9 runs, one after another):

  python -m experiments.sweep --config=configs/diloco_sync.py --workdir=/tmp/dd_sweep_lr_h
  python -m experiments.report /tmp/dd_sweep_lr_h
"""

from configs import default
from decoupled_diloco.research import sweep


def get_config():
  """DiLoCo M=4; see configs/default.py for every field."""
  config = default.get_config()
  config.outer_steps = 30
  config.inner_steps = 25
  return config


def get_sweep():
  """Outer lr x H, with outer_steps moving with H so that every run sees the same 750 inner steps."""
  return sweep.product(sweep.zip_(**{"inner_steps": [10, 25, 50], "outer_steps": [75, 30, 15]}),
                       **{"outer.lr": [0.5, 0.7, 1.0]})

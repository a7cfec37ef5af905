r"""Mixture of experts on tiny Shakespeare through TFDS: 8 experts, top-2, each learner group's experts
split over its 2 devices (layout expert=2), synchronous DiLoCo as configs/tiny_shakespeare.py.

Every block routes each byte to 2 of 8 experts of width 192, so a token runs through MLP width
2 x 192 = 384, tiny_shakespeare.py's dense d_ff: equal active params (and FLOPs per token), four
times the expert params. docs/moe.md explains the options and the records.

  python -m experiments.train --config=configs/moe_shakespeare.py --workdir=/tmp/dd_moe
  python -m experiments.train --config=configs/moe_shakespeare.py --workdir=/tmp/dd_moe_dec \
      --config.mode=decoupled --config.runtime=sim
"""

from configs import tiny_shakespeare


def get_config():
  """tiny_shakespeare.py's model with every MLP an 8-expert top-2 MoE of equal active width."""
  config = tiny_shakespeare.get_config()
  config.model.moe.num_experts = 8
  config.model.moe.top_k = 2
  config.model.moe.d_ff = 192
  config.model.moe.capacity_factor = 1.25
  # 10x the default: at 0.01 a 60-step run dropped 20% of assignments and ended above the dense model (docs/moe.md).
  config.model.moe.aux_loss_weight = 0.1
  config.learners.layouts = ("expert=2",) * len(config.learners.devices)
  return config

r"""The embedded default: synchronous DiLoCo, 4 learner groups of 2 devices, synthetic language.

Finishes in a few minutes on 2 CPU cores with a clearly falling loss and reports its
distance to the synthetic language's exact optimum.

  python -m experiments.train --config=configs/demo.py --workdir=/tmp/dd_demo
"""

from configs import default


def get_config():
  """Default DiLoCo settings on a ~100k-parameter model; see configs/default.py for every field."""
  config = default.get_config()
  config.outer_steps = 30
  config.inner_steps = 25
  return config

r"""Synchronous DiLoCo on tiny Shakespeare through TFDS (byte-level, 4 groups of 2 devices).

TFDS downloads the text on first use (preparing it needs `pip install -e '.[tfds]'`). Without a
network, point TFDS at a data dir prepared elsewhere (docs/data.md, "Tiny Shakespeare offline"):

  python -m experiments.train --config=configs/tiny_shakespeare.py --workdir=/tmp/dd_shakespeare
  TFDS_DATA_DIR=/tmp/tfds python -m experiments.train --config=configs/tiny_shakespeare.py --workdir=/tmp/dd_shakespeare
"""

from configs import default


def get_config():
  """A ~0.4M-parameter byte model on tiny Shakespeare; see configs/default.py for every field."""
  config = default.get_config()
  config.data.source = "tfds"
  config.data.tfds_name = "tiny_shakespeare"
  config.model.seq_len = 128
  config.model.d_model = 96
  config.model.num_layers = 3
  config.model.d_ff = 384
  config.outer_steps = 20
  config.inner_steps = 25
  config.inner.lr = 2e-3
  return config

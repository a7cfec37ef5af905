r"""Synchronous DiLoCo on tiny Shakespeare through TFDS (byte-level, 4 groups of 2 devices).

TFDS downloads the text on first use. Offline, prepare a TFDS data dir from a local copy
(see ../shared/data/README.md) and point at it:

  python -m experiments.train --config=configs/tiny_shakespeare.py \
    --config.data.tfds_data_dir=/tmp/tfds --workdir=/tmp/dd_shakespeare
  # or read the plain file directly:
  python -m experiments.train --config=configs/tiny_shakespeare.py --config.data.source=text_file \
    --config.data.path=../shared/data/tinyshakespeare.txt --workdir=/tmp/dd_shakespeare_file
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

r"""A ~1B-parameter DiLoCo run over two TPU slices (v5p-128 and v6e-64 class), FSDP inside each.

Validated on CPU by the tests (shapes only, nothing allocated); run it on a Cloud TPU VM
that sees 128 chips, on C4 through TFDS (ArrayRecord; docs/data.md prepares it), byte-level or
with a SentencePiece model:

  python -m experiments.train --config=configs/tpu_1b.py --workdir=gs://BUCKET/dd_1b \
      [--config.data.tokenizer=sentencepiece --config.data.tokenizer_path=PATH.model]
"""

from configs import default


def get_config():
  """DiLoCo paper defaults (H=500, inner lr 4e-4, warmup 1000) at ~1B params."""
  config = default.get_config()
  config.outer_steps = 200
  config.inner_steps = 500  # H = 500 as in DiLoCo.
  config.model.seq_len = 2048
  config.model.d_model = 2048
  config.model.num_layers = 20  # ~1.0B parameters with d_ff 8192.
  config.model.num_heads = 16
  config.model.d_ff = 8192
  config.model.dtype = "bfloat16"
  config.data.source = "tfds"
  config.data.tfds_name = "c4/en"
  config.learners.devices = (64, 64)  # Two slices of 64 chips each.
  config.learners.batch_size = (256, 256)  # 512 sequences x 2048 tokens per inner step in total.
  config.learners.fsdp = True
  config.inner.lr = 4e-4
  config.inner.warmup_steps = 1000
  config.eval_batch_size = 256
  config.eval_every = 10
  config.log_every = 50
  config.checkpoint_every = 10
  return config

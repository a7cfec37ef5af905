r"""A ~1B-parameter run over two TPU generations: a v5p-128 slice (64 chips) and a v6e-64 slice (64 chips).

Each group has its own layout: the v5p slice (95 GB per chip) runs data × FSDP, the v6e slice
(32 GB per chip) FSDP × tensor, both with per-block remat and scanned layers. Check that every
group fits and whether the exchange hides under compute, on any machine (no TPU needed):

  python -m experiments.plan --config=configs/tpu_1b.py

Run it on Cloud TPU (docs/launch.md walks through it): one learner process per slice, every host
of a slice running it as one multi-host JAX program, the syncer on its own CPU VM, the workdir
and the data (C4 via TFDS as ArrayRecord, docs/data.md) in a GCS bucket; byte-level or with a
SentencePiece model (--config.data.tokenizer=sentencepiece --config.data.tokenizer_path=PATH.model):

  python -m experiments.launch_tpu up --config=configs/tpu_1b.py --slices=v5p-128@us-east5-a,v6e-64@us-east1-d \
      --project=my-project --run_name=dd-1b --spot --dry_run
  python -m experiments.launch_tpu start --config=configs/tpu_1b.py --slices=v5p-128@us-east5-a,v6e-64@us-east1-d \
      --project=my-project --run_name=dd-1b --dry_run
  (then status, watch, logs, down with the same flags; drop --dry_run to run them)

What `start` runs on every host of slice i (one process of a config with two groups cannot run it:
`experiments.train --role=local` refuses and names this launcher):

  python -m experiments.train --config=configs/tpu_1b.py --workdir=gs://BUCKET/dd-1b --role=learner \
      --learner_id=i --group_coordinator=auto --syncer=SYNCER_IP:50051 --config.service.token_file=... \
      --config.service.tls_ca=...
"""

from configs import default


def get_config():
  """DiLoCo paper defaults (H=500, inner lr 4e-4, warmup 1000) at ~1B params, v5p + v6e."""
  config = default.get_config()
  config.mode = "decoupled"
  config.runtime = "service"  # One learner process per slice (experiments.launch_tpu starts them).
  config.outer_steps = 200
  config.inner_steps = 500  # H = 500 as in DiLoCo.
  config.model.seq_len = 2048
  config.model.d_model = 2048
  config.model.num_layers = 20  # ~1.0B parameters with d_ff 8192.
  config.model.num_heads = 16
  config.model.d_ff = 8192
  config.model.dtype = "bfloat16"
  config.model.remat = "full"  # Keeps each block's input only: activations fit a v6e chip.
  config.model.scan_layers = True  # Compile time flat in depth.
  config.model.attention = "auto"  # Splash (flash) attention on TPU.
  config.data.source = "tfds"
  config.data.tfds_name = "c4/en"
  config.learners.devices = (64, 64)  # v5p-128 (64 chips) and v6e-64 (64 chips).
  config.learners.hardware = ("v5p", "v6e")
  config.learners.layouts = ("data=2,fsdp=32", "fsdp=32,tensor=2")
  config.learners.batch_size = (256, 256)  # 512 sequences x 2048 tokens per inner step in total.
  config.learners.mfu = 0.4
  config.sim.link_gbps = 25.0  # Data-center network between a slice and the syncer.
  config.sim.link_latency_seconds = 0.05
  config.streaming.num_fragments = 4  # Streaming: a quarter of the model syncs every H/4 steps...
  config.streaming.overlap_steps = 5  # ...and may land 5 steps late (tau) while training goes on.
  config.compression.format = "bf16"
  # The syncer host must never run a 1B model (runconfig.SYNCER_EVAL_MAX_PARAMS): an evaluator process on its own
  # single-host slice (launch_tpu --evaluator_slice, e.g. v5p-8: 4 chips) reads Θ and evaluates it.
  config.service.evaluate_on = "evaluator"
  config.service.evaluator_devices = 4
  config.inner.lr = 4e-4
  config.inner.warmup_steps = 1000
  config.eval_batch_size = 256
  config.eval_every = 10
  config.log_every = 50
  config.checkpoint_every = 10
  return config

r"""A Llama-3-8B-shaped model under Decoupled DiLoCo over a v5p-512 slice (256 chips) and a v6e-256 slice (256 chips).

RoPE, SwiGLU, grouped-query attention (32 query / 8 key-value heads), a 128k subword vocabulary
(untied), 4096-token context; per-block remat, scanned layers, chunked cross-entropy. The v5p
slice runs data × FSDP, the v6e slice FSDP × tensor. Streaming fragments (P = 8) in bf16 with
τ = 4 overlap steps hide the exchange on 50 Gbit/s links. Plan it on any machine (no TPU):

  python -m experiments.plan --config=configs/tpu_8b.py

Launch it (one learner process per slice, the syncer on its own CPU VM, an n2-highmem sized
from the plan's syncer host bytes; docs/launch.md walks through a run):

  python -m experiments.launch_tpu up --config=configs/tpu_8b.py --slices=v5p-512@us-east5-a,v6e-256@us-east1-d \
      --project=my-project --run_name=dd-8b --queued --dry_run
  python -m experiments.launch_tpu start --config=configs/tpu_8b.py --slices=v5p-512@us-east5-a,v6e-256@us-east1-d \
      --project=my-project --run_name=dd-8b --dry_run

The vocabulary needs a subword tokenizer of 128,256 pieces; the byte-level pipeline feeds it
bytes (ids < 256), which runs but wastes the table.
"""

from configs import tpu_1b


def get_config():
  """Decoupled DiLoCo (quorum 1, staleness-weighted) at 8B: the 1B run's slices, data and cadence, scaled up."""
  config = tpu_1b.get_config()  # Decoupled service over a v5p and a v6e slice, C4, bf16, remat, scanned layers.
  config.outer_steps = 100
  config.model.vocab_size = 128_256
  config.model.seq_len = 4096
  config.model.d_model = 4096
  config.model.num_layers = 32
  config.model.num_heads = 32
  config.model.num_kv_heads = 8
  config.model.d_ff = 14_336
  config.model.position = "rope"
  config.model.rope_theta = 500_000.0
  config.model.mlp = "swiglu"
  config.model.loss_chunk = 2048  # Logits over 128k pieces never held for the whole batch in float32.
  config.learners.devices = (256, 256)  # v5p-512 (256 chips) and v6e-256 (256 chips).
  config.learners.layouts = ("data=2,fsdp=128", "fsdp=128,tensor=2")  # 2 x 1M tokens per inner step.
  config.sim.link_gbps = 50.0
  config.streaming.num_fragments = 8
  config.streaming.overlap_steps = 4
  config.syncer.quorum = 1
  config.syncer.staleness = "polynomial"
  config.outer.optimizer = "delayed_nesterov"
  config.outer.buffer_size = 2
  config.inner.lr = 3e-4
  return config

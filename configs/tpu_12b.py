r"""The paper's headline shape: a Gemma-style 12B model under Decoupled DiLoCo over four slices, two v6e and two v5p.

Gemma-3-12B's shape (d_model 3840, 48 layers, 16 query / 8 key-value heads, MLP 15360, a 262k
vocabulary tied to the output layer, RoPE, 8192-token context) in this framework's blocks
(SwiGLU, head dim d_model / heads = 240): 11.8B parameters. Four learner groups of 256 chips
each, v6e-256 slices as FSDP × tensor and v5p-512 slices as data × FSDP × tensor, per-block remat and
scanned layers. Streaming (P = 8 fragments, τ = 8 overlap steps) with int4 pushes and error
feedback hides the exchange on 50 Gbit/s links. Plan it on any machine (no TPU):

  python -m experiments.plan --config=configs/tpu_12b.py --xla=false   # analytic, seconds
  python -m experiments.plan --config=configs/tpu_12b.py               # + XLA's compile per slice (long)

Parameters and AdamW state are created sharded on each slice (decoupled_diloco/sharded_init.py),
so start-up never holds the model on one chip; the plan prints the start-up peak beside the step's.
The syncer's CPU VM must hold what the plan's syncer line says (Θ, Delayed Nesterov's momentum and
window sum, the merge's sums and its scratch, one received tensor). Launch as configs/tpu_8b.py
says, with four --slices. The vocabulary wants a SentencePiece model of 262,144 pieces
(--config.data.tokenizer=sentencepiece); the byte-level pipeline runs but wastes the table.
"""

from configs import tpu_8b


def get_config():
  """Decoupled DiLoCo at 12B over v6e, v6e, v5p, v5p: the 8B run's data and cadence, Gemma-3-12B's shape."""
  config = tpu_8b.get_config()
  config.model.vocab_size = 262_144
  config.model.tie_embeddings = True  # Gemma ties the input embedding and the output layer.
  config.model.seq_len = 8192
  config.model.d_model = 3840
  config.model.num_layers = 48
  config.model.num_heads = 16
  config.model.num_kv_heads = 8
  config.model.d_ff = 15_360
  config.model.rope_theta = 1_000_000.0
  config.model.loss_chunk = 1024  # 262k-wide logits never held for the whole batch in float32.
  config.learners.devices = (256, 256, 256, 256)  # v6e-256 x 2 (256 chips each), v5p-512 x 2 (256 chips each).
  config.learners.hardware = ("v6e", "v6e", "v5p", "v5p")
  config.learners.layouts = ("fsdp=128,tensor=2",) * 2 + ("data=2,fsdp=64,tensor=2",) * 2
  config.learners.batch_size = (128, 128, 128, 128)  # 4 x 1M tokens per inner step.
  config.sim.link_gbps = 50.0
  config.streaming.num_fragments = 8
  config.streaming.overlap_steps = 8
  config.compression.format = "int4"
  config.compression.error_feedback = True
  return config

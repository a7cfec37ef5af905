"""The round trip's run (tests/test_launch_roundtrip.py): two one-chip learner slices and a one-chip evaluator
slice, a ~30k-parameter model, long enough that a preempted learner rejoins before the run ends.

Self-contained on purpose: launch_tpu ships this file to every host, which has the packed checkout
(configs/, decoupled_diloco/, experiments/) but not tests/.
"""

from configs import default


def get_config():
  """configs/default.py with a tiny model as a service run sized for CPU processes on one machine."""
  config = default.get_config()
  config.mode = "decoupled"
  config.runtime = "service"
  # tests/helpers.tiny_config's ~30k-parameter model, restated: tests/ is not shipped, so it cannot be imported.
  config.model.seq_len = 16
  config.model.d_model = 32
  config.model.num_layers = 1
  config.model.num_heads = 2
  config.model.d_ff = 64
  config.data.synthetic.num_tokens = 60_000
  config.learners.devices = (1, 1)
  config.learners.batch_size = (4, 4)
  config.outer_steps = 2000  # Longer than the test: `down` ends it.
  config.inner_steps = 4
  config.inner.warmup_steps = 2
  config.outer.optimizer = "delayed_nesterov"
  config.outer.buffer_size = 2
  config.eval_every = 10
  config.eval_batches = 1
  config.service.evaluate_on = "evaluator"
  config.service.evaluator_devices = 1
  config.service.lease_seconds = 3.0
  config.service.learner_checkpoint_every = 2
  config.service.checkpoint_every_merges = 8
  config.service.linger_seconds = 30.0
  config.service.retry_seconds = 120.0
  config.service.rpc_timeout_seconds = 20.0
  config.service.chunk_bytes = 64 << 10
  return config

r"""A tiny networked run for the service tests: 2 learner groups (2 and 1 devices), short leases.

  python -m experiments.launch_local --config=tests/service_config.py --workdir=/tmp/dd_service_test
"""

from tests import helpers


def get_config():
  """helpers.tiny_config() in decoupled mode with service settings sized for tests."""
  config = helpers.tiny_config()
  config.mode = "decoupled"
  config.runtime = "service"
  config.learners.devices = (2, 1)
  config.learners.batch_size = (4, 4)
  config.outer_steps = 10
  config.inner_steps = 4
  config.outer.optimizer = "delayed_nesterov"  # Quorum 1: one momentum step per M arrivals, as in hetero_v5p_v6e.
  config.outer.buffer_size = 2
  config.syncer.grace_gamma = 0.0  # Each push merged on arrival, as these tests count versions; the default window
  # (mode_defaults) runs in test_grace_replies and the README's launch_local command (test_cli).
  config.eval_every = 5
  config.data.synthetic.num_tokens = 30_000
  config.service.lease_seconds = 3.0
  config.service.checkpoint_every_merges = 8
  config.service.learner_checkpoint_every = 3
  config.service.linger_seconds = 120.0
  config.service.retry_seconds = 300.0
  config.service.rpc_timeout_seconds = 20.0
  config.service.chunk_bytes = 64 << 10
  return config

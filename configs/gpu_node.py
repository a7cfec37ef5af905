r"""A ~1B-parameter Decoupled DiLoCo run on one node of 8 GPUs (H100 SXM 80 GB): four learner groups of two GPUs.

Each learner group is one process on its own two GPUs (FSDP over them), the syncer and the evaluator
on the node's CPUs: experiments.launch_local hands out the GPUs (experiments/gpu_placement.py).
bf16 compute, so attention='auto' runs cuDNN's flash kernel; per-block remat, scanned layers.
Plan it anywhere, then launch it on the node (docs/scale.md, "GPUs"):

  python -m experiments.plan --config=configs/gpu_node.py --xla=false
  pip install -e '.[cuda]'
  python -m experiments.launch_local --config=configs/gpu_node.py --workdir=/tmp/dd_gpu_node

Other nodes: --config.learners.hardware='("h200",)*4' (or a100, h100_pcie, b200, l40s), two groups of
four GPUs with --config.learners.devices='(4,4)' --config.learners.batch_size='(64,64)'. The data is
tpu_1b's (C4 through TFDS, prepared beforehand: docs/data.md).
"""

from configs import tpu_1b


def get_config():
  """tpu_1b's 1B model, data and cadence on four H100 pairs of one node."""
  config = tpu_1b.get_config()
  config.learners.devices = (2, 2, 2, 2)
  config.learners.hardware = ("h100",) * 4
  config.learners.layouts = ("fsdp=2",) * 4
  config.learners.batch_size = (32, 32, 32, 32)  # 4 x 32 sequences x 2048 tokens per inner step.
  config.sim.link_gbps = 0.0  # One node: the exchange runs over loopback.
  config.sim.link_latency_seconds = 0.0
  config.streaming.num_fragments = 1
  config.streaming.overlap_steps = 0
  # tpu_1b's evaluator process evaluates Θ; launch_local runs it on the node's CPUs (every GPU is a learner's):
  # slow at 1B, but off the learners' path. Lower eval_every's cost with --config.eval_batches.
  config.service.evaluator_devices = 1
  return config

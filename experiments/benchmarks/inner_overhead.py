"""Framework inner step vs a bare hand-written jax.jit + optax AdamW loop, same run.

Both train the same model on the same devices with the same batch size; the framework
side is a real DiLoCo learner group (data shard, sharded jit, donation, loss bookkeeping).
Target: ratio = framework / bare seconds per step <= 1.03.

  python -m experiments.benchmarks.inner_overhead [--blocks=15] [--steps=10]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from configs import default  # noqa: E402
from decoupled_diloco import experiment, model as model_lib  # noqa: E402
from experiments import cli  # noqa: E402

STEPS_PER_BLOCK = 10
BLOCKS = 15


def benchmark_config():
  """One 4-device group, a model big enough that compute, not dispatch, dominates a step."""
  config = default.get_config()
  config.mode = "ddp"
  config.learners.devices = (4,)
  config.learners.batch_size = (16,)
  config.model.seq_len = 128
  config.model.d_model = 128
  config.model.num_layers = 2
  config.model.d_ff = 512
  config.outer_steps = 1000
  config.data.synthetic.num_tokens = 400_000
  return config


def bare_loop(config, devices, steps: int = STEPS_PER_BLOCK):
  """The hand-written baseline: params, AdamW, a jitted donated step, batches from numpy."""
  model, params, _ = model_lib.build_model(config.model, config.seed)
  mesh = jax.make_mesh((len(devices),), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
  replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(config.inner.lr, weight_decay=0.1))
  params = jax.device_put(params, replicated)
  opt_state = jax.jit(optimizer.init)(params)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(model.loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, donate_argnums=(0, 1))
  rng = np.random.default_rng(0)
  batches = [
      rng.integers(0, 256, (config.learners.batch_size[0], config.model.seq_len + 1), dtype=np.int32)
      for _ in range(steps)]
  state = {"params": params, "opt_state": opt_state}

  def run_block():
    for batch in batches:
      state["params"], state["opt_state"], loss = step(state["params"], state["opt_state"],
                                                       jax.device_put(batch, split))
    jax.block_until_ready(loss)

  return run_block


def framework_loop(config, devices, steps: int = STEPS_PER_BLOCK):
  """The framework's learner group taking inner steps exactly as the runtime does."""
  learner = experiment.build(config, devices=devices).learners[0]

  def run_block():
    for _ in range(steps):
      learner.step()
    learner.drain_losses()

  return run_block


def main(argv=None):
  """Times both loops in alternation and prints the ratio."""
  parser = common.parser(__doc__)
  parser.add_argument("--blocks", type=int, default=BLOCKS, help="Timed blocks of --steps steps per loop.")
  parser.add_argument("--steps", type=int, default=STEPS_PER_BLOCK, help="Inner steps per block.")
  args = parser.parse_args(argv)
  if min(args.blocks, args.steps) < 1:
    cli.fail(f"--blocks={args.blocks} and --steps={args.steps} must be >= 1")
  config = benchmark_config()
  devices = jax.devices()[4:8]
  runners = {"framework": framework_loop(config, devices, args.steps), "bare": bare_loop(config, devices, args.steps)}
  medians = common.interleaved_medians(runners, args.blocks, warm_up=True)
  per_step = {name: seconds / args.steps for name, seconds in medians.items()}
  print(f"framework {per_step['framework'] * 1e3:.2f} ms/step, bare {per_step['bare'] * 1e3:.2f} ms/step")
  common.emit_keys(
      {
          "ratio": round(per_step["framework"] / per_step["bare"], 4), "framework_ms_per_step": round(
              per_step["framework"] * 1e3, 3), "bare_ms_per_step": round(per_step["bare"] * 1e3, 3)}, ("ratio",))


if __name__ == "__main__":
  main()

"""End-to-end DiLoCo on real meshes of virtual CPU devices: equivalences and resume."""

import json

import chex
import jax
import numpy as np
import pytest

from decoupled_diloco import experiment, inner, mesh, model as model_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import lockstep
from tests.helpers import tiny_config


def _params(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_one_learner_with_plain_outer_sgd_equals_plain_training(tmp_path):
  common = {"learners.devices": (2,), "learners.batch_size": (4,), "outer.lr": 1.0, "outer.momentum": 0.0}
  diloco = experiment.build(tiny_config(mode="diloco", **common))
  ddp = experiment.build(tiny_config(mode="ddp", **common))
  lockstep.run(diloco, str(tmp_path / "diloco"))
  lockstep.run(ddp, str(tmp_path / "ddp"))
  chex.assert_trees_all_close(_params(diloco.global_params), _params(ddp.global_params), atol=2e-6)


def test_outer_sgd_lr1_makes_theta_the_mean_of_the_learners(tmp_path):
  exp = experiment.build(tiny_config(**{"outer.lr": 1.0, "outer.momentum": 0.0, "outer_steps": 1}))
  lockstep.run(exp, str(tmp_path))
  mean = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *[_params(l.state.params) for l in exp.learners])
  chex.assert_trees_all_close(_params(exp.global_params), mean, atol=1e-6)
  a, b = (_params(l.state.params) for l in exp.learners)
  assert not np.allclose(a["lm_head"], b["lm_head"])  # learners really diverged


@pytest.mark.parametrize("num_devices, fsdp", [(2, False), (4, False), (4, True)])
def test_sharded_step_equals_single_device_step(num_devices, fsdp):
  config = tiny_config()
  model, params, axes = model_lib.build_model(config.model, seed=0)
  optimizer = inner.inner_optimizer(config.inner, total_steps=10)
  shapes = jax.eval_shape(lambda p: p, params)
  batch = np.random.default_rng(0).integers(0, 256, (8, config.model.seq_len + 1), dtype=np.int32)

  def three_steps(devices, shard):
    layout = mesh.Layout(fsdp=len(devices)) if shard else mesh.Layout(data=len(devices))
    loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices, layout), shapes, axes)
    state = loop.init(params)
    for _ in range(3):
      state, _ = loop.step(state, loop.put_batch(batch))
    return state

  single = three_steps(jax.devices()[:1], False)
  sharded = three_steps(jax.devices()[4:4 + num_devices], fsdp)
  chex.assert_trees_all_close(_params(sharded.params), _params(single.params), atol=1e-5)
  chex.assert_trees_all_close(_params(sharded.opt_state), _params(single.opt_state), atol=1e-5)
  if fsdp:
    kernel = sharded.params["block_0"]["mlp"]["wi"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
    assert len(kernel.addressable_shards) == num_devices
    assert kernel.addressable_shards[0].data.shape[0] == kernel.shape[0] // num_devices


def _records(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time")
  return records


@pytest.mark.slow  # Long: the fast subset leaves it to CI.
def test_resumed_run_writes_the_same_metrics_as_an_uninterrupted_one(tmp_path):
  """With int2 error feedback: the residuals each learner kept are checkpointed and sent after the resume."""
  config = tiny_config(outer_steps=4, checkpoint_every=2,
                       **{"compression.format": "int2", "compression.error_feedback": True})
  lockstep.run(experiment.build(config), str(tmp_path / "full"))
  # Interrupted after round 3: its checkpoint is at round 2 and round 3's records must go.
  lockstep.run(experiment.build(config), str(tmp_path / "cut"), stop_after=3)
  config.resume = True
  resumed = experiment.build(config)
  lockstep.run(resumed, str(tmp_path / "cut"))
  full, cut = _records(tmp_path / "full"), _records(tmp_path / "cut")
  assert [r["kind"] for r in full].count("eval") == 4
  assert cut == full
  losses = [r["eval_loss"] for r in full if r["kind"] == "eval"]
  assert losses[-1] < losses[0]


@pytest.mark.parametrize("overrides, message", [
    ({"inner_steps": 0}, "inner_steps"),
    ({"learners.devices": (4, 4, 4), "learners.batch_size": (4, 4, 4)}, "needs 12 devices"),
    ({"learners.batch_size": (4, 3)}, "not divisible"),
    ({"mode": "ddp"}, "one group"),
    ({"data.split": "sorted"}, "data.split"),])
def test_bad_configs_name_the_fix(overrides, message):
  with pytest.raises(ConfigError, match=message):
    experiment.build(tiny_config(**{k: v for k, v in overrides.items()}))

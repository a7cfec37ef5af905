"""The inner step at scale: activations sharded over the batch at 1B widths (compiled abstractly),
gradient accumulation, and scan_layers through checkpoints, fragments and RDA."""

import json
import re

import chex
import jax
import numpy as np
import pytest

from configs import tpu_1b
from decoupled_diloco import checkpoint as checkpoint_lib, experiment, inner, mesh, model as model_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import state as state_lib
from decoupled_diloco.runtime import lockstep, sim
from tests.helpers import tiny_config


def test_one_billion_widths_never_hold_the_global_batch_on_a_chip():
  """Two layers of configs/tpu_1b.py's model, FSDP over 8 virtual devices, compiled, not run.

  Without the activation constraints XLA keeps [24, 16, 2048, 2048]-shaped attention buffers
  (the global batch of 24 on every chip, ~50 GB of temporaries here); with them every buffer
  holds the chip's 3 sequences.
  """
  config = tpu_1b.get_config()
  config.model.num_layers = 2
  model, shapes, axes = model_lib.abstract_params(config.model)
  optimizer = inner.inner_optimizer(config.inner, 100)
  loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(jax.devices()[:8], mesh.Layout(fsdp=8)), shapes, axes)
  global_batch, seq_len = 24, config.model.seq_len
  compiled = loop.step.lower(*inner.abstract_inputs(loop, optimizer, shapes, global_batch, seq_len)).compile()
  text = compiled.as_text()
  buffers = {tuple(int(d) for d in dims.split(',') if d) for dims in re.findall(r'\b[a-z]+\d*\[([\d,]*)\]', text)}
  assert any(3 in dims and seq_len in dims for dims in buffers)  # the per-chip batch is there...
  assert not [dims for dims in buffers if global_batch in dims or global_batch * seq_len in dims]  # ...never all
  assert compiled.memory_analysis().temp_size_in_bytes < 12e9


def test_microbatches_equal_one_big_batch():
  config = tiny_config(**{"model.num_layers": 2})
  model, params, axes = model_lib.build_model(config.model, seed=0)
  optimizer = inner.inner_optimizer(config.inner, total_steps=10)
  shapes = jax.eval_shape(lambda p: p, params)
  batch = np.random.default_rng(0).integers(0, 256, (8, config.model.seq_len + 1), dtype=np.int32)

  def three_steps(microbatches):
    loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(jax.devices()[:2]), shapes, axes, microbatches)
    state, losses = loop.init(params), []
    for _ in range(3):  # The first has learning rate 0 (warmup), the later ones move the params.
      state, metrics = loop.step(state, loop.put_batch(batch))
      losses.append(float(metrics["loss"]))
    return jax.device_get(state), losses

  whole, whole_losses = three_steps(1)
  split, split_losses = three_steps(4)
  np.testing.assert_allclose(split_losses, whole_losses, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(split.params, whole.params, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(split.opt_state, whole.opt_state, atol=1e-5, rtol=0)
  assert whole_losses[2] < whole_losses[0]


def test_scanned_layers_take_the_same_adamw_steps_stacked_as_the_layer_loop():
  """With scan_layers the step holds and updates the blocks stacked as [L, ...] leaves: dealt back, the
  same params and moments as the per-leaf update, and weight decay still skips the (stacked, 2-D) norm scales."""
  config = tiny_config(**{"model.num_layers": 3, "inner.weight_decay": 0.5, "inner.warmup_steps": 0})
  _, params, axes = model_lib.build_model(config.model, seed=0)
  optimizer = inner.inner_optimizer(config.inner, total_steps=10)
  batch = np.random.default_rng(0).integers(0, 256, (4, config.model.seq_len + 1), dtype=np.int32)

  def two_steps(scan):
    model, _, _ = model_lib.abstract_params({**config.model, "scan_layers": scan})
    assert model.scanned_layers == (3 if scan else 0)
    loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(jax.devices()[:2]),
                                  jax.eval_shape(lambda p: p, params), axes)
    state = loop.init(params)
    for _ in range(2):
      state, metrics = loop.step(state, loop.put_batch(batch))
    assert (model_lib.STACKED in state.params) == scan  # The step holds the blocks stacked...
    return jax.device_get(loop.from_step(state)), float(metrics["grad_norm"])  # ...and deals them back.

  (loop_state, loop_norm), (scan_state, scan_norm) = two_steps(False), two_steps(True)
  assert jax.tree.structure(scan_state) == jax.tree.structure(loop_state)
  chex.assert_trees_all_close(scan_state.params, loop_state.params, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(scan_state.opt_state, loop_state.opt_state, atol=1e-5, rtol=0)
  np.testing.assert_allclose(scan_norm, loop_norm, rtol=1e-5)
  # Decay would pull the norm scales (initialised to 1) below the pure Adam update: they moved alike.
  assert not np.allclose(loop_state.params["block_0"]["attn_norm"]["scale"], 1.0)


@pytest.mark.parametrize("microbatches", [3, 4, 0])
def test_microbatches_that_do_not_split_the_batch_are_refused(microbatches):
  # Batch 4 over 2 devices: k = 2 gives 2 rows per microbatch, 1 per device; 3, 4 and 0 cannot.
  with pytest.raises(ConfigError, match="inner.microbatches"):
    experiment.validate(tiny_config(**{"inner.microbatches": microbatches}))


def _records(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time")
  return records


SCAN = {
    "model.num_layers": 2, "model.scan_layers": True, "model.remat": "full", "model.position": "rope",
    "model.mlp": "swiglu"}


def test_scan_layers_run_resumes_exactly_from_its_checkpoint(tmp_path):
  config = tiny_config(outer_steps=3, checkpoint_every=2, **SCAN)
  lockstep.run(experiment.build(config), str(tmp_path / "full"))
  lockstep.run(experiment.build(config), str(tmp_path / "cut"), stop_after=3)
  config.resume = True
  lockstep.run(experiment.build(config), str(tmp_path / "cut"))
  assert _records(tmp_path / "cut") == _records(tmp_path / "full")


def test_scan_layers_streams_fragments_and_merges_with_rda_like_the_layer_loop(tmp_path):
  """Stacking happens at trace time, so the params tree, its strided fragments and the RDA merge
  are the loop model's: the same run with and without scan_layers gives the same losses."""
  base = {
      "mode": "decoupled", "runtime": "sim", "outer_steps": 2, "inner_steps": 4, "streaming.num_fragments": 2,
      "streaming.strategy": "strided", "syncer.merge_rule": "rda", **SCAN}
  runs = {}
  for scan in (False, True):
    exp = experiment.build(tiny_config(**{**base, "model.scan_layers": scan}))
    assert sorted(set(exp.assignment)) == [0, 1]
    sim.run(exp, str(tmp_path / str(scan)))
    runs[scan] = [r["eval_loss"] for r in _records(tmp_path / str(scan)) if r["kind"] == "eval"]
  assert len(runs[True]) >= 2
  np.testing.assert_allclose(runs[True], runs[False], atol=1e-4, rtol=0)


@pytest.mark.parametrize("eod", [-1, 5])  # 5: attention segmented at the documents' ends (token 5).
def test_splash_under_a_data_by_tensor_mesh_matches_xla_attention(eod):
  """shard_map runs one (interpreted) kernel per batch and head shard; q/k/v heads sit on 'tensor'."""
  config = tiny_config(
      **{
          "model.seq_len": 128, "model.num_heads": 4, "model.num_kv_heads": 2, "model.position": "rope",
          "model.document_eod_id": eod}).model
  model, params, _ = model_lib.build_model(config, seed=0)
  splash_model, _, _ = model_lib.build_model(dict(config, attention="splash_interpret"), seed=0)
  group = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4],
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  batch = jax.device_put(
      np.random.default_rng(0).integers(0, 16, (4, 129), dtype=np.int32),
      jax.sharding.NamedSharding(group, jax.sharding.PartitionSpec("data")))

  def loss_and_grads(m):

    def under_mesh(p, b):
      with jax.sharding.use_abstract_mesh(group.abstract_mesh):
        return jax.value_and_grad(m.loss)(p, b)

    return jax.jit(under_mesh)(params, batch)

  (loss, grads), (splash_loss, splash_grads) = loss_and_grads(model), loss_and_grads(splash_model)
  np.testing.assert_allclose(splash_loss, loss, atol=1e-5, rtol=0)
  chex.assert_trees_all_close(splash_grads, grads, atol=1e-5, rtol=0)


def test_a_scanned_step_compiles_to_the_same_program_at_any_depth():
  """The step's state holds scanned blocks stacked, so its inputs and kernels do not grow with the
  layers (a state of block_i's made it read, update and write L buffers per block param)."""

  def compiled(layers):
    config = tiny_config(**{"model.num_layers": layers, "model.scan_layers": True})
    model, shapes, axes = model_lib.abstract_params(config.model)
    optimizer = inner.inner_optimizer(config.inner, 10)
    loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(jax.devices()[:2]), shapes, axes)
    state, batch = inner.abstract_inputs(loop, optimizer, shapes, 4, config.model.seq_len)
    return len(jax.tree.leaves(state)), loop.step.lower(state, batch).compile().as_text().count(" fusion(")

  (shallow_buffers, shallow_kernels), (deep_buffers, deep_kernels) = compiled(2), compiled(6)
  assert deep_buffers == shallow_buffers
  # Measured 238 -> 239 kernels; with block_i's in the state it was 286 -> 383 (and 63 -> 159 buffers).
  assert deep_kernels - shallow_kernels <= 2


def test_a_checkpoint_of_loop_layers_restores_into_a_scanned_runs_stacked_state(tmp_path):
  """Checkpoints hold block_i's whatever scan_layers says, so a run may switch it between resumes."""
  loop_exp = experiment.build(tiny_config(**{**SCAN, "model.scan_layers": False}))
  for _ in range(2):  # Moves the params and AdamW moments off their initial values.
    loop_exp.learners[0].step()
  with checkpoint_lib.Checkpointer(str(tmp_path)) as checkpointer:
    state_lib.save(checkpointer, loop_exp, 2, state_lib.metadata(loop_exp, 2))
    scan_exp = experiment.build(tiny_config(**SCAN))
    state_lib.restore(scan_exp, checkpointer, 2)
  restored = scan_exp.learners[0]
  assert model_lib.STACKED in restored.state.params and restored.steps == 2
  chex.assert_trees_all_equal(jax.device_get(restored.loop.from_step(restored.state)),
                              jax.device_get(loop_exp.learners[0].state))

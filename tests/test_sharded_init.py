"""Sharded initialisation: a learner's TrainState and the syncer's Θ are born where they live, with the seed's values."""

import math

import jax
import numpy as np
import optax
import pytest

from configs import default
from decoupled_diloco import inner, mesh, model as model_lib, sharded_init


def _model_cfg(scan_layers: bool):
  """A model whose embedding and output layer dwarf everything else: a whole one of them would show."""
  cfg = default.get_config().model
  cfg.update(dict(vocab_size=4096, d_model=64, num_layers=2, num_heads=4, d_ff=128, scan_layers=scan_layers))
  return cfg


def _loop(cfg, layout: mesh.Layout):
  model, shapes, axes = model_lib.abstract_params(cfg)
  group = mesh.group_mesh(jax.devices()[:layout.devices], layout)
  return inner.build_inner_loop(model, optax.adamw(1e-3), group, shapes, axes), shapes


def _init_stats(cfg, layout: mesh.Layout):
  loop, shapes = _loop(cfg, layout)
  compiled = loop.fresh(sharded_init.params_fn(cfg, seed=0))
  return compiled, compiled.memory_analysis(), max(4 * math.prod(x.shape) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_compiled_init_never_holds_a_whole_parameter_on_one_device(scan_layers):
  cfg = _model_cfg(scan_layers)
  compiled, stats, largest = _init_stats(cfg, mesh.Layout(fsdp=4, tensor=2))
  assert largest == 4 * 4096 * 64  # The embedding table: a whole one would show in any figure below.
  # The init's scratch on a device (random bits, draws before scaling) is smaller than one whole table ...
  assert stats.temp_size_in_bytes < largest
  # ... and all it holds at its peak is about an eighth of what a device building the whole state holds (norm
  # scales are replicated).
  _, whole, _ = _init_stats(cfg, mesh.Layout(data=8))  # Replicated: each device builds it all.
  assert whole.temp_size_in_bytes > largest
  assert sharded_init.peak_bytes(compiled) < 1.05 * (whole.output_size_in_bytes + whole.temp_size_in_bytes) / 8
  state = compiled()
  for leaf in jax.tree.leaves(state.params):
    if leaf.size >= 4096:
      assert leaf.sharding.shard_shape(leaf.shape) != leaf.shape
      assert all(shard.data.nbytes < leaf.nbytes for shard in leaf.addressable_shards)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_fresh_state_holds_the_seeds_params_bit_for_bit_and_zero_moments(scan_layers):
  cfg = _model_cfg(scan_layers)
  loop, _ = _loop(cfg, mesh.Layout(fsdp=8))
  _, eager, _ = model_lib.build_model(cfg, seed=3)
  state = loop.init_fresh(sharded_init.params_fn(cfg, seed=3))
  fresh = jax.device_get(loop.from_step(state.params))
  for want, got in zip(jax.tree.leaves(eager), jax.tree.leaves(fresh)):
    np.testing.assert_array_equal(got, want)
  assert int(state.step) == 0
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert moments and all(not np.any(jax.device_get(x)) for x in moments)


def test_host_params_are_the_seeds_params_on_the_cpu_device():
  cfg = _model_cfg(False)
  _, eager, _ = model_lib.build_model(cfg, seed=5)
  theta = sharded_init.host_params(cfg, seed=5)
  cpu = jax.local_devices(backend="cpu")[0]
  for want, got in zip(jax.tree.leaves(eager), jax.tree.leaves(theta)):
    assert got.devices() == {cpu}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  other = sharded_init.host_params(cfg, seed=6)
  assert not np.array_equal(np.asarray(other["token_embed"]), np.asarray(theta["token_embed"]))

"""Per-group mesh layouts: each learner group lays its devices out as data × fsdp × tensor of its own."""

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from decoupled_diloco import experiment, mesh
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import sim
from tests.helpers import tiny_config

MIXED = ("fsdp=2,tensor=2", "data=4")  # A 4-device FSDP + tensor group and a 4-device data-parallel group.


def _config(mode, layouts):
  return tiny_config(
      **{
          "mode": mode, "runtime": "sim", "learners.devices": (4, 4), "learners.batch_size": (8, 8),
          "learners.layouts": layouts, "syncer.quorum": 1, "learners.speed": (1.0, 2.0)})


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_rules_shard_embed_over_fsdp_and_heads_mlp_vocab_over_tensor():
  sizes = {"data": 1, "fsdp": 2, "tensor": 4}
  assert mesh.param_spec((32, 4, 8), ("embed", "heads", "kv"), sizes) == P("fsdp", "tensor", None)
  assert mesh.param_spec((64, 32), ("mlp", "embed"), sizes) == P("tensor", "fsdp")
  assert mesh.param_spec((256, 32), ("vocab", "embed"), sizes) == P("tensor", "fsdp")
  assert mesh.param_spec((32, 2, 8), ("embed", "heads", "kv"), sizes) == P("fsdp", None, None)  # 4 ∤ 2 heads
  assert mesh.param_spec((32,), ("embed",), {"data": 8, "fsdp": 1, "tensor": 1}) == P(None)


@pytest.mark.parametrize("layouts, fsdp, message", [
    (("fsdp=2,tensor=2",), False, "1 entries for 2 learner groups"),
    (("fsdp=2,tensor=2", "data=2"), False, "spans 2 devices but the group has 4"),
    (("fsdp=2,model=2", "data=4"), False, "bad entry 'model=2'"),
    (("fsdp=2,fsdp=2", "data=4"), False, "bad entry 'fsdp=2'"),
    (MIXED, True, "say fsdp=N in each layout"),])
def test_bad_layouts_are_refused_with_the_fix(layouts, fsdp, message):
  config = _config("diloco", layouts)
  config.learners.fsdp = fsdp
  with pytest.raises(ConfigError, match=message):
    experiment.validate(config)


def test_batch_must_split_over_data_times_fsdp_only():
  config = _config("diloco", ("tensor=4", "data=4"))
  config.learners.batch_size = (2, 8)  # Tensor parallelism does not split the batch: 2 sequences are fine.
  experiment.validate(config)
  config.learners.layouts = ("fsdp=4", "data=4")
  with pytest.raises(ConfigError, match="not divisible by its 4 batch shards"):
    experiment.validate(config)


@pytest.mark.parametrize("mode", ["diloco", "decoupled"])
def test_fsdp_tensor_group_and_data_parallel_group_train_together(mode, tmp_path):
  """The layouts change where arrays live, not the math: the run matches the all-data-parallel one."""
  mixed = experiment.build(_config(mode, MIXED))
  plain = experiment.build(_config(mode, ()))
  kernel = mixed.learners[0].state.params["block_0"]["mlp"]["wi"]["kernel"]
  assert kernel.sharding.spec == P("fsdp", "tensor") and kernel.addressable_shards[0].data.shape == (16, 32)
  assert mixed.learners[1].state.params["block_0"]["mlp"]["wi"]["kernel"].sharding.spec == P(None, None)
  mixed_summary = sim.run(mixed, str(tmp_path / "mixed"))
  plain_summary = sim.run(plain, str(tmp_path / "plain"))
  assert mixed.syncer.version == plain.syncer.version > 1
  chex.assert_trees_all_close(_host(mixed.global_params), _host(plain.global_params), atol=2e-5)
  assert np.isclose(mixed_summary["eval_loss"], plain_summary["eval_loss"], atol=1e-4)
  assert mixed_summary["eval_loss"] < np.log(256)  # It learned something.

"""Pseudo-gradient sign, outer optimizers and the synchronous merge, with numbers."""

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from decoupled_diloco import merge, outer
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.syncer import Syncer


def _tree(value):
  return {"w": jnp.full((3, 2), value, jnp.float32), "b": {"v": jnp.full((4,), value, jnp.float32)}}


def test_pseudo_gradient_is_global_minus_local():
  delta = outer.pseudo_gradient(_tree(1.0), _tree(0.25))
  chex.assert_trees_all_close(delta, _tree(0.75))


@pytest.mark.parametrize("tokens, expected", [((1, 1, 1), 2.0), ((1, 0, 3), 2.5)])
def test_outer_sgd_lr1_without_momentum_makes_theta_the_weighted_mean(tokens, expected):
  syncer = Syncer(optax.sgd(1.0))
  state = syncer.init(_tree(10.0))
  learners = [_tree(1.0), _tree(2.0), _tree(3.0)]
  deltas = [syncer.pseudo_gradient(state.params, theta) for theta in learners]
  new = syncer.merge_and_step(state, deltas, tokens)
  chex.assert_trees_all_close(new.params, _tree(expected), atol=1e-6)
  assert new.version == state.version + 1
  chex.assert_trees_all_close(state.params, _tree(10.0))  # The old state is a value; untouched.


def test_outer_nesterov_follows_the_pytorch_formula():
  cfg = ml_collections.ConfigDict({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True})
  syncer = Syncer(outer.outer_optimizer(cfg))
  state = syncer.init({"x": jnp.zeros(())})
  theta, buf = 0.0, 0.0
  for g in (1.0, -0.5, 2.0):
    state = syncer.merge_and_step(state, [{"x": jnp.asarray(g)}], [1])
    buf = 0.9 * buf + g
    theta -= 0.7 * (g + 0.9 * buf)
    np.testing.assert_allclose(float(state.params["x"]), theta, rtol=1e-6)


def test_syncer_state_lives_on_the_host_device():
  syncer = Syncer(optax.sgd(0.7, 0.9, nesterov=True))
  state = syncer.init(_tree(1.0))
  devices = {d for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array) for d in leaf.devices()}
  assert devices == {syncer.device}


def test_bad_weights_and_optimizer_names_are_rejected():
  with pytest.raises(ValueError, match="not all zero"):
    merge.normalized_weights([0, 0])
  with pytest.raises(ValueError, match="non-negative"):
    merge.normalized_weights([1, -1])
  cfg = ml_collections.ConfigDict({"optimizer": "lamb", "lr": 0.7, "momentum": 0.9, "nesterov": True})
  with pytest.raises(ConfigError, match="outer.optimizer='lamb' is unknown"):
    outer.outer_optimizer(cfg)

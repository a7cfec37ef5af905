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


def _tree(value):
  return {"w": jnp.full((3, 2), value, jnp.float32), "b": {"v": jnp.full((4,), value, jnp.float32)}}


def test_pseudo_gradient_is_global_minus_local():
  delta = outer.pseudo_gradient(_tree(1.0), _tree(0.25))
  chex.assert_trees_all_close(delta, _tree(0.75))


def test_bad_weights_and_optimizer_names_are_rejected():
  with pytest.raises(ValueError, match="not all zero"):
    merge.normalized_weights([0, 0])
  with pytest.raises(ValueError, match="non-negative"):
    merge.normalized_weights([1, -1])
  cfg = ml_collections.ConfigDict({"optimizer": "lamb", "lr": 0.7, "momentum": 0.9, "nesterov": True})
  with pytest.raises(ConfigError, match="outer.optimizer='lamb' is unknown"):
    outer.outer_optimizer(cfg)


def _scan_updates(optimizer, grads):
  """The update `optimizer` returns for each gradient in turn, starting from x = 0."""
  state = optimizer.init({"x": jnp.zeros(2)})
  updates = []
  for g in grads:
    update, state = optimizer.update({"x": jnp.asarray(g, jnp.float32)}, state)
    updates.append(np.asarray(update["x"]))
  return updates


def test_delayed_nesterov_c0_window_equals_one_nesterov_step_on_the_mean():
  n, windows, lr, beta = 3, 3, 0.7, 0.9
  grads = np.random.default_rng(0).normal(size=(n * windows, 2)).astype(np.float32)
  dn_updates = _scan_updates(outer.delayed_nesterov(lr, beta, n), grads)
  means = grads.reshape(windows, n, 2).mean(axis=1)
  nesterov_updates = _scan_updates(optax.sgd(lr, beta, nesterov=True), means)
  for w in range(windows):  # Momentum accumulates across windows, so later windows test it too.
    window = dn_updates[w * n:(w + 1) * n]
    np.testing.assert_allclose(sum(window), nesterov_updates[w], rtol=1e-5, atol=1e-6)
    for t in range(n - 1):  # Between momentum updates only the plain g_t/N is applied.
      np.testing.assert_allclose(window[t], -lr * grads[w * n + t] / n, rtol=1e-6)
  assert np.abs(nesterov_updates[2] + lr * means[2]).max() > 0.1  # The momentum term is not negligible.


def test_delayed_nesterov_with_buffer_1_is_nesterov_every_step():
  grads = [[1.0, -2.0], [-0.5, 0.25], [2.0, 1.0], [0.3, 0.3]]
  dn_updates = _scan_updates(outer.delayed_nesterov(0.7, 0.9, 1), grads)
  nesterov_updates = _scan_updates(optax.sgd(0.7, 0.9, nesterov=True), grads)
  for dn, nesterov in zip(dn_updates, nesterov_updates):
    np.testing.assert_allclose(dn, nesterov, rtol=1e-6)


def test_delayed_nesterov_counts_a_merge_of_k_pushes_as_k_arrivals():
  """A grace window's merge of k pushes (mean g) moves Θ as k single arrivals of g would, in sum; a merge of
  all N pushes of a round is one Nesterov step, as in synchronous DiLoCo."""
  lr, beta, n = 0.7, 0.9, 4
  grads = np.random.default_rng(1).normal(size=(6, 2)).astype(np.float32)
  dn = outer.delayed_nesterov(lr, beta, n)
  merged_state, single_state = dn.init({"x": jnp.zeros(2)}), dn.init({"x": jnp.zeros(2)})
  for g, k in zip(grads, (2, 2, 1, 3, 4, 4)):  # Windows close at t = 4, 8, 12, 16, each on a merge's last push.
    merged, merged_state = dn.update({"x": jnp.asarray(g)}, merged_state, arrivals=k)
    total = np.zeros(2, np.float32)
    for _ in range(k):
      single, single_state = dn.update({"x": jnp.asarray(g)}, single_state)
      total += np.asarray(single["x"])
    np.testing.assert_allclose(merged["x"], total, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(merged_state, single_state, rtol=1e-5, atol=1e-6)
  sync = _scan_updates(optax.sgd(lr, beta, nesterov=True), grads[4:])
  state = dn.init({"x": jnp.zeros(2)})
  for g, expected in zip(grads[4:], sync):
    update, state = dn.update({"x": jnp.asarray(g)}, state, arrivals=n)
    np.testing.assert_allclose(update["x"], expected, rtol=1e-6)


def test_delayed_nesterov_with_activation_matches_the_hand_computed_steps():
  lr, beta, n, c = 0.5, 0.9, 2, 0.25
  # g = 2, 4 (window 1: m = 3), then 6, 8 (window 2: m = 0.9·3 + 7 = 9.7).
  expected = [
      -lr * (c * beta * 0 + 2 / n),  # -0.5
      -lr * ((1 - c * n + c) * beta * 3.0 + 4 / n),  # -(0.75·2.7 + 2)/2 = -2.0125
      -lr * (c * beta * 3.0 + 6 / n),  # -(0.675 + 3)/2 = -1.8375
      -lr * ((1 - c * n + c) * beta * 9.7 + 8 / n),  # -(0.75·8.73 + 4)/2 = -5.27375
  ]
  updates = _scan_updates(outer.delayed_nesterov(lr, beta, n, activation=c), [[g, 0.0] for g in (2, 4, 6, 8)])
  np.testing.assert_allclose([u[0] for u in updates], expected, rtol=1e-6)
  np.testing.assert_allclose(expected, [-0.5, -2.0125, -1.8375, -5.27375], rtol=1e-9)


def test_delayed_nesterov_is_jittable_and_matches_eager():
  optimizer = outer.delayed_nesterov(0.7, 0.9, 3, activation=0.1)
  params = {"w": jnp.ones((2, 3)), "b": {"v": jnp.zeros(4)}}
  grads = [jax.tree.map(lambda p, i=i: jnp.full_like(p, 0.5 * i - 1.0), params) for i in range(5)]
  step = jax.jit(lambda g, s, p: outer.outer_step(optimizer, p, s, g))
  eager_params, eager_state = params, optimizer.init(params)
  jit_params, jit_state = params, jax.jit(optimizer.init)(params)
  for g in grads:
    eager_params, eager_state = outer.outer_step(optimizer, eager_params, eager_state, g)
    jit_params, jit_state = step(g, jit_state, jit_params)
  chex.assert_trees_all_close(jit_params, eager_params, rtol=1e-6)
  chex.assert_trees_all_close(jit_state, eager_state, rtol=1e-6)
  assert int(jit_state.count) == 5
  window_2 = 0.5 * 3 - 1.0 + 0.5 * 4 - 1.0  # Arrivals 3 and 4 are summed, waiting for arrival 5.
  chex.assert_trees_all_close(jit_state.accumulated, jax.tree.map(lambda p: jnp.full_like(p, window_2), params))


def test_delayed_nesterov_from_config():
  cfg = ml_collections.ConfigDict({
      "optimizer": "delayed_nesterov", "lr": 0.7, "momentum": 0.9, "nesterov": True, "buffer_size": 2,
      "activation": 0.0})
  optimizer = outer.outer_optimizer(cfg)
  params = {"x": jnp.zeros(())}
  opt_state = optimizer.init(params)
  for g in (1.0, 3.0):
    params, opt_state = outer.outer_step(optimizer, params, opt_state, {"x": jnp.asarray(g)})
  # One Nesterov step on the mean 2: -0.7·(2 + 0.9·2) = -2.66.
  np.testing.assert_allclose(float(params["x"]), -2.66, rtol=1e-6)
  old = ml_collections.ConfigDict({"optimizer": "delayed_nesterov", "lr": 0.7, "momentum": 0.9, "nesterov": True})
  chex.assert_trees_all_close(_scan_updates(outer.outer_optimizer(old), [[1.0, 2.0]]),
                              _scan_updates(optax.sgd(0.7, 0.9, nesterov=True), [[1.0, 2.0]]))  # N defaults to 1.


def test_delayed_nesterov_rejects_bad_arguments():
  with pytest.raises(ValueError, match="buffer_size=0 must be an int >= 1"):
    outer.delayed_nesterov(0.7, 0.9, 0)
  with pytest.raises(ValueError, match="momentum=1.0 must be in"):
    outer.delayed_nesterov(0.7, 1.0, 2)
  cfg = ml_collections.ConfigDict({
      "optimizer": "delayed_nesterov", "lr": 0.7, "momentum": 0.9, "nesterov": True, "buffer_size": 0,
      "activation": 0.0})
  with pytest.raises(ConfigError, match="outer.buffer_size=0 must be an int >= 1"):
    outer.outer_optimizer(cfg)


def test_outer_adam_with_momentum_zero_has_no_first_moment():
  """outer.momentum = 0 means none (configs/default.py), also for Adam: b1 = 0, not 0.9 (issue 14)."""
  cfg = ml_collections.ConfigDict({"optimizer": "adam", "lr": 0.1, "momentum": 0.0, "nesterov": False})
  grads = [[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]]
  chex.assert_trees_all_close(_scan_updates(outer.outer_optimizer(cfg), grads),
                              _scan_updates(optax.adam(0.1, b1=0.0), grads))
  assert not np.allclose(
      _scan_updates(optax.adam(0.1, b1=0.0), grads)[1],
      _scan_updates(optax.adam(0.1, b1=0.9), grads)[1])  # The two really differ.
  with pytest.raises(ConfigError, match=r"outer.momentum=1.5 must be in \[0, 1\)"):
    outer.outer_optimizer(ml_collections.ConfigDict({**cfg.to_dict(), "momentum": 1.5}))


@pytest.mark.parametrize("n, c", [(4, 0.6), (2, 0.51), (1, -0.1)])
def test_delayed_nesterov_refuses_an_activation_outside_zero_to_one_over_n(n, c):
  """Liu et al., Alg. 3: c in [0, 1/N]; c = 0.6, N = 4 would give the boundary a negative momentum share."""
  with pytest.raises(ValueError, match=r"activation=.* must be in \[0, 1/N"):
    outer.delayed_nesterov(0.7, 0.9, n, activation=c)
  cfg = ml_collections.ConfigDict({
      "optimizer": "delayed_nesterov", "lr": 0.7, "momentum": 0.9, "nesterov": True, "buffer_size": n, "activation": c})
  with pytest.raises(ConfigError, match=r"outer.activation=.* must be in \[0, 1/outer.buffer_size"):
    outer.outer_optimizer(cfg)
  outer.delayed_nesterov(0.7, 0.9, n, activation=1 / n)  # The bound itself is allowed.

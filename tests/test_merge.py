"""Merge weights (staleness, tokens), radial-directional averaging and the merge rules, with numbers."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decoupled_diloco import merge
from decoupled_diloco.model import build_model
from tests.helpers import tiny_config


@pytest.mark.parametrize("kind, a, b, staleness, expected", [
    ("constant", 0.5, 0.0, 7, 1.0),
    ("polynomial", 0.5, 0.0, 0, 1.0),
    ("polynomial", 0.5, 0.0, 3, 0.5),
    ("polynomial", 1.0, 0.0, 4, 0.2),
    ("hinge", 1.0, 2.0, 0, 1.0),
    ("hinge", 1.0, 2.0, 2, 1.0),
    ("hinge", 1.0, 2.0, 4, 1 / 3),
    ("hinge", 0.5, 1.0, 5, 1 / 3),
    ("exponential", math.log(2), 0.0, 0, 1.0),
    ("exponential", math.log(2), 0.0, 1, 0.5),
    ("exponential", math.log(2), 0.0, 3, 0.125),])
def test_staleness_weight(kind, a, b, staleness, expected):
  assert merge.staleness_weight(staleness, kind, a, b) == pytest.approx(expected, rel=1e-12)


def test_staleness_weight_rejects_bad_arguments():
  with pytest.raises(ValueError, match="staleness=-1 is negative"):
    merge.staleness_weight(-1, "polynomial", 0.5, 0.0)
  with pytest.raises(ValueError, match="staleness kind 'linear' is unknown"):
    merge.staleness_weight(1, "linear", 0.5, 0.0)
  with pytest.raises(ValueError, match="a=-0.5 is negative"):
    merge.staleness_weight(1, "exponential", -0.5, 0.0)


@pytest.mark.parametrize("tokens, steps, kind, expected", [
    (1000, 10, "none", 1.0),
    (1000, 10, "tokens", 1000.0),
    (1000, 10, "tokens_squared_per_step", 100_000.0),
    (1000, 100, "tokens_squared_per_step", 10_000.0),
    (0, 5, "tokens_squared_per_step", 0.0),])
def test_token_weight(tokens, steps, kind, expected):
  assert merge.token_weight(tokens, steps, kind) == expected


def test_token_weight_rejects_bad_arguments():
  with pytest.raises(ValueError, match="steps=0 must be >= 1"):
    merge.token_weight(10, 0, "tokens")
  with pytest.raises(ValueError, match="tokens=-1 is negative"):
    merge.token_weight(-1, 1, "tokens")
  with pytest.raises(ValueError, match="token weighting 'bytes' is unknown"):
    merge.token_weight(1, 1, "bytes")


def _norm(x):
  return float(jnp.linalg.norm(jnp.ravel(x)))


def test_rda_keeps_the_norm_of_orthogonal_unit_vectors_where_the_mean_shrinks():
  deltas = [{"v": jnp.array([1.0, 0.0])}, {"v": jnp.array([0.0, 1.0])}]
  weights = np.array([0.5, 0.5], np.float32)
  mean = merge.weighted_average(deltas, weights)["v"]
  rda = merge.radial_directional_average(deltas, weights)["v"]
  assert _norm(mean) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
  assert _norm(rda) == pytest.approx(1.0, rel=1e-6)
  np.testing.assert_allclose(rda, [1 / math.sqrt(2)] * 2, rtol=1e-6)  # Same direction as the mean.


def test_rda_preserves_a_shared_norm_and_follows_the_weighted_direction():
  rng = np.random.default_rng(0)
  vectors = [rng.normal(size=(16, 8)).astype(np.float32) for _ in range(4)]
  vectors = [3.0 * v / np.linalg.norm(v) for v in vectors]  # Near-orthogonal, all of norm 3.
  deltas = [{"w": jnp.asarray(v)} for v in vectors]
  weights = merge.normalized_weights([1, 2, 3, 4]).astype(np.float32)
  rda = merge.radial_directional_average(deltas, weights)["w"]
  mean = merge.weighted_average(deltas, weights)["w"]
  assert _norm(rda) == pytest.approx(3.0, rel=1e-5)
  assert _norm(mean) < 2.0  # ≈ 3·‖w‖₂ = 3·√0.3 ≈ 1.64 for orthogonal inputs.
  directions = sum(w * v / 3.0 for w, v in zip(weights, vectors))
  np.testing.assert_allclose(rda, 3.0 * directions / np.linalg.norm(directions), rtol=1e-5, atol=1e-6)


def test_rda_radius_is_the_weighted_mean_norm():
  deltas = [{"v": jnp.array([2.0, 0.0])}, {"v": jnp.array([0.0, 6.0])}]
  rda = merge.radial_directional_average(deltas, np.array([0.75, 0.25], np.float32))["v"]
  assert _norm(rda) == pytest.approx(0.75 * 2 + 0.25 * 6, rel=1e-6)
  np.testing.assert_allclose(rda, 3.0 * np.array([3.0, 1.0]) / math.sqrt(10), rtol=1e-6)


def test_rda_of_identical_inputs_is_the_input():
  tree = {"a": jnp.array([[0.3, -1.2], [2.0, 0.1]]), "b": {"c": jnp.array(-0.7)}}
  rda = merge.radial_directional_average([tree, tree, tree], np.array([0.2, 0.3, 0.5], np.float32))
  chex.assert_trees_all_close(rda, tree, rtol=1e-6)


def test_rda_of_zero_and_opposite_inputs_is_zero_not_nan():
  zero = merge.radial_directional_average([{"v": jnp.zeros(3)}] * 2, np.array([0.5, 0.5]))["v"]
  opposite = merge.radial_directional_average([{"v": jnp.array([1.0, 2.0])}, {"v": jnp.array([-1.0, -2.0])}],
                                              np.array([0.5, 0.5]))["v"]
  np.testing.assert_array_equal(zero, np.zeros(3))
  np.testing.assert_array_equal(opposite, np.zeros(2))


def test_rda_norms_are_per_tensor():
  # A large tensor next to a tiny one: each keeps its own norm, not a share of a global one.
  big = [{"big": jnp.array([100.0, 0.0]), "small": jnp.array([0.0, 0.01])},
         {"big": jnp.array([0.0, 100.0]), "small": jnp.array([0.01, 0.0])}]
  rda = merge.radial_directional_average(big, np.array([0.5, 0.5]))
  assert _norm(rda["big"]) == pytest.approx(100.0, rel=1e-5)
  assert _norm(rda["small"]) == pytest.approx(0.01, rel=1e-5)


def test_embedding_mask_picks_exactly_the_embeddings_of_the_real_model():
  _, params, _ = build_model(tiny_config().model, seed=0)
  mask = merge.embedding_mask(params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  flagged = {jax.tree_util.keystr(path) for path, flag in jax.tree_util.tree_leaves_with_path(mask) if flag}
  assert flagged == {"['token_embed']", "['pos_embed']"}
  assert len(jax.tree.leaves(mask)) > 2 and "block_0" in params  # The blocks and lm_head are not flagged.


def _random_tree_like(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape).astype(np.float32)), params)


def test_merge_deltas_rda_uses_the_mean_on_masked_leaves_and_jit_matches_eager():
  _, params, _ = build_model(tiny_config().model, seed=0)
  deltas = [_random_tree_like(params, seed) for seed in range(3)]
  weights = np.array([0.2, 0.3, 0.5], np.float32)
  mask = merge.embedding_mask(params)
  eager = merge.merge_deltas(deltas, weights, "rda", mask)
  jitted = jax.jit(lambda d, w: merge.merge_deltas(d, w, "rda", mask))(deltas, weights)
  chex.assert_trees_all_close(jitted, eager, rtol=1e-5, atol=1e-7)
  mean = merge.weighted_average(deltas, weights)
  rda = merge.radial_directional_average(deltas, weights)
  chex.assert_trees_all_close(eager["token_embed"], mean["token_embed"], rtol=1e-6)
  chex.assert_trees_all_close(eager["pos_embed"], mean["pos_embed"], rtol=1e-6)
  chex.assert_trees_all_close(eager["lm_head"], rda["lm_head"], rtol=1e-6)
  chex.assert_trees_all_close(eager["block_0"], rda["block_0"], rtol=1e-6)
  # Random near-orthogonal deltas: RDA's lm_head is ~√(1/Σw²) ≈ 1.6x longer than the mean's.
  assert _norm(eager["lm_head"]) > 1.4 * _norm(mean["lm_head"])


@pytest.mark.parametrize("rule", merge.BATCH_RULES)
def test_merge_deltas_without_mask_under_jit(rule):
  deltas = [{"w": jnp.array([1.0, 0.0]), "e": jnp.array([3.0])}, {"w": jnp.array([0.0, 1.0]), "e": jnp.array([1.0])}]
  weights = np.array([0.5, 0.5], np.float32)
  merged = jax.jit(lambda d, w: merge.merge_deltas(d, w, rule))(deltas, weights)
  expected_w = [0.5, 0.5] if rule == "mean" else [1 / math.sqrt(2)] * 2
  np.testing.assert_allclose(merged["w"], expected_w, rtol=1e-6)
  np.testing.assert_allclose(merged["e"], [2.0], rtol=1e-6)  # Same sign: RDA = mean in 1-D.


def test_merge_deltas_rejects_bad_arguments():
  deltas = [{"w": jnp.ones(2)}]
  with pytest.raises(ValueError, match="merge rule 'median' has no batch form"):
    merge.merge_deltas(deltas, np.ones(1), "median")
  with pytest.raises(ValueError, match="one weight per delta"):
    merge.merge_deltas(deltas, np.array([0.5, 0.5]), "mean")
  with pytest.raises(ValueError, match="close over the mask"):
    jax.jit(lambda d, w, m: merge.merge_deltas(d, w, "rda", m))(deltas, np.ones(1), {"w": True})

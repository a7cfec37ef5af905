"""Robust merge rules against independent numpy references, on hand-made pushes."""

import statistics

import numpy as np
import pytest

from decoupled_diloco import robust


def _reference_clip(norm, recent, multiple):
  return min(1.0, multiple * statistics.median(recent) / norm)


@pytest.mark.parametrize("norm, recent", [(1.0, [1.0]), (300.0, [1.0, 2.0, 300.0]), (5.0, [1.0, 2.0, 3.0, 5.0]),
                                          (2.5, [1.0, 2.0, 2.5])])
def test_clip_factor_is_the_median_bound(norm, recent):
  assert robust.clip_factor(norm, recent, 2.0) == pytest.approx(_reference_clip(norm, recent, 2.0))


def test_a_first_push_and_a_zero_push_are_never_clipped():
  assert robust.clip_factor(1e6, [1e6], 1.0) == 1.0
  assert robust.clip_factor(0.0, [0.0, 1.0, 1.0], 1.0) == 1.0
  with pytest.raises(ValueError, match="own included"):
    robust.clip_factor(1.0, [], 2.0)


def _reference_trimmed(stack, tokens, damping, trim):
  """Per coordinate: sort the pushes' values, keep the middle ones, their token-weighted mean with damping."""
  n, size = stack.shape
  out, trimmed = np.zeros(size), np.zeros(n, int)
  for j in range(size):
    order = sorted(range(n), key=lambda i: (stack[i, j], i))
    kept = order[trim:n - trim]
    for i in order[:trim] + order[n - trim:]:
      trimmed[i] += 1
    out[j] = sum(damping[i] * tokens[i] * stack[i, j] for i in kept) / sum(tokens[i] for i in kept)
  return out, trimmed


@pytest.mark.parametrize("chunk_floats", [robust.CHUNK_FLOATS, 7])  # 7: several chunks of one coordinate each.
def test_trimmed_mean_equals_the_numpy_reference(chunk_floats):
  rng = np.random.default_rng(0)
  stack = rng.standard_normal((5, 3, 4)).astype(np.float32)
  stack[2] *= 100.0  # An outlier push: trimmed nearly everywhere.
  stack[0, 0, 0] = stack[1, 0, 0]  # A tie, ranked by push order.
  tokens, damping = np.array([1.0, 2.0, 1.0, 4.0, 1.0]), np.array([1.0, 0.5, 1.0, 1.0, 0.25])
  merged, trimmed = robust.trimmed_mean_leaf(list(stack), tokens, damping, 1, chunk_floats)
  expected, expected_trimmed = _reference_trimmed(stack.reshape(5, -1).astype(np.float64), tokens, damping, 1)
  np.testing.assert_allclose(merged.reshape(-1), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(trimmed, expected_trimmed)
  assert trimmed[2] >= 10  # Of its 12 coordinates.


def test_trimmed_merge_goes_tensor_by_tensor_and_reports_shares():
  rng = np.random.default_rng(1)
  pushes = [[rng.standard_normal((4, 2)).astype(np.float32),
             rng.standard_normal(3).astype(np.float32)] for _ in range(4)]
  pushes[3] = [x * -50.0 for x in pushes[3]]
  merged, shares = robust.trimmed_merge([iter(p) for p in pushes], [1.0] * 4, [1.0] * 4, 0.25)
  for k in range(2):
    stack = np.stack([p[k] for p in pushes]).reshape(4, -1).astype(np.float64)
    np.testing.assert_allclose(merged[k].reshape(-1), _reference_trimmed(stack, [1.0] * 4, [1.0] * 4, 1)[0], rtol=1e-5)
  assert shares[3] == 1.0 and sum(shares) == pytest.approx(2.0)  # Two of four pushes trimmed per coordinate.


def test_too_few_pushes_to_trim_is_the_weighted_mean():
  pushes = [[np.full(3, v, np.float32)] for v in (1.0, 2.0, 6.0)]
  merged, shares = robust.trimmed_merge([iter(p) for p in pushes], [1.0, 1.0, 2.0], [1.0] * 3, 0.25)
  np.testing.assert_allclose(merged[0], np.full(3, (1 + 2 + 12) / 4))
  assert shares == [0.0, 0.0, 0.0]


def test_trim_count_refuses_trimming_half():
  assert [robust.trim_count(n, 0.125) for n in (1, 7, 8, 16)] == [0, 0, 1, 2]
  with pytest.raises(ValueError, match="must be in"):
    robust.trim_count(8, 0.5)


def test_verdict_fields_say_whether_a_push_was_clipped():
  assert robust.Verdict(3.0, 0.5).fields() == {"checked_norm": 3.0, "clip_factor": 0.5, "clipped": 1}
  assert robust.Verdict(3.0).fields()["clipped"] == 0

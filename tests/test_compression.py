"""Compression formats: error bounds, exact wire bytes, error feedback, and garbage rejected."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from decoupled_diloco import compression
from decoupled_diloco.errors import ConfigError

BLOCK = 8
# A scalar, an empty tensor, a size below, a multiple of and not a multiple of the block (3-D).
SHAPES = [(), (0,), (5,), (2, 8), (3, 1, 7)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_leaves(seed=0, shapes=SHAPES):
  rng = np.random.default_rng(seed)
  return [(rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(np.float32) for shape in shapes]


def round_trip(fmt, leaves, **kwargs):
  codec = compression.Codec(format=fmt, block_size=kwargs.pop("block_size", BLOCK), **kwargs)
  sent = compression.encode(codec, leaves)
  decoded = [np.asarray(d) for d in compression.decode(codec, sent)]
  for x, d in zip(leaves, decoded):
    assert d.dtype == np.float32 and d.shape == x.shape
  return codec, sent, decoded


def block_absmax(x, block=BLOCK):
  """Each value's block absmax, by the module's definition: flatten, zero-pad, blocks of `block`."""
  flat = x.reshape(-1)
  blocks = np.pad(flat, (0, -flat.size % block)).reshape(-1, block)
  return np.repeat(np.abs(blocks).max(axis=1), block)[:flat.size].reshape(x.shape)


def test_fp32_is_exact_and_bf16_within_half_an_ulp():
  leaves = random_leaves()
  for x, d in zip(leaves, round_trip("fp32", leaves)[2]):
    np.testing.assert_array_equal(d, x)
  for x, d in zip(leaves, round_trip("bf16", leaves)[2]):
    assert np.all(np.abs(d - x) <= 2.0**-8 * np.abs(x))


@pytest.mark.parametrize("fmt, levels", [("int8", 127), ("int4", 7), ("int2", 1)])
def test_int_formats_round_to_nearest_level_of_the_block_absmax(fmt, levels):
  leaves = random_leaves()
  for x, d in zip(leaves, round_trip(fmt, leaves)[2]):
    scale = block_absmax(x)
    assert np.all(np.abs(d - x) <= scale / (2 * levels) * (1 + 1e-5))  # int8 s/254, int4 s/14, int2 s/2.
    q = np.divide(d * levels, scale, out=np.zeros_like(d), where=scale > 0)
    np.testing.assert_allclose(q, np.round(q), atol=1e-4)  # Exactly the levels -L..L.
    assert np.all(np.abs(q) <= levels + 1e-4)
    np.testing.assert_allclose(q, np.round(np.divide(x * levels, scale, out=np.zeros_like(x), where=scale > 0)),
                               atol=1e-4)


def test_fp4_rounds_to_a_power_of_two_of_the_block_absmax_in_the_log_domain():
  edges = [1, -0.75, 0.7, 0.3, 2.0**-6.4, 2.0**-6.6, -0.0, 0]  # One block: absmax 1.
  leaves = random_leaves() + [np.float32([edges, edges])]
  for x, d in zip(leaves, round_trip("fp4", leaves)[2]):
    scale = block_absmax(x)
    representable = np.abs(x) >= 2.0**-6.5 * scale * (1 + 1e-6)
    ratio = np.divide(d, x, out=np.ones_like(x), where=representable)
    assert np.all((ratio >= 2.0**-0.5 * (1 - 1e-6)) & (ratio <= 2.0**0.5 * (1 + 1e-6)))  # Same sign, within sqrt 2.
    assert np.all(d[np.abs(x) < 2.0**-6.5 * scale * (1 - 1e-6)] == 0)
    exponent = np.log2(np.abs(d[d != 0]) / scale[d != 0])
    np.testing.assert_allclose(exponent, np.round(exponent), atol=1e-5)
    assert np.all((exponent > -6.5) & (exponent < 0.5))
  np.testing.assert_array_equal(round_trip("fp4", leaves[-1:])[2][0][0], [1, -1, 0.5, 0.25, 2.0**-6, 0, 0, 0])


def test_topk_sends_exactly_the_largest_entries():
  leaves = random_leaves()
  codec, _, decoded = round_trip("topk", leaves, topk_fraction=0.3)
  for x, d in zip(leaves, decoded):
    k = math.ceil(0.3 * x.size - 1e-9)
    kept = np.argsort(-np.abs(x.reshape(-1)), kind="stable")[:k]
    expected = np.zeros(x.size, np.float32)
    expected[kept] = x.reshape(-1)[kept]
    np.testing.assert_array_equal(d.reshape(-1), expected)
  assert compression.topk_count(codec.topk_fraction, 10) == 3


@pytest.mark.parametrize("fmt", compression.FORMATS)
def test_zero_tensors_decode_to_zeros(fmt):
  leaves = [np.zeros(shape, np.float32) for shape in SHAPES]
  for d in round_trip(fmt, leaves)[2]:
    assert not np.any(np.isnan(d)) and not np.any(d)


@pytest.mark.parametrize("fmt, block_size", [(fmt, BLOCK) for fmt in compression.FORMATS] + [("int2", 6)])
def test_nbytes_is_what_wire_bytes_predicts_from_shapes(fmt, block_size):
  shapes = SHAPES if block_size == BLOCK else SHAPES[2:]  # Block 6: int2 pads each block to 8 codes.
  codec, sent, _ = round_trip(fmt, random_leaves(shapes=shapes), block_size=block_size, topk_fraction=0.3)
  assert sent.nbytes == compression.wire_bytes(codec, shapes) > 0
  assert sent.nbytes == sum(a.nbytes for a in jax.tree.leaves(sent))  # Nothing but payload arrays.


def test_byte_counts_follow_the_documented_formulas():
  n, block = 1000, 64
  blocks = math.ceil(n / block)  # 16: the tail block is padded to 64 values.
  expected = {
      "fp32": 4 * n, "bf16": 2 * n, "int8": blocks * block + 4 * blocks, "int4": blocks * block // 2 + 4 * blocks,
      "fp4": blocks * block // 2 + 4 * blocks, "int2": blocks * block // 4 + 4 * blocks, "topk": 8 * 10}
  for fmt, nbytes in expected.items():
    assert compression.wire_bytes(compression.Codec(format=fmt), [(10, 100)]) == nbytes, fmt
  # int2 packs each block on its own: 6 values take 2 bytes, so 10 values take 2 blocks = 4 bytes + 2 scales.
  assert compression.wire_bytes(compression.Codec(format="int2", block_size=6), [(10,)]) == 4 + 8
  twelve_b = [(12_000_000_000,)]  # Pure arithmetic: nothing this size is allocated.
  assert compression.wire_bytes(compression.Codec(format="int4"), twelve_b) == 6_000_000_000 + 4 * 187_500_000
  assert compression.wire_bytes(compression.Codec(format="topk", topk_fraction=0.07), [(100,)]) == 8 * 7


def test_error_feedback_sends_later_what_compression_skipped():
  codec = compression.Codec(format="topk", topk_fraction=0.25, error_feedback=True)
  first, second = np.float32([10, 1, 0, 0]), np.float32([0, 0.5, 0.9, 0])
  sent, residual = compression.encode_with_feedback(codec, [first])
  np.testing.assert_array_equal(residual[0], [0, 1, 0, 0])
  sent, residual = compression.encode_with_feedback(codec, [second], residual)
  # The skipped 1 plus 0.5 now beats 0.9: without feedback entry 2 would go instead.
  np.testing.assert_array_equal(compression.decode(codec, sent)[0], [0, 1.5, 0, 0])
  np.testing.assert_array_equal(residual[0], np.float32([0, 0, 0.9, 0]))
  plain = compression.Codec(format="topk", topk_fraction=0.25)
  sent, residual = compression.encode_with_feedback(plain, [second])
  assert residual is None
  np.testing.assert_array_equal(compression.decode(plain, sent)[0], np.float32([0, 0, 0.9, 0]))


@pytest.mark.parametrize("fmt", ["topk", "int2", "fp4"])
def test_error_feedback_loses_nothing_over_rounds(fmt):
  codec = compression.Codec(format=fmt, block_size=BLOCK, topk_fraction=0.3, error_feedback=True)
  shapes = SHAPES[2:]
  total_in, total_sent, residual = [np.zeros(s, np.float32) for s in shapes], [np.zeros(s) for s in shapes], None
  for seed in range(6):
    deltas = random_leaves(seed, shapes)
    sent, residual = compression.encode_with_feedback(codec, deltas, residual)
    total_in = [t + d for t, d in zip(total_in, deltas)]
    total_sent = [t + np.asarray(d) for t, d in zip(total_sent, compression.decode(codec, sent))]
  for t_in, t_sent, r in zip(total_in, total_sent, residual):
    np.testing.assert_allclose(t_sent + np.asarray(r), t_in, rtol=1e-4, atol=1e-3 * np.abs(t_in).max())


def test_error_feedback_on_int2_keeps_the_accumulated_error_bounded_where_plain_int2_lets_it_grow():
  """A fixed sequence of 12 pseudo-gradients of one slowly moving direction (what consecutive Δs of a run look
  like) and noise: the sum of what int2 sent drifts from the sum of the Δs without error feedback, and stays
  within one residual of it with."""
  rng = np.random.default_rng(0)
  drift = rng.standard_normal((64, 8)).astype(np.float32)
  deltas = [drift + 0.3 * rng.standard_normal((64, 8)).astype(np.float32) for _ in range(12)]
  errors = {}
  for feedback in (False, True):
    codec = compression.Codec(format="int2", block_size=BLOCK, error_feedback=feedback)
    total, residual, errors[feedback] = np.zeros((64, 8)), None, []
    for round_index, delta in enumerate(deltas, start=1):
      sent, residual = compression.encode_with_feedback(codec, [delta], residual)
      total += np.asarray(compression.decode(codec, sent)[0])
      errors[feedback].append(np.linalg.norm(total - np.sum(deltas[:round_index], axis=0)))
  assert errors[True][0] == errors[False][0]  # One round: nothing fed back yet.
  assert errors[False][-1] > 5 * errors[False][0]  # Plain int2's bias adds up over the rounds...
  assert errors[True][-1] < 0.2 * errors[False][-1]  # ...error feedback sends it later.
  assert max(errors[True]) < 2 * errors[True][0]


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_error_feedback_on_a_lossless_format_is_refused(fmt):
  with pytest.raises(ConfigError, match=rf"error_feedback=True has nothing to feed back with format '{fmt}'") as error:
    compression.Codec.from_config(compression_config(format=fmt, error_feedback=True))
  assert "\n" not in str(error.value) and "--config.compression.error_feedback=False" in str(error.value)
  with pytest.raises(ConfigError, match=r"error_feedback_beta=0.5 applies with error feedback only"):
    compression.Codec.from_config(compression_config(format="int2", error_feedback_beta=0.5))


def test_error_feedback_beta_decays_the_residual():
  codec = compression.Codec(format="topk", topk_fraction=0.25, error_feedback=True, error_feedback_beta=0.5)
  _, residual = compression.encode_with_feedback(codec, [np.float32([10, 2, 0, 0])])
  _, residual = compression.encode_with_feedback(codec, [np.float32([0, 0, 0, 0.5])], residual)
  np.testing.assert_array_equal(residual[0], [0, 0, 0, 0.5])  # Sent 0.5 * 2 = 1, kept 0.5.


def test_compressed_is_a_pytree_of_its_payload_arrays():
  codec, sent, _ = round_trip("int4", random_leaves())
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(sent))
  moved = jax.device_put(sent, jax.devices()[1])
  assert moved.format == "int4" and moved.shapes == sent.shapes
  np.testing.assert_array_equal(compression.decode(codec, moved)[3], compression.decode(codec, sent)[3])


def replace_leaf(sent, index, **changes):
  leaves = list(sent.leaves)
  leaves[index] = {**leaves[index], **changes}
  return sent._replace(leaves=tuple(leaves))


def test_malformed_payloads_raise_value_error():
  codec, sent, _ = round_trip("int4", random_leaves())
  codes = sent.leaves[4]["codes"]
  bad = {
      "not a payload": {"codes": codes},
      "format mismatch": sent._replace(format="int8"),
      "missing leaf": sent._replace(leaves=sent.leaves[:-1]),
      "bad shapes": sent._replace(shapes=((-1,),) + sent.shapes[1:]),
      "missing key": sent._replace(leaves=({"codes": codes},) + sent.leaves[1:]),
      "extra key": replace_leaf(sent, 4, extra=codes),
      "wrong dtype": replace_leaf(sent, 4, codes=codes.astype(jnp.int8)),
      "wrong shape": replace_leaf(sent, 4, codes=codes[1:]),
      "not an array": replace_leaf(sent, 4, codes=codes.tolist()),
      "not a dict": sent._replace(leaves=(None,) + sent.leaves[1:]),}
  for name, payload in bad.items():
    with pytest.raises(ValueError):
      compression.decode(codec, payload)
      pytest.fail(f"{name} was accepted")
  with pytest.raises(ValueError, match="codec expects 'int8'"):
    compression.decode(compression.Codec(format="int8", block_size=BLOCK), sent)

  topk, sent, _ = round_trip("topk", random_leaves(), topk_fraction=0.3)
  indices = sent.leaves[4]["indices"]
  for wrong in (indices.at[0].set(21), indices.at[0].set(-1)):
    with pytest.raises(ValueError, match="outside a tensor of 21 values"):
      compression.decode(topk, replace_leaf(sent, 4, indices=wrong))
  with pytest.raises(ValueError, match="float32"):
    compression.decode(topk, replace_leaf(sent, 4, values=sent.leaves[4]["values"].astype(jnp.bfloat16)))


def compression_config(**overrides):
  config = default.get_config().compression
  config.update(overrides)
  return config


def test_codec_from_default_config():
  assert compression.Codec.from_config(default.get_config().compression) == compression.Codec()
  codec = compression.Codec.from_config(compression_config(format="int4", block_size=32, error_feedback=True))
  assert (codec.format, codec.block_size, codec.error_feedback) == ("int4", 32, True)


@pytest.mark.parametrize("field, value, message", [
    ("format", "int3", "format='int3' is unknown"),
    ("block_size", 0, "block_size=0 must be an even int >= 2"),
    ("block_size", 1, "block_size=1"),
    ("block_size", 7, "block_size=7"),
    ("topk_fraction", 0.0, r"topk_fraction=0.0 must be in \(0, 1\]"),
    ("topk_fraction", 1.5, "topk_fraction=1.5"),
    ("error_feedback_beta", 0.0, "error_feedback_beta=0.0"),
    ("error_feedback_beta", 1.1, "error_feedback_beta=1.1"),])
def test_bad_configs_raise_one_line_config_errors(field, value, message):
  config = ml_collections.ConfigDict(compression_config().to_dict())
  config[field] = value
  with pytest.raises(ConfigError, match=message) as error:
    compression.Codec.from_config(config)
  assert "\n" not in str(error.value) and "--config.compression." in str(error.value)


@pytest.mark.slow
def test_throughput_benchmark_runs_end_to_end():
  result = subprocess.run(
      [sys.executable, "-m", "experiments.benchmarks.compress_throughput", "--size_mb=0.25", "--blocks=1"], cwd=REPO,
      capture_output=True, text=True, timeout=120, check=True)
  figures = json.loads(result.stdout.strip().splitlines()[-1])
  assert figures["ratio"] > 0 and figures["ratio"] == figures["int4_ratio"]
  assert all(f"{fmt}_gbps" in figures for fmt in ("int4", "int8", "fp4", "bf16", "topk"))

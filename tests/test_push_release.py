"""A push's receive buffer is freed when the syncer is done with it, not at a later garbage collection.

The syncer takes a decoded wire payload without a copy (DLPack views of its memory). These
tests turn the cyclic garbage collector off, so the only way a receive buffer can be freed
is the syncer letting go of it (`push.release`): with the aliases `device_put` made before,
JAX dropped its reference only at its next `gc` pass, and the buffer of a folded push could
outlive the next push's arrival. Run on real wire payloads, real device views and the real
finite check."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decoupled_diloco import compression
from decoupled_diloco.push import Push, PushRejected, all_finite, host_view
from decoupled_diloco.service import wire
from decoupled_diloco.syncer import Settings, Syncer
from tests.helpers import wait_for

_SHAPES = {"a": (64, 32), "b": (1000,)}


def _syncer(learners: int = 2, **settings) -> Syncer:
  params = {name: jnp.zeros(shape, jnp.float32) for name, shape in _SHAPES.items()}
  return Syncer(optax.sgd(1.0), params, range(learners), Settings(**settings))


def _received(delta) -> tuple[np.ndarray, object]:
  """(receive buffer, its decoded payload) as the service hands a push over: read-only views of the buffer."""
  parts = wire.encode(delta)
  size = wire.encoded_size(parts)
  buffer = wire.assemble(wire.chunks(parts, 1 << 12), size, size, 1 << 12)
  buffer.flags.writeable = False
  return buffer, wire.decode(buffer)


def _delta(value: float = 1e-3) -> dict:
  return {name: np.full(shape, value, np.float32) for name, shape in _SHAPES.items()}


@pytest.fixture(name="no_gc")
def _no_gc():
  gc.collect()
  gc.disable()
  yield
  gc.enable()


def _freed_once_dropped(delta, take, seconds: float = 5.0) -> bool:
  """Whether the receive buffer of `delta` is gone, with no gc pass, once the caller drops it after
  `take(payload)`.

  XLA's worker thread drops its hold on a computation's inputs just after it marks the outputs
  ready, so on a busy machine the last reference can go a few milliseconds after `take` returns
  (measured: up to 3 ms with two other threads computing). Waiting for it is not waiting for a gc
  pass: the collector is off, and a buffer only a cycle holds is never freed here.
  """
  buffer, payload = _received(delta)
  owner = weakref.ref(buffer.base)
  take(payload)
  del buffer, payload
  return wait_for(lambda: owner() is None, seconds)


@pytest.mark.usefixtures("no_gc")
def test_a_folded_push_frees_its_receive_buffer_at_once():
  syncer = _syncer()
  for learner in range(2):  # The second push merges.
    assert _freed_once_dropped(_delta(), lambda p, m=learner: syncer.receive(Push(m, p, 0, 100, 2), now=0.0))
  assert syncer.version == 1


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_a_compressed_push_frees_its_receive_buffer_at_once_and_merges_as_in_process(fmt):
  codec = compression.Codec(format=fmt, block_size=32)
  syncers = [
      Syncer(optax.sgd(1.0), {n: jnp.zeros(s, jnp.float32)
                              for n, s in _SHAPES.items()}, range(1), Settings(), codec=codec) for _ in range(2)]
  rng = np.random.default_rng(0)
  encoded = compression.encode(codec, [rng.standard_normal(s).astype(np.float32) for s in _SHAPES.values()])
  syncers[0].receive(Push(0, encoded, 0, 100, 2), now=0.0)  # In process: device arrays, no views.
  encoded = encoded._replace(leaves=tuple(jax.tree.map(np.asarray, encoded.leaves)))
  assert _freed_once_dropped(encoded, lambda p: syncers[1].receive(Push(0, p, 0, 100, 2), now=0.0))
  for got, want in zip(jax.tree.leaves(syncers[1].params), jax.tree.leaves(syncers[0].params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.usefixtures("no_gc")
def test_dropped_and_refused_pushes_free_their_receive_buffers_at_once():
  syncer = _syncer(max_staleness=0)
  syncer.receive(Push(0, _delta(), 0, 100, 2), now=0.0)
  syncer.receive(Push(1, _delta(), 0, 100, 2), now=0.0)  # Version 1 now: a push from version 0 is over-stale.
  assert _freed_once_dropped(_delta(), lambda p: syncer.receive(Push(0, p, 0, 100, 2), now=1.0))
  assert syncer.counts["dropped"] == 1
  bad = _delta()
  bad["b"][-1] = np.nan

  def refused(p):
    with pytest.raises(PushRejected, match="NaN or Inf"):
      syncer.receive(Push(0, p, 1, 100, 2), now=2.0)

  assert _freed_once_dropped(bad, refused)


def test_a_callers_own_device_arrays_are_left_alone():
  """In-process runtimes hand their Δ over as device arrays: only the syncer's own views are deleted."""
  syncer = _syncer()
  delta = jax.device_put({name: jnp.full(shape, 1e-3, jnp.float32) for name, shape in _SHAPES.items()}, syncer.device)
  syncer.receive(Push(0, delta, 0, 100, 2), now=0.0)
  assert float(delta["b"][0]) == pytest.approx(1e-3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("position", [0, 7, 999])
def test_finite_check_finds_every_nan_and_inf(bad, position):
  values = np.ones(1000, np.float32)
  values[position] = bad
  assert not all_finite({"x": np.ones(3, np.float32), "y": values})
  assert not all_finite({"y": jnp.asarray(values, jnp.bfloat16)})


@pytest.mark.parametrize("on_device", [False, True])
def test_finite_check_accepts_values_whose_squares_overflow(on_device):
  """The fast pass sums squares: 3e38² overflows though every value is finite; the exact pass decides."""
  put = jnp.asarray if on_device else np.asarray
  huge = {
      "x": put(np.full(8, 3e38, np.float32)), "y": put(np.full(8, -3e38, np.float32)),
      "empty": put(np.zeros(0, np.float32))}
  assert all_finite(huge)
  huge["x"] = put(np.array([3e38] * 7 + [np.nan], np.float32))
  assert not all_finite(huge)


def test_a_received_payload_is_taken_without_a_copy_and_bfloat16_by_its_bits():
  """DLPack views of the receive buffer itself (read-only views included); bfloat16, which DLPack lacks, bit-cast."""
  syncer = _syncer()
  _, payload = _received({"f32": np.arange(1000, dtype=np.float32), "bf16": np.arange(64, dtype=jnp.bfloat16)})
  assert not payload["f32"].flags.writeable
  views = {name: host_view(array, syncer.device) for name, array in payload.items()}
  assert views["f32"].unsafe_buffer_pointer() == payload["f32"].ctypes.data
  assert views["bf16"].dtype == jnp.bfloat16
  for name, array in payload.items():
    np.testing.assert_array_equal(np.asarray(views[name]), array)

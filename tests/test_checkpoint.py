"""Checkpoint round trips of mixed host/device run state, pruning and crash safety."""

import gc
import logging
import os
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from decoupled_diloco.checkpoint import Checkpointer, abstract_like
from tests.test_durability import _fill, tiny_disk  # pylint: disable=unused-import


def _learner_state(seed: float):
  """AdamW state of a tiny model, sharded over a 2-device mesh (devices 2 and 3)."""
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[2:4])
  shardings = {"w": NamedSharding(mesh, P(None, "data")), "b": NamedSharding(mesh, P())}
  params = jax.device_put({"w": jnp.full((4, 6), seed, jnp.float32), "b": jnp.arange(6, dtype=jnp.float32)}, shardings)
  optimizer = optax.adamw(1e-2)
  with jax.set_mesh(mesh):
    opt_state = jax.jit(optimizer.init)(params)
    grads = jax.tree.map(lambda p: p * 0.5 + 1.0, params)
    _, opt_state = jax.jit(optimizer.update)(grads, opt_state, params)
    abstract = jax.eval_shape(optimizer.init, params)
  # The abstract target a resuming trainer builds: eval_shape + the learner's shardings.
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s.sharding), abstract, opt_state)
  return opt_state, abstract


def _host_state(seed: float):
  """Syncer-side global params and outer momentum as host numpy arrays."""
  return {
      "params": {"w": np.full((4, 6), seed, np.float32), "b": np.arange(6, dtype=np.float32)},
      "momentum": (np.ones((3,), np.float32) * seed, np.array(7, np.int32)),}


def _host_abstract():
  return jax.tree.map(np.zeros_like, _host_state(0.0))


def _assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    assert np.asarray(a).dtype == np.asarray(e).dtype


def test_round_trip_of_host_and_sharded_state(tmp_path):
  opt_state, opt_abstract = _learner_state(3.0)
  host = _host_state(3.0)
  metadata = {"outer_step": 12, "config": {"model": {"d_model": 32}, "devices": [2, 2]}}
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(12, {"syncer": host, "learner_0": opt_state}, metadata)
    state, restored_metadata = ckpt.restore(12, {"syncer": _host_abstract(), "learner_0": opt_abstract})
    assert ckpt.restore_metadata(12) == metadata

  assert restored_metadata == metadata
  _assert_trees_equal(state["syncer"], host)
  assert all(type(x) is np.ndarray for x in jax.tree.leaves(state["syncer"]))

  restored_opt = state["learner_0"]
  _assert_trees_equal(restored_opt, opt_state)
  assert isinstance(restored_opt[0], optax.ScaleByAdamState)
  assert int(restored_opt[0].count) == 1
  for leaf, want in zip(jax.tree.leaves(restored_opt), jax.tree.leaves(opt_abstract)):
    assert isinstance(leaf, jax.Array)
    assert leaf.sharding == want.sharding
    assert {d.id for d in leaf.devices()} == {2, 3}


def test_restore_onto_a_different_mesh(tmp_path):
  opt_state, _ = _learner_state(1.0)
  other_mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[6:8])
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other_mesh, P())),
      opt_state,
  )
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"learner": opt_state}, {})
    state, _ = ckpt.restore(1, {"learner": target})
  _assert_trees_equal(state["learner"], opt_state)
  for leaf in jax.tree.leaves(state["learner"]):
    assert {d.id for d in leaf.devices()} == {6, 7}


def test_abstract_like_keeps_host_leaves_and_shardings():
  opt_state, _ = _learner_state(1.0)
  abstract = abstract_like({"host": _host_state(1.0), "learner": opt_state})
  assert all(type(x) is np.ndarray for x in jax.tree.leaves(abstract["host"]))
  for leaf, want in zip(jax.tree.leaves(abstract["learner"]), jax.tree.leaves(opt_state)):
    assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert leaf.sharding == want.sharding


def test_unplaced_abstract_leaf_is_rejected(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"syncer": _host_state(1.0)}, {})
    unplaced = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _host_state(0.0))
    with pytest.raises(ValueError, match="without a sharding"):
      ckpt.restore(1, {"syncer": unplaced})
    with pytest.raises(ValueError, match="available steps are \\[1\\]"):
      ckpt.restore(2, {"syncer": _host_abstract()})


def test_latest_step_and_max_to_keep(tmp_path):
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    for step in (1, 2, 3, 4):
      ckpt.save(step, {"syncer": _host_state(float(step))}, {"outer_step": step})
    assert ckpt.latest_step() == 4
    assert ckpt.all_steps() == [3, 4]
  assert sorted(os.listdir(tmp_path)) == ["3", "4"]
  with Checkpointer(tmp_path, max_to_keep=2) as reopened:
    assert reopened.latest_step() == 4
    state, metadata = reopened.restore(4, {"syncer": _host_abstract()})
  assert metadata == {"outer_step": 4}
  _assert_trees_equal(state["syncer"], _host_state(4.0))


def test_save_interval_skips_off_interval_steps(tmp_path):
  with Checkpointer(tmp_path, save_interval_steps=2) as ckpt:
    for step in (2, 3, 4, 5):
      ckpt.save(step, {"syncer": _host_state(1.0)}, {})
    assert ckpt.all_steps() == [2, 4]


_CRASH_MID_SAVE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import orbax.checkpoint as ocp
    from decoupled_diloco.checkpoint import Checkpointer

    directory = sys.argv[1]
    with Checkpointer(directory) as ckpt:
      ckpt.save(1, {"syncer": {"x": np.full((8,), 1.0, np.float32)}}, {"outer_step": 1})
    # Start writing step 2 in the background, exactly as orbax does, then die before the
    # write and the final rename complete.
    manager = ocp.CheckpointManager(directory)
    manager.save(2, args=ocp.args.Composite(
        syncer=ocp.args.StandardSave({"x": np.full((1 << 22,), 2.0, np.float32)}),
        metadata=ocp.args.JsonSave({"outer_step": 2})))
    # Orbax may make the step's temporary folder in a thread of its own: die once it is there.
    deadline = time.monotonic() + 60
    while not any(name.startswith("2.") for name in os.listdir(directory)) and time.monotonic() < deadline:
      time.sleep(1e-3)
    os._exit(1)
""")


@pytest.mark.slow
def test_crash_mid_save_is_never_the_latest_step(tmp_path):
  directory = str(tmp_path / "ckpt")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _CRASH_MID_SAVE, directory], env=env, capture_output=True, timeout=120)
  assert result.returncode == 1, result.stderr.decode()[-2000:]
  leftovers = sorted(os.listdir(directory))
  assert "1" in leftovers and "2" not in leftovers
  assert any(name.startswith("2.") and "tmp" in name for name in leftovers), leftovers

  with Checkpointer(directory) as ckpt:
    assert ckpt.latest_step() == 1
    state, metadata = ckpt.restore(1, {"syncer": {"x": np.zeros((8,), np.float32)}})
    assert metadata == {"outer_step": 1}
    np.testing.assert_array_equal(state["syncer"]["x"], np.full((8,), 1.0, np.float32))
    # The resumed run can write step 2 again.
    ckpt.save(2, {"syncer": {"x": np.full((8,), 2.0, np.float32)}}, {"outer_step": 2})
    assert ckpt.latest_step() == 2
  assert sorted(os.listdir(directory)) == ["1", "2"]


_SAVE_MEMORY = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from decoupled_diloco.checkpoint import Checkpointer
    from decoupled_diloco.syncer import map_large_blocks
    from experiments.benchmarks import common
    map_large_blocks()  # As the syncer process does.
    rng = np.random.default_rng(0)  # Random floats: what Θ looks like to a compressor.
    state = {name: {f"w{i}": jax.device_put(rng.standard_normal((1 << 20,), np.float32)) for i in range(8)}
             for name in ("params", "opt_state")}
    with Checkpointer(sys.argv[1], max_to_keep=2) as ckpt:
      ckpt.save(0, state, {})  # Orbax's threads and first allocations.
      before = common.reset_peak_kb()
      for step in range(1, 4):
        ckpt.save(step, state, {})
      print(before, common.status_kb("VmHWM"), common.status_kb("VmRSS"))
    """)


def test_saves_hold_no_copy_of_the_state(tmp_path):
  """The syncer saves Θ and its outer state (8 B/param) every few merges: orbax's default zstd kept
  twice the saved bytes around (+17 B/param at the peak, +14 left behind). A save now holds only a
  few tensors in flight, and nothing stays."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-c", _SAVE_MEMORY, str(tmp_path / "ckpt")], env=env, capture_output=True, timeout=120,
      check=True)
  before, peak, after = (int(kb) for kb in result.stdout.split()[-3:])
  state_kb = 2 * 8 * 4 << 10  # 16 tensors of 4 MiB.
  assert peak - before < state_kb / 4, (before, peak, after)
  assert after - before < state_kb / 8, (before, peak, after)


def test_a_save_on_a_full_disk_raises_its_error_and_logs_no_traceback(tiny_disk, caplog, capfd):
  """Before: each of orbax's writer threads logged the failure with its traceback, then TensorStore's writes still
  in flight printed theirs and asyncio its unretrieved futures', some after the save had raised (30 tracebacks a
  failed save, where the syncer and the learners promise one line: their own, from the raised error)."""
  with Checkpointer(tiny_disk / "checkpoints") as ckpt:
    ckpt.save(0, {"syncer": {"x": np.zeros((8,), np.float32)}}, {"outer_step": 0})
    filler = _fill(str(tiny_disk), 64 << 10)
    capfd.readouterr()
    with caplog.at_level(logging.INFO), pytest.raises((OSError, ValueError), match="No space left|RESOURCE_EXHAUSTED"):
      ckpt.save(1, {"syncer": {"x": np.full((1 << 18,), 2.0, np.float32)}}, {"outer_step": 1})  # 1 MiB.
    gc.collect()  # Writes still in flight finish (their callbacks run) before the checks.
    time.sleep(1.0)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Traceback" not in capfd.readouterr().err and ckpt.all_steps() == [0]
    os.remove(filler)


def test_a_reader_leaves_a_save_in_progress_and_a_missing_directory_alone(tmp_path):
  """A syncer reads what run a workdir (or a sibling shard's folder) holds before it takes any lock: it must not
  remove the tmp directory another process is saving into, as a Checkpointer that will save does at start."""
  with Checkpointer(tmp_path / "run") as ckpt:
    ckpt.save(0, {"syncer": {"x": np.zeros((8,), np.float32)}}, {"outer_step": 0})
  in_progress = tmp_path / "run" / "1.orbax-checkpoint-tmp"
  in_progress.mkdir()
  with Checkpointer(tmp_path / "run", reader=True) as reader:
    assert reader.all_steps() == [0] and reader.restore_metadata(0) == {"outer_step": 0}
  with Checkpointer(tmp_path / "absent", reader=True) as reader:
    assert reader.latest_step() is None
  assert in_progress.is_dir() and not (tmp_path / "absent").exists()
  with Checkpointer(tmp_path / "run") as ckpt:  # One that saves cleans up after crashed saves (a save awaits it).
    ckpt.save(2, {"syncer": {"x": np.zeros((8,), np.float32)}}, {"outer_step": 2})
  assert not in_progress.exists()

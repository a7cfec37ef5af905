"""The syncer state machine: quorum, grace window, staleness drops and bad pushes, with numbers."""

import subprocess
import sys

import chex
import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from decoupled_diloco import accumulate, outer
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.push import Push, PushRejected
from decoupled_diloco.syncer import Settings, Syncer, grace_seconds


def _tree(value):
  return {"w": jnp.full((3, 2), value, jnp.float32), "b": {"v": jnp.full((4,), value, jnp.float32)}}


def _push(learner, value, base=0, tokens=10, steps=2, seconds=2.0):
  return Push(learner, _tree(value), base, tokens, steps, seconds)


def _syncer(learners=(0, 1, 2), **settings):
  return Syncer(optax.sgd(1.0), _tree(10.0), learners, Settings(**settings))


@pytest.mark.parametrize("tokens, expected", [((1, 1, 1), 8.0), ((1, 2, 5), 7.5)])
def test_outer_sgd_lr1_without_momentum_makes_theta_the_weighted_mean(tokens, expected):
  syncer = _syncer(token_weighting="tokens")
  for learner, (value, n) in enumerate(zip((1.0, 2.0, 3.0), tokens)):
    theta = _tree(10.0 - value)
    syncer.receive(Push(learner, outer.pseudo_gradient(syncer.params, theta), 0, n, 1), now=0.0)
  chex.assert_trees_all_close(syncer.params, _tree(expected), atol=1e-6)
  assert syncer.version == 1


def test_quorum_k_merges_as_soon_as_k_learners_reported():
  syncer = _syncer(quorum=2)
  assert syncer.receive(_push(0, 1.0), now=1.0) == (True, None)
  assert syncer.receive(_push(0, 1.0), now=2.0) == (True, None)  # the same learner again: still one reporter
  accepted, report = syncer.receive(_push(1, 4.0), now=3.0)
  assert accepted and report.version == 1 and report.learners == (0, 0, 1)
  chex.assert_trees_all_close(syncer.params, _tree(8.0))  # 10 - mean(1, 1, 4)
  assert syncer.pending == [] and syncer.deadlines == []


def test_grace_window_waits_within_the_slack_then_merges_on_deadline():
  assert grace_seconds(0.5, overlap_steps=4, step_seconds=1.0, quorum_seconds=1.0, sync_seconds=0.5) == 1.25
  assert grace_seconds(0.5, overlap_steps=1, step_seconds=1.0, quorum_seconds=2.0, sync_seconds=0.0) == 0.0
  syncer = _syncer(quorum=1, grace_gamma=0.5, grace_overlap_steps=4)
  # Step EMA = 2 s / 2 steps = 1 s; quorum met at once (0 s): grace = 0.5 * (4 * 1 - 0 - 0) = 2 s.
  assert syncer.receive(_push(0, 1.0), now=10.0) == (True, None)
  assert syncer.deadlines == [pytest.approx(12.0)]
  assert syncer.on_deadline(11.0) == []  # too early
  assert syncer.receive(_push(1, 3.0), now=11.5) == (True, None)  # joins inside the window
  [report] = syncer.on_deadline(12.0)
  assert report.learners == (0, 1) and syncer.version == 1
  chex.assert_trees_all_close(syncer.params, _tree(8.0))


def test_grace_window_closes_early_when_every_learner_reported():
  syncer = _syncer(learners=(0, 1), quorum=1, grace_gamma=0.5, grace_overlap_steps=4)
  syncer.receive(_push(0, 1.0), now=0.0)
  accepted, report = syncer.receive(_push(1, 1.0), now=0.5)
  assert report is not None and report.learners == (0, 1)


def test_staleness_weights_and_the_drop_bound():
  syncer = _syncer(learners=(0, 1), quorum=1, staleness="polynomial", staleness_a=1.0, max_staleness=1,
                   token_weighting="none")
  syncer.receive(_push(0, 1.0), now=0.0)
  syncer.receive(_push(0, 1.0, base=1), now=1.0)
  assert syncer.version == 2
  accepted, report = syncer.receive(_push(1, 1.0, base=0), now=2.0)  # staleness 2 > 1: dropped
  assert not accepted and report is None and syncer.counts["dropped"] == 1 and syncer.version == 2
  q = _syncer(learners=(0, 1), quorum=2, staleness="polynomial", staleness_a=1.0, token_weighting="none")
  q.receive(_push(0, 1.0), now=0.0)
  q.receive(_push(1, 1.0), now=0.0)  # version 1
  q.receive(_push(0, 3.0, base=1), now=1.0)  # staleness 0: weight 1
  _, report = q.receive(_push(1, 6.0, base=0), now=1.0)  # staleness 1: factor 1/2
  assert report.staleness == (0, 1)
  np.testing.assert_allclose(report.weights, (0.5, 0.25), rtol=1e-6)  # equal shares, then damped
  chex.assert_trees_all_close(q.params, _tree(10.0 - 1.0 - (0.5 * 3.0 + 0.25 * 6.0)), atol=1e-5)
  lone = _syncer(learners=(0, 1), quorum=1, staleness="polynomial", staleness_a=1.0)
  lone.receive(_push(0, 1.0), now=0.0)
  _, report = lone.receive(_push(1, 4.0, base=0), now=1.0)  # alone in its merge, yet damped
  assert report.weights == (0.5,)
  chex.assert_trees_all_close(lone.params, _tree(10.0 - 1.0 - 2.0), atol=1e-5)


def _bad_pushes():
  nan = _tree(1.0)
  nan["w"] = nan["w"].at[0, 0].set(jnp.nan)
  inf = _tree(1.0)
  inf["b"]["v"] = inf["b"]["v"].at[1].set(jnp.inf)
  return [
      (Push(0, nan, 0, 10, 2), "NaN or Inf"),
      (Push(0, inf, 0, 10, 2), "NaN or Inf"),
      (Push(0, {"w": _tree(1.0)["w"]}, 0, 10, 2), "tree structure"),
      (Push(0, {"w": jnp.ones((2, 3)), "b": {"v": jnp.ones(4)}}, 0, 10, 2), r"expected float32\[3, 2\]"),
      (Push(0, {"w": jnp.ones((3, 2), jnp.bfloat16), "b": {"v": jnp.ones(4)}}, 0, 10, 2), "bfloat16"),
      (Push(7, _tree(1.0), 0, 10, 2), "unknown learner"),
      (Push(0, _tree(1.0), 5, 10, 2), "from the future"),
      (Push(0, _tree(1.0), 0, 10, 0), "local_steps"),
      (Push(0, _tree(1.0), 0, 0, 2), "tokens=0"),
      (Push(0, {"w": "abc", "b": {"v": jnp.ones(4)}}, 0, 10, 2), "not a valid tree or payload of arrays"),]


@pytest.mark.parametrize("push, message", _bad_pushes())
def test_bad_pushes_are_rejected_and_leave_the_state_untouched(push, message):
  syncer = _syncer(quorum=1)
  before = jax.tree.map(np.asarray, syncer.state)
  with pytest.raises(PushRejected, match=message):
    syncer.receive(push, now=0.0)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, syncer.state), before)
  assert syncer.pending == [] and syncer.counts["rejected"] == 1 and syncer.version == 0
  assert syncer.receive(_push(0, 1.0), now=1.0)[1] is not None  # the run continues


def test_a_push_over_max_push_norm_is_refused_counted_and_changes_nothing():
  syncer = _syncer(quorum=1, max_push_norm=10.0)  # ‖_tree(v)‖ = √10 · v.
  before = jax.tree.map(np.asarray, syncer.state)
  with pytest.raises(PushRejected, match="exceeds syncer.max_push_norm=10"):
    syncer.receive(_push(0, 4.0), now=0.0)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, syncer.state), before)
  assert syncer.counts["rejected"] == 1 and syncer.version == 0
  syncer.receive(_push(0, 3.0), now=1.0)  # √90 < 10: merged.
  assert syncer.version == 1 and syncer.verdict.norm == pytest.approx(np.sqrt(90.0))


def test_clip_scales_an_outlier_to_a_multiple_of_the_median_norm_before_its_weights():
  syncer = _syncer(quorum=1, merge_rule="clip", clip_multiple=2.0, clip_window=4, staleness="polynomial",
                   staleness_a=1.0)
  for learner in (0, 1):
    syncer.receive(_push(learner, 1.0, base=syncer.version), now=0.0)  # Never clipped: Θ 10 → 9 → 8.
    assert syncer.verdict.fields() == {"checked_norm": pytest.approx(np.sqrt(10)), "clip_factor": 1.0, "clipped": 0}
  _, report = syncer.receive(_push(2, 100.0, base=1), now=0.0)  # Staleness 1: weight 1/2.
  # Median of (√10, √10, 100√10) is √10: the push is scaled by 2/100, then halved: Θ = 8 − 100 · 0.02 · 0.5.
  assert syncer.verdict.clip_factor == pytest.approx(0.02) and syncer.verdict.fields()["clipped"] == 1
  chex.assert_trees_all_close(syncer.params, _tree(7.0), atol=1e-5)
  assert report.weights == (0.5,) and syncer.recent_norms == [pytest.approx([np.sqrt(10)] * 2 + [np.sqrt(1e5)])]


def test_clip_judges_a_push_by_the_open_merges_pushes_too():
  syncer = _syncer(quorum=3, merge_rule="clip", clip_multiple=1.0)
  syncer.receive(_push(0, 100.0), now=0.0)  # First of the run: judged by itself, not clipped.
  syncer.receive(_push(1, 1.0), now=0.0)
  assert syncer.verdict.clip_factor == 1.0
  _, report = syncer.receive(_push(2, 2.0), now=0.0)  # Median of (100, 1, 2)·√10 is 2√10: not clipped.
  assert syncer.verdict.clip_factor == 1.0 and report is not None
  syncer.receive(_push(0, 50.0, base=1), now=0.0)  # Median of (100, 1, 2, 50)·√10 = 26√10.
  assert syncer.verdict.clip_factor == pytest.approx(26 / 50)


def test_clip_without_outliers_merges_as_the_mean_bit_for_bit():
  pushes = [_push(m, v) for m, v in enumerate((1.0, 1.5, 0.7))]
  merged = {}
  for rule in ("mean", "clip"):
    syncer = _syncer(quorum=3, merge_rule=rule)
    for push in pushes:
      syncer.receive(push, now=0.0)
    merged[rule] = jax.tree.map(np.asarray, syncer.params)
  jax.tree.map(np.testing.assert_array_equal, merged["mean"], merged["clip"])


def test_trimmed_mean_merge_equals_a_numpy_reference_with_token_and_staleness_weights():
  rng = np.random.default_rng(3)
  values = [rng.standard_normal(10).astype(np.float32) for _ in range(4)]
  values[1] = values[1] * 100.0
  tree = lambda v: {"w": jnp.asarray(v[:6].reshape(3, 2)), "b": {"v": jnp.asarray(v[6:])}}
  syncer = _syncer(learners=range(4), quorum=4, merge_rule="trimmed_mean", trim_fraction=0.25, staleness="polynomial",
                   staleness_a=1.0)
  syncer.merge(0.0)  # Nothing pending: no merge.
  syncer.receive(_push(0, 0.0), now=0.0)
  syncer.merge(0.0)  # Version 1: base 0 is now staleness 1 (factor 1/2).
  tokens, bases = (10, 20, 10, 40), (1, 1, 0, 1)
  for m, v in enumerate(values):
    _, report = syncer.receive(Push(m, tree(v), bases[m], tokens[m], 2), now=1.0)
  stack = np.stack(values).astype(np.float64)
  damping = np.array([1.0, 1.0, 0.5, 1.0])
  order = np.argsort(stack, axis=0, kind="stable")
  kept = np.zeros_like(stack, bool)
  np.put_along_axis(kept, order[1:3], True, axis=0)
  expected = (kept * damping[:, None] * np.asarray(tokens)[:, None] *
              stack).sum(0) / (kept * np.asarray(tokens)[:, None]).sum(0)
  got = 10.0 - np.concatenate([np.asarray(syncer.params["b"]["v"]), np.asarray(syncer.params["w"]).reshape(-1)])
  np.testing.assert_allclose(got, np.concatenate([expected[6:], expected[:6]]), rtol=1e-5, atol=1e-5)
  assert report.trimmed[1] == 1.0 and syncer.fragments[0].held == []


def test_syncer_state_lives_on_the_host_device():
  syncer = _syncer()
  devices = {d for leaf in jax.tree.leaves(syncer.state) if isinstance(leaf, jax.Array) for d in leaf.devices()}
  assert devices == {syncer.device}


def test_outer_nesterov_follows_the_pytorch_formula():
  cfg = ml_collections.ConfigDict({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True})
  syncer = Syncer(outer.outer_optimizer(cfg), {"x": jnp.zeros(())}, [0], Settings())
  theta, buf = 0.0, 0.0
  for g in (1.0, -0.5, 2.0):
    syncer.receive(Push(0, {"x": jnp.asarray(g, jnp.float32)}, syncer.version, 1, 1), now=0.0)
    buf = 0.9 * buf + g
    theta -= 0.7 * (g + 0.9 * buf)
    np.testing.assert_allclose(float(syncer.params["x"]), theta, rtol=1e-6)


def test_a_push_from_another_device_is_moved_to_the_host_and_merged():
  syncer = _syncer(learners=(0, 1), quorum=2)
  elsewhere = jax.device_put(_tree(1.0), jax.devices()[3])
  syncer.receive(Push(0, elsewhere, 0, 10, 2), now=0.0)
  _, report = syncer.receive(_push(1, 3.0), now=0.0)
  assert report is not None
  chex.assert_trees_all_close(syncer.params, _tree(8.0))


@pytest.mark.parametrize("settings, message", [
    ({"quorum": 5}, "exceeds the 3 learners"),])
def test_impossible_settings_are_refused_up_front(settings, message):
  with pytest.raises(ConfigError, match=message):
    _syncer(**settings)


@pytest.mark.parametrize("field, value", [("staleness_a", -1.0), ("staleness_b", -1.0), ("max_staleness", -2),
                                          ("ema", 0.0), ("grace_gamma", 1.0), ("clip_multiple", 0.5),
                                          ("clip_window", 0), ("trim_fraction", 0.5), ("max_push_norm", -1.0)])
def test_settings_from_config_reject_out_of_range_values(field, value):
  with pytest.raises(ConfigError, match=f"syncer.{field}"):
    Settings.from_config(ml_collections.ConfigDict({field: value}))


def test_warm_up_reads_only_shapes_so_it_can_run_beside_merges():
  # A restarted syncer warms up in a thread while it serves: a merge may donate (delete) the live
  # outer state meanwhile, and the warm-up must neither need those buffers nor change anything.
  syncer = Syncer(optax.sgd(0.5, momentum=0.9), _tree(10.0), (0, 1, 2), Settings())
  before = jax.tree.map(np.asarray, (syncer.params, syncer.fragments[0].opt_state))
  syncer.warm_up()
  chex.assert_trees_all_equal((syncer.params, syncer.fragments[0].opt_state), before)
  for leaf in jax.tree.leaves(syncer.fragments[0].opt_state):
    leaf.delete()  # As a concurrent merge's donation leaves them.
  syncer.warm_up()
  chex.assert_trees_all_equal(syncer.params, before[0])


def test_after_warm_up_merges_compile_nothing():
  # The first outer state was left uncommitted to the syncer's device, so the second merge compiled
  # the outer step again (~0.1 s a learner waited for).
  syncer = Syncer(optax.sgd(0.5, momentum=0.9, nesterov=True), _tree(10.0), (0, 1), Settings())
  syncer.warm_up()
  jitted = (accumulate._jit_accumulate, accumulate._jit_merged, accumulate._jit_outer_step)
  compiled = [f._cache_size() for f in jitted]
  for merge in range(3):
    for learner in range(2):
      syncer.receive(_push(learner, 0.5, base=merge), now=0.0)
  assert syncer.version == 3
  assert [f._cache_size() for f in jitted] == compiled


_HEAP_FREE_MB = """
import ctypes, gc, sys
import numpy as np, optax
from decoupled_diloco import syncer as syncer_lib
from decoupled_diloco.push import Push
if sys.argv[1] == "map":
  syncer_lib.map_large_blocks()
class Info(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usm fsm uord fordblks keep".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
tree = lambda v: {f"w{i}": np.full((1 << 20,), v, np.float32) for i in range(4)}  # 16 MB in 4 MB tensors
syncer = syncer_lib.Syncer(optax.sgd(0.5, momentum=0.9), tree(1.0), (0, 1), syncer_lib.Settings())
syncer.warm_up()
for merge in range(3):
  for learner in range(2):
    syncer.receive(Push(learner, tree(0.5), merge, 8, 1), now=0.0)
gc.collect()
print(libc.mallinfo2().fordblks >> 20)
"""


def test_freed_tensors_go_back_to_the_os_at_any_tensor_size():
  # Without map_large_blocks glibc kept ~108 MB of freed pushes, sums and old Θs in its heap here
  # (tensors under 32 MB): RSS that no merge needed. A child process: the setting is the whole process's.
  child = subprocess.run([sys.executable, "-c", _HEAP_FREE_MB, "map"], capture_output=True, text=True, check=True)
  assert int(child.stdout.split()[-1]) < 16, child.stdout  # Less than one Θ.

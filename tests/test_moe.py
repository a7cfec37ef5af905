"""Mixture-of-experts blocks: routing and capacity by hand, the router losses against their equations, the
one-expert model against the dense one, expert parallelism against one device, and MoE training runs."""

import math
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from decoupled_diloco import experiment, mesh as mesh_lib
from decoupled_diloco import model as model_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model import moe
from decoupled_diloco.runtime import sim
from tests.helpers import read_records as _records
from tests.helpers import tiny_config

MOE = dict(num_experts=4, top_k=2, capacity_factor=1.25, every=1, d_ff=32, shared_experts=0, aux_loss_weight=0.01,
           z_loss_weight=0.001)


def cfg(moe_overrides=None, **overrides) -> ml_collections.ConfigDict:
  """A tiny two-block SwiGLU model with four experts of width 32, top-2, unless overridden."""
  base = dict(vocab_size=256, seq_len=16, d_model=32, num_layers=2, num_heads=4, d_ff=64, mlp='swiglu',
              moe={**MOE, **(moe_overrides or {})})
  return ml_collections.ConfigDict({**base, **overrides})


def _batch(rows=4, seq_len=16):
  return jax.random.randint(jax.random.key(1), (rows, seq_len + 1), 0, 256, dtype=jnp.int32)


def _worst(a, b) -> float:
  return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


def test_top_k_gates_are_renormalised_and_first_choices_queue_first():
  probs = jnp.array([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])
  _, gates, experts = moe.route(jnp.log(probs), top_k=2)
  np.testing.assert_allclose(gates, [[[0.625, 0.375], [2 / 3, 1 / 3]]], rtol=1e-6)
  np.testing.assert_array_equal(experts, [[[0, 1], [1, 2]]])
  # Both tokens' first choices (0, then 1) queue before their second choices (1, then 2).
  np.testing.assert_array_equal(moe.slots(experts, 3), [[[0, 1], [0, 0]]])


def test_capacity_drops_what_overflows_an_expert_and_counts_it():
  experts = jnp.array([[[0], [0], [1], [0]]])  # Top-1 of four tokens over two experts.
  np.testing.assert_array_equal(moe.slots(experts, 2)[..., 0], [[0, 1, 0, 2]])
  assert moe.capacity(4, 2, 1, 0.5) == 1  # ceil(1 * 4 * 0.5 / 2)
  assert moe.capacity(4, 2, 1, 1.25) == 3  # ceil(2.5)
  assert moe.capacity(4, 1, 1, 4.0) == 4  # Never more than every token of the sequence.
  assert int(jnp.sum(moe.slots(experts, 2) >= moe.capacity(4, 2, 1, 0.5))) == 2  # Tokens 1 and 3.


@pytest.mark.slow  # Compiles: 40 s on the loaded 2-core machine.
def test_a_dropped_token_gets_no_expert_output():
  config = cfg({'num_experts': 2, 'top_k': 1, 'capacity_factor': 0.5}, num_layers=1)
  model, params, _ = model_lib.build_model(config, seed=0)
  layer = model.module(params).block_0.mlp
  x = jax.random.normal(jax.random.key(2), (1, 16, 32))
  out, stats = jax.jit(lambda x: layer(x))(x)  # pylint: disable=unnecessary-lambda
  _, _, experts = moe.route(jnp.einsum('btd,de->bte', x, params['block_0']['mlp']['router']), 1)
  dropped = moe.slots(experts, 2)[0, :, 0] >= moe.capacity(16, 2, 1, 0.5)
  assert int(stats['dropped']) == int(jnp.sum(dropped)) > 0 and int(stats['assigned']) == 16
  np.testing.assert_array_equal(out[0, dropped], 0.0)
  assert bool(jnp.all(jnp.any(out[0, ~dropped] != 0, axis=-1)))


def test_the_balance_and_z_losses_equal_their_equations_on_a_hand_example():
  probs = jnp.array([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3]])
  experts = jnp.array([[0], [0], [2], [1]])
  # f = (2/4, 1/4, 1/4), P = (0.4, 0.275, 0.325): E * sum f P = 3 * (0.2 + 0.06875 + 0.08125).
  np.testing.assert_allclose(moe.balance_loss(probs, experts), 3 * 0.35, rtol=1e-6)
  np.testing.assert_allclose(3 * moe.expert_share(experts, 3), [1.5, 0.75, 0.75])  # The loads records show.
  logits = jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]])  # logsumexp: ln 2, ln 4.
  np.testing.assert_allclose(moe.z_loss(logits), (math.log(2)**2 + math.log(4)**2) / 2, rtol=1e-6)


@pytest.mark.slow  # Compiles: 35 s on the loaded 2-core machine.
def test_the_training_loss_adds_the_weighted_router_losses_and_reports_them():
  model, params, _ = model_lib.build_model(cfg({'aux_loss_weight': 0.5, 'z_loss_weight': 0.25}), seed=0)
  total, metrics = jax.jit(model.train_loss)(params, _batch())
  np.testing.assert_allclose(metrics['loss'], jax.jit(model.loss)(params, _batch()), rtol=1e-6)
  np.testing.assert_allclose(total, metrics['loss'] + 0.5 * metrics['moe_aux_loss'] + 0.25 * metrics['moe_z_loss'],
                             rtol=1e-6)
  assert abs(float(metrics['moe_aux_loss']) - 1.0) < 0.1  # A router near uniform at init: E * sum f P near 1.
  assert 0 <= float(metrics['moe_dropped_fraction']) < 1


@pytest.mark.slow  # Two models' gradients compiled: 90 s on the loaded 2-core machine.
def test_one_expert_top_1_equals_the_dense_model_with_the_same_weights():
  dense_config = cfg(moe={'num_experts': 0})
  dense, params, _ = model_lib.build_model(dense_config, seed=0)
  routed, moe_params, _ = model_lib.build_model(cfg({'num_experts': 1, 'top_k': 1, 'capacity_factor': 1.0, 'd_ff': 0}),
                                                seed=0)
  for i in range(2):  # The dense MLP's weights as the single expert's.
    mlp = params[f'block_{i}']['mlp']
    moe_params[f'block_{i}']['mlp'].update({name: mlp[name]['kernel'][None] for name in ('wi', 'wg', 'wo')})
  shared = {k: v for k, v in params.items() if not k.startswith('block_')}
  moe_params.update(shared)
  for i in range(2):
    moe_params[f'block_{i}'].update({k: v for k, v in params[f'block_{i}'].items() if k != 'mlp'})
  (loss, grads), (moe_loss, moe_grads) = (
      jax.jit(jax.value_and_grad(m.loss))(p, _batch()) for m, p in ((dense, params), (routed, moe_params)))
  np.testing.assert_allclose(moe_loss, loss, rtol=1e-6)
  for i in range(2):
    mlp, expert = grads[f'block_{i}'].pop('mlp'), moe_grads[f'block_{i}'].pop('mlp')
    assert _worst({k: v['kernel'] for k, v in mlp.items()}, {k: expert[k][0] for k in mlp}) <= 1e-6
  assert _worst(grads, moe_grads) <= 1e-6


@pytest.mark.slow  # Two models' gradients compiled: 70 s on the loaded 2-core machine.
def test_dropless_routing_equals_routing_with_room_for_every_token():
  batch = _batch()
  roomy, params, _ = model_lib.build_model(cfg({'capacity_factor': 2.0}), seed=0)  # C = k * T * 2 / E = T.
  dropless, _, _ = model_lib.build_model(cfg({'capacity_factor': 0.0}), seed=0)
  (loss, grads), (free_loss,
                  free_grads) = (jax.jit(jax.value_and_grad(m.loss))(params, batch) for m in (roomy, dropless))
  np.testing.assert_allclose(free_loss, loss, rtol=1e-5)
  assert _worst(grads, free_grads) <= 1e-5


@pytest.mark.slow  # Sharded and unsharded gradients compiled: 50-110 s each on the loaded 2-core machine.
@pytest.mark.parametrize(
    'layout,moe_overrides,overrides',
    [
        ('expert=2', {}, {}),
        ('expert=4', {'every': 2, 'shared_experts': 1}, {'remat': 'full'}),
        ('expert=2', {'capacity_factor': 0.0}, {}),  # Dropless: XLA lays out the grouped matmuls itself.
        ('fsdp=2,expert=2', {}, {'scan_layers': True, 'remat': 'full'}),])
def test_expert_sharding_computes_the_unsharded_loss_and_gradients(layout, moe_overrides, overrides):
  config = cfg(moe_overrides, **overrides)
  model, params, axes = model_lib.build_model(config, seed=0)
  batch = _batch(rows=8)
  step = jax.value_and_grad(model.train_loss, has_aux=True)
  (loss, metrics), grads = jax.jit(step)(params, batch)
  parsed = mesh_lib.Layout.parse(layout, int(np.prod([int(a.split('=')[1]) for a in layout.split(',')])), 0)
  mesh = mesh_lib.group_mesh(jax.devices()[:parsed.devices], parsed)
  shardings = mesh_lib.param_shardings(mesh, params, axes)
  assert shardings['block_1']['mlp']['wi'].spec[0] == 'expert'

  def under_mesh(p, b):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return step(p, b)

  sharded = jax.jit(under_mesh, in_shardings=(shardings, mesh_lib.batch_sharding(mesh)))
  (sharded_loss, sharded_metrics), sharded_grads = sharded(jax.device_put(params, shardings), batch)
  assert abs(float(sharded_loss) - float(loss)) <= 1e-5
  assert _worst(metrics, sharded_metrics) <= 1e-5 and _worst(grads, sharded_grads) <= 1e-5
  assert sharded_grads['block_1']['mlp']['wi'].sharding.spec[0] == 'expert'


@pytest.mark.parametrize('overrides,message', [
    ({'top_k': 5}, 'model.moe.top_k=5 must be in'),
    ({'capacity_factor': -1.0}, 'model.moe.capacity_factor=-1.0 must be a number >= 0'),
    ({'every': 3}, 'model.moe.every=3 > model.num_layers=2'),
    ({'num_experts': 0, 'top_k': 1}, 'model.moe.top_k is set but model.moe.num_experts=0'),
    ({'every': 2, 'num_experts': 4}, 'scan_layers cannot stack'),
    ({'typo': 1}, 'model.moe.typo is not a config field'),])
def test_bad_moe_settings_name_the_fix(overrides, message):
  config = cfg(overrides, scan_layers='every' in overrides and overrides['every'] == 2)
  with pytest.raises(ConfigError, match=message):
    model_lib.Settings.from_config(config)


def test_an_expert_axis_must_divide_the_experts():
  config = tiny_config(**{'model.moe.num_experts': 6, 'learners.layouts': ('expert=2', 'expert=2')})
  experiment.validate(config)
  config = tiny_config(
      **{
          'model.moe.num_experts': 4, 'learners.devices': (4,), 'learners.batch_size': (4,), 'learners.layouts': (
              'expert=4',), 'mode': 'ddp'})
  experiment.validate(config)
  with pytest.raises(ConfigError, match='splits model.moe.num_experts=6 experts over expert=4'):
    experiment.validate(
        tiny_config(
            **{
                'model.moe.num_experts': 6, 'learners.devices': (4,), 'mode': 'ddp', 'learners.batch_size': (4,),
                'learners.layouts': ('expert=4',)}))
  with pytest.raises(ConfigError, match='num_experts=0 experts over expert=2'):
    experiment.validate(tiny_config(**{'learners.layouts': ('expert=2', 'data=2')}))


def _moe_run(**overrides):
  """tiny_config with 4 experts of width 32, top-2, each group's experts over its 2 devices, on the clock."""
  return tiny_config(
      **{
          'runtime': 'sim', 'model.moe.num_experts': 4, 'model.moe.d_ff': 32, 'learners.layouts': (
              'expert=2', 'expert=2'), 'outer_steps': 4, 'inner_steps': 5, **overrides})


@pytest.mark.slow  # Two simulated runs of 20 steps per learner.
@pytest.mark.parametrize('mode', ['diloco', 'decoupled'])
def test_an_moe_model_learns_under_diloco_and_decoupled_and_records_its_routers(mode, tmp_path):
  sim.run(experiment.build(_moe_run(mode=mode)), str(tmp_path))
  evals = [r['eval_loss'] for r in _records(tmp_path, 'eval')]
  assert evals[-1] < math.log(256) - 1.0 and evals[-1] < evals[0], evals
  train = _records(tmp_path, 'train')
  assert {r['learner'] for r in train} == {0, 1}
  for record in train:
    assert 0.9 < record['moe_aux_loss'] < 2.0 and record['moe_z_loss'] > 0
    assert 0 <= record['moe_dropped_fraction'] < 0.5
    assert 0 <= record['moe_min_load'] <= 1 <= record['moe_max_load'] <= 4  # E x share: 1 is the fair share.


@pytest.mark.slow  # Three simulated runs.
def test_an_moe_simulation_resumed_from_a_checkpoint_writes_the_uninterrupted_records(tmp_path):
  config = _moe_run(mode='decoupled', checkpoint_every=1)
  sim.run(experiment.build(config), str(tmp_path / 'once'))
  sim.run(experiment.build(config), str(tmp_path / 'twice'))
  checkpoints = tmp_path / 'twice' / 'checkpoints'
  steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
  assert len(steps) >= 2
  for step in steps[1:]:  # As if it died after its oldest checkpoint kept, with later records on disk.
    shutil.rmtree(checkpoints / str(step))
  sim.run(experiment.build(_moe_run(mode='decoupled', checkpoint_every=1, resume=True)), str(tmp_path / 'twice'))
  assert _records(tmp_path / 'twice') == _records(tmp_path / 'once')
  assert any('moe_dropped_fraction' in r for r in _records(tmp_path / 'once', 'train'))


def test_flops_count_the_active_experts_and_params_count_them_all():
  """Top-2 of 4 experts of width 32 against a dense MLP of width 64: equal active MLP width, so the FLOPs differ by the
  routers only (6 x d x E per block) and the idle experts are 2 x 3 x d x 32 per block."""
  routed, dense = cfg(), cfg(moe={'num_experts': 0})
  assert model_lib.flops_per_token(routed) - model_lib.flops_per_token(dense) == 6 * 2 * 32 * 4
  idle = 2 * (4 - 2) * 3 * 32 * 32
  total = model_lib.count_params(model_lib.abstract_params(routed)[1])
  assert model_lib.idle_expert_params(routed) == idle and model_lib.active_params(routed) == total - idle
  assert model_lib.active_params(dense) == model_lib.count_params(model_lib.abstract_params(dense)[1])

"""The inner optimizers: Muon's update against its equation, which leaves it takes, its sharded state, refusals."""

import json
import math

import jax
import numpy as np
import optax
import pytest

from decoupled_diloco import experiment, inner, inner_optimizers, mesh, model as model_lib, plan
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import lockstep
from tests.helpers import tiny_config

NS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic Newton–Schulz coefficients (a, b, c).


def _newton_schulz(g, steps=5):
  """X ← aX + b(XXᵀ)X + c(XXᵀ)²X on X = G/‖G‖_F, on the wide orientation (rows <= cols), in float64."""
  x = g.T if g.shape[0] > g.shape[1] else g
  x = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(steps):
    a = x @ x.T
    x = NS[0] * x + (NS[1] * a + NS[2] * a @ a) @ x
  return x.T if g.shape[0] > g.shape[1] else x


def _muon_reference(weight, grads, lr, beta, wd, rms):
  """Muon's weights after each gradient: Nesterov momentum with bias correction, orthogonalised, scaled to
  AdamW's RMS (rms·√max(fan_in, fan_out)), decoupled weight decay, all times lr."""
  momentum, weights = np.zeros_like(weight), [weight]
  for t, g in enumerate(grads, start=1):
    momentum = beta * momentum + (1 - beta) * g
    nesterov = beta * momentum / (1 - beta**(t + 1)) + (1 - beta) * g / (1 - beta**t)
    update = _newton_schulz(nesterov) * rms * math.sqrt(max(weight.shape)) + wd * weights[-1]
    weights.append(weights[-1] - lr * update)
  return weights[1:]


def _settings(**overrides):
  return inner.Settings.from_config(tiny_config(**{"inner.optimizer": "muon", **overrides}).inner)


def test_muon_update_equals_the_newton_schulz_equation_on_a_hand_made_matrix():
  """Two steps on a 3x5 block matrix (momentum carried) and the token embedding's first AdamW step."""
  weight = np.array([[0.5, -1.0, 0.25, 2.0, 0.0], [1.5, 0.5, -0.5, 1.0, 3.0], [-2.0, 1.0, 0.5, 0.0, 1.0]])
  grads = [np.array([[1.0, 2.0, 0.0, -1.0, 0.5], [0.0, 1.0, 3.0, 1.0, -2.0], [2.0, -1.0, 1.0, 0.0, 1.0]])]
  grads.append(grads[0][::-1] * 0.5 + 0.1)
  embed, embed_grad = np.array([[1.0, -2.0], [0.5, 0.0]]), np.array([[0.3, -0.1], [2.0, 0.0]])
  params = {"block_0": {"mlp": {"wi": {"kernel": weight}}}, "token_embed": embed}
  settings = _settings()
  optimizer = inner_optimizers.muon(settings, 0.1)
  state, got = optimizer.init(jax.tree.map(np.float32, params)), params
  for g in grads:
    tree = jax.tree.map(np.float32, {"block_0": {"mlp": {"wi": {"kernel": g}}}, "token_embed": embed_grad})
    updates, state = optimizer.update(tree, state, jax.tree.map(np.float32, got))
    got = jax.tree.map(lambda p, u: np.asarray(p + u, np.float64), got, updates)
    if g is grads[0]:
      b1 = settings.b1  # Adam's first step, Nesterov: m̂ = g (1 + b1 / (1 + b1)), v̂ = g², decay on every leaf.
      adam = np.sign(embed_grad) * (1 + b1 / (1 + b1)) * (embed_grad != 0) + settings.weight_decay * embed
      np.testing.assert_allclose(got["token_embed"], embed - 0.1 * adam, atol=1e-5)
  want = _muon_reference(weight, grads, 0.1, settings.muon_beta, settings.weight_decay, settings.muon_consistent_rms)
  np.testing.assert_allclose(got["block_0"]["mlp"]["wi"]["kernel"], want[-1], atol=1e-5)
  assert np.abs(want[-1] - weight).max() > 0.05  # The steps moved the matrix: the comparison is not of no-ops.


@pytest.mark.parametrize("scan", [False, True])
def test_muon_takes_every_block_matrix_and_leaves_embeddings_head_and_norms_to_adamw(scan):
  config = tiny_config(**{"model.num_layers": 2, "model.mlp": "swiglu", "model.scan_layers": scan})
  _, params, _ = model_lib.abstract_params(config.model)
  if scan:
    params = jax.eval_shape(lambda p: model_lib.stack_blocks(p, 2), params)
  paths = {
      jax.tree_util.keystr(path): dims for path, dims in jax.tree_util.tree_leaves_with_path(
          inner_optimizers.muon_dimensions(params), is_leaf=lambda x: x is None or isinstance(x, tuple))}
  block = "['blocks']" if scan else "['block_1']"
  first = int(scan)  # The stacked layer axis is a batch axis: every layer is its own matrix.
  assert paths[f"{block}['attn']['query']['kernel']"] == (first, (first + 1, first + 2))  # d_model -> heads x dim
  assert paths[f"{block}['attn']['out']['kernel']"] == ((first, first + 1), first + 2)  # heads x dim -> d_model
  assert paths[f"{block}['mlp']['wg']['kernel']"] == (first, (first + 1,))
  for adamw in ("['token_embed']", "['pos_embed']", "['lm_head']", "['final_norm']['scale']",
                f"{block}['mlp_norm']['scale']"):
    assert paths[adamw] is None, adamw


def test_muon_state_is_sharded_like_its_params_and_a_sharded_step_equals_one_device_s():
  config = tiny_config(**{"inner.optimizer": "muon"})
  model, params, axes = model_lib.build_model(config.model, seed=0)
  optimizer = inner.inner_optimizer(config.inner, total_steps=10)
  batch = np.random.default_rng(0).integers(0, 256, (8, config.model.seq_len + 1), dtype=np.int32)

  def three_steps(devices, layout):
    loop = inner.build_inner_loop(model, optimizer, mesh.group_mesh(devices, layout),
                                  jax.eval_shape(lambda p: p, params), axes)
    state = loop.init(params)
    for _ in range(3):
      state, _ = loop.step(state, loop.put_batch(batch))
    return loop, state

  _, single = three_steps(jax.devices()[:1], mesh.Layout())
  loop, sharded = three_steps(jax.devices()[4:], mesh.Layout(fsdp=4))
  host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
  np.testing.assert_allclose(host(sharded.params)["lm_head"], host(single.params)["lm_head"], atol=1e-5)
  for got, want in zip(jax.tree.leaves(host(sharded)), jax.tree.leaves(host(single))):
    np.testing.assert_allclose(got, want, atol=1e-5)
  muon_mu = sharded.opt_state[1].inner_states["muon"].inner_state[0].mu
  adam_nu = sharded.opt_state[1].inner_states["adam"].inner_state[0].nu
  kernel = muon_mu["block_0"]["mlp"]["wi"]["kernel"]
  assert kernel.sharding == loop.param_shardings["block_0"]["mlp"]["wi"]["kernel"]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", None) and len(kernel.addressable_shards) == 4
  assert adam_nu["token_embed"].sharding == loop.param_shardings["token_embed"]
  assert isinstance(adam_nu["block_0"]["mlp"]["wi"]["kernel"], optax.MaskedNode)  # Muon's: no AdamW moment.


def test_the_plan_counts_muons_one_moment_per_matrix_per_chip():
  config = tiny_config(**{"inner.optimizer": "muon", "learners.fsdp": True})
  layout = mesh.layouts_from_config(config.learners)[0]
  _, params_shape, axes = model_lib.abstract_params(config.model)
  per_state = plan.state_bytes(params_shape, axes, layout)
  dimensions = inner_optimizers.muon_dimensions(params_shape)
  matrices = plan.state_bytes(
      params_shape, axes, layout,
      jax.tree.map(lambda p, d: optax.MaskedNode() if d is None else p, params_shape, dimensions,
                   is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)))
  assert 0 < matrices < per_state
  assert plan.optimizer_bytes(config, params_shape, axes, layout) == 2 * per_state - matrices
  config.inner.optimizer = "adamw"
  assert plan.optimizer_bytes(config, params_shape, axes, layout) == 2 * per_state


@pytest.mark.slow  # ~30 s: three short lockstep runs.
def test_a_muon_run_with_stacked_layers_learns_and_resumes_exactly(tmp_path):
  config = tiny_config(**{
      "inner.optimizer": "muon", "model.num_layers": 2, "model.scan_layers": True, "outer_steps": 4,
      "checkpoint_every": 2})
  lockstep.run(experiment.build(config), str(tmp_path / "full"))
  lockstep.run(experiment.build(config), str(tmp_path / "cut"), stop_after=3)
  config.resume = True
  lockstep.run(experiment.build(config), str(tmp_path / "cut"))
  records = {
      run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
      for run in ("full", "cut")}
  for run in records.values():
    for record in run:
      record.pop("wall_time")
  assert records["cut"] == records["full"]
  losses = [r["eval_loss"] for r in records["full"] if r["kind"] == "eval"]
  assert losses[-1] < losses[0] < math.log(256)


@pytest.mark.parametrize("overrides, message", [
    ({"inner.optimizer": "sgdm"}, r"inner.optimizer='sgdm' must be one of \('adamw', 'muon'\)"),
    ({"inner.optimizer": "muon", "inner.muon_beta": 1.0}, r"inner.muon_beta=1.0 must be in \[0, 1\)"),
    ({"inner.optimizer": "muon", "inner.muon_ns_steps": 0}, r"inner.muon_ns_steps=0 must be an int >= 1"),
    ({"inner.optimizer": "muon", "inner.muon_consistent_rms": -0.2}, r"inner.muon_consistent_rms=-0.2 must be >= 0"),
    ({"inner.muon_beta": 0.9}, r"inner.muon_beta=0.9 applies to inner.optimizer='muon' only, which is 'adamw'"),])
def test_invalid_inner_optimizer_settings_are_refused_in_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as error:
    experiment.validate(tiny_config(**overrides))
  assert "\n" not in str(error.value) and "--config.inner." in str(error.value)


def test_an_optax_without_contrib_muon_is_refused_with_the_fix(monkeypatch):
  monkeypatch.delattr(optax.contrib, "muon")
  with pytest.raises(ConfigError, match=r"inner.optimizer='muon' needs optax.contrib.muon .*pip install"):
    experiment.validate(tiny_config(**{"inner.optimizer": "muon"}))

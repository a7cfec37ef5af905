"""Each mode's recipe for the fields a user leaves at 'auto', and the warning for the combination known to diverge."""

import logging

import pytest

from configs import async_naive, default, demo, hetero_v5p_v6e
from decoupled_diloco import experiment, mode_defaults


def _resolved(config, **overrides):
  config = experiment.with_overrides(config, overrides)
  mode_defaults.resolve(config)
  return config


def test_decoupled_defaults_are_delayed_nesterov_over_a_round_dylu_quorum_1_and_a_grace_window():
  config = _resolved(demo.get_config(), mode="decoupled", runtime="sim")
  assert (config.syncer.quorum, config.outer.optimizer, config.outer.buffer_size,
          config.policy.kind) == (1, "delayed_nesterov", 4, "dylu")
  assert (config.syncer.grace_gamma, config.syncer.grace_overlap_steps) == mode_defaults.DECOUPLED_GRACE


def test_diloco_and_ddp_keep_diloco_s_outer_nesterov():
  for mode in ("diloco", "ddp"):
    config = _resolved(default.get_config(), mode=mode)
    assert (config.syncer.quorum, config.outer.optimizer, config.outer.buffer_size,
            config.policy.kind) == (0, "sgd", 1, "fixed"), mode
    assert (config.syncer.grace_gamma, config.syncer.grace_overlap_steps) == (0.0, 0.0), mode
    assert config.outer.nesterov and config.outer.momentum == 0.9 and config.outer.lr == 0.7


def test_the_buffer_is_a_round_of_pushes_whatever_the_quorum():
  """DN counts pushes, so a round is M of them however the merges group them (outer.delayed_nesterov)."""
  assert _resolved(demo.get_config(), mode="decoupled", **{"syncer.quorum": 2}).outer.buffer_size == 4
  assert _resolved(demo.get_config(), mode="decoupled",
                   **{"learners.devices": (2,) * 3, "learners.batch_size": (16,) * 3}).outer.buffer_size == 3
  assert _resolved(demo.get_config(), mode="decoupled", **{"syncer.quorum": 0}).outer.buffer_size == 4


def test_an_explicit_setting_always_wins():
  config = _resolved(
      demo.get_config(), mode="decoupled", **{
          "outer.optimizer": "adam", "policy.kind": "fixed", "syncer.quorum": 3, "outer.buffer_size": 7,
          "syncer.grace_gamma": 0.0, "syncer.grace_overlap_steps": 1.0})
  assert (config.outer.optimizer, config.policy.kind, config.syncer.quorum, config.outer.buffer_size) == ("adam",
                                                                                                          "fixed", 3, 7)
  assert (config.syncer.grace_gamma, config.syncer.grace_overlap_steps) == (0.0, 1.0)
  assert _resolved(async_naive.get_config()).outer.optimizer == "sgd"  # Set in the config file: kept.
  hetero = _resolved(hetero_v5p_v6e.get_config())  # Left to the defaults: the recipe it used to spell out.
  assert (hetero.syncer.quorum, hetero.outer.optimizer, hetero.outer.buffer_size,
          hetero.policy.kind) == (1, "delayed_nesterov", 4, "dylu")


def test_resolving_twice_changes_nothing():
  config = _resolved(demo.get_config(), mode="decoupled")
  before = config.to_dict()
  assert mode_defaults.resolve(config) == {} and config.to_dict() == before


def test_nesterov_on_every_arrival_is_warned_about_in_one_line_naming_the_fix(caplog):
  with caplog.at_level(logging.WARNING):
    mode_defaults.resolve(async_naive.get_config())
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "--config.outer.optimizer=delayed_nesterov" in warnings[0]
  assert mode_defaults.known_bad(_resolved(demo.get_config(), mode="decoupled")) is None
  assert mode_defaults.known_bad(
      _resolved(demo.get_config(), mode="decoupled", **{"syncer.quorum": 0, "outer.optimizer": "sgd"})) is None


@pytest.mark.parametrize("mode, runtime", [("decoupled", "sim"), ("diloco", "lockstep")])
def test_validate_fills_the_recipe_before_the_typed_groups_read_it(mode, runtime):
  config = experiment.with_overrides(demo.get_config(), {"mode": mode, "runtime": runtime})
  groups = experiment.validate(config)
  assert groups.outer.optimizer == config.outer.optimizer != mode_defaults.AUTO
  assert groups.policy.kind == config.policy.kind != mode_defaults.AUTO

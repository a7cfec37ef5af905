"""Typed config groups: one frozen object per config.<group>, unknown fields refused by name."""

import dataclasses

import ml_collections
import pytest

from configs import default
from decoupled_diloco import compression, experiment, fragments, inner, mode_defaults, outer, policy
from decoupled_diloco.data import settings as data_settings
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model import sizing
from decoupled_diloco.service import settings as service_settings
from tests.helpers import tiny_config


def _unlocked_group(name: str, **extra) -> ml_collections.ConfigDict:
  """A hand-built copy of default.py's group `name` (not locked, as a notebook's own ConfigDict) plus `extra`, with the
  mode's recipe filled in where default.py says 'auto', as experiment.validate fills it before building the groups."""
  config = default.get_config()
  mode_defaults.resolve(config)
  return ml_collections.ConfigDict({**config[name].to_dict(), **extra})


@pytest.mark.parametrize("group, build", [
    ("inner", inner.Settings.from_config),
    ("outer", outer.Settings.from_config),
    ("policy", policy.Settings.from_config),
    ("streaming", fragments.Streaming.from_config),
    ("compression", compression.Codec.from_config),
    ("service", service_settings.Settings.from_config),
    ("data", data_settings.Settings.from_config),
    ("model", sizing.Settings.from_config),])
def test_every_group_takes_default_py_and_refuses_a_field_it_lacks(group, build):
  settings = build(_unlocked_group(group))
  assert dataclasses.is_dataclass(settings) and build(settings) is settings
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(settings, dataclasses.fields(settings)[0].name, None)
  with pytest.raises(ConfigError, match=rf"^{group}\.zzqq is not a config field: fix or drop it"):
    build(_unlocked_group(group, zzqq=1))


def test_a_near_miss_is_named_with_the_field_it_resembles():
  with pytest.raises(ConfigError,
                     match=r"inner\.warmup_stpes is not a config field: did you mean inner\.warmup_steps\?"):
    inner.Settings.from_config(_unlocked_group("inner", warmup_stpes=3))
  data = _unlocked_group("data")
  data.synthetic.odrer = 3
  with pytest.raises(ConfigError, match=r"data\.synthetic\.odrer is not a config field: did you mean "
                     r"data\.synthetic\.order\?"):
    data_settings.Settings.from_config(data)


def test_a_group_missing_a_required_field_says_where_defaults_are():
  cfg = _unlocked_group("inner")
  del cfg["lr"]
  with pytest.raises(ConfigError, match=r"config.inner lacks inner.lr: start the config from configs/default.py"):
    inner.Settings.from_config(cfg)


def test_default_py_is_locked_so_a_typo_in_a_config_file_raises():
  config = default.get_config()
  config.inner.lr = 1e-3  # Existing fields are set as before.
  with pytest.raises(AttributeError, match="stpes"):
    config.inner.stpes = 3
  with pytest.raises(ConfigError, match=r"unknown config key 'inner.stpes'"):
    experiment.with_overrides(default.get_config(), {"inner.stpes": 3})
  with pytest.raises(ConfigError, match=r"unknown config key 'innr.lr'"):
    experiment.with_overrides(default.get_config(), {"innr.lr": 3})


def test_validate_returns_the_typed_groups_of_the_run():
  groups = experiment.validate(
      tiny_config(
          mode="decoupled", runtime="sim",
          **{"inner.lr": 1e-3, "policy.kind": "dylu", "streaming.num_fragments": 2, "streaming.strategy": "tensor"}))
  assert groups.inner == inner.Settings.from_config(tiny_config(**{"inner.lr": 1e-3}).inner)
  assert groups.policy.kind == "dylu" and groups.streaming.num_fragments == 2 and groups.streaming.streams
  assert groups.model.d_model == 32 and groups.data.synthetic.num_tokens == 60_000
  assert groups.service is None and groups.failures is None
  ddp = experiment.validate(tiny_config(mode="ddp", **{"learners.devices": (2,), "learners.batch_size": (4,)}))
  assert ddp.outer is None and ddp.syncer is None and ddp.streaming is None and ddp.compression is None


@pytest.mark.parametrize("overrides, message", [
    ({"syncer.qourum": 1}, r"syncer\.qourum is not a config field: did you mean syncer\.quorum\?"),
    ({"service.port": 70000}, r"service\.port=70000 must be in \[0, 65535\]"),
    ({"service.max_refusals_in_a_row": 0}, r"service\.max_refusals_in_a_row=0 must be an int >= 1: set --config"),
    ({"mode": "ddp", "learners.devices": (2,), "learners.batch_size": (4,)}, "mode='ddp' has no syncer to serve"),
    ({"compression.downlink_format": "int8"}, r"compression\.downlink_format='int8' is unknown"),
    ({"data.split": "random"}, r"data\.split='random' is unknown: use 'iid' or 'noniid'"),
    ({"policy.dylu_rounding": "ceil"}, r"policy\.dylu_rounding='ceil' is unknown"),
    ({"streaming.alpha": 1.5}, r"streaming\.alpha = 1\.5 must be in \[0, 1\]"),])
def test_groups_and_cross_group_rules_refuse_in_one_line(overrides, message):
  config = tiny_config(mode="decoupled", runtime="service")
  with config.unlocked():  # A hand-made field, as a notebook's own ConfigDict could have.
    experiment.with_overrides(config, {k: v for k, v in overrides.items() if k != "syncer.qourum"})
    if "syncer.qourum" in overrides:
      config.syncer.qourum = 1
  with pytest.raises(ConfigError, match=message):
    experiment.validate(config)

"""Every shipped config loads, validates and names a runnable command in its docstring."""

import importlib
import pathlib
import re

import pytest

from decoupled_diloco import experiment, model as model_lib
from decoupled_diloco.errors import ConfigError

CONFIG_DIR = pathlib.Path(__file__).parents[1] / "configs"
CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates_and_documents_its_command(name):
  module = importlib.import_module(f"configs.{name}")
  config = module.get_config()
  experiment.validate(config)
  assert f"--config=configs/{name}.py" in module.__doc__, f"configs/{name}.py: put a runnable command in the docstring"


def test_every_field_is_commented_where_it_is_defined():
  """configs/default.py defines every field; each definition carries its comment."""
  source = (CONFIG_DIR / "default.py").read_text()
  bare = [
      line for line in source.splitlines()
      if line.strip().startswith("config.") and " = " in line and "ConfigDict()" not in line and "#" not in line]
  assert not bare, f"uncommented fields in configs/default.py: {bare}"


def test_tpu_config_is_about_one_billion_parameters_without_allocating():
  config = importlib.import_module("configs.tpu_1b").get_config()
  _, shapes, _ = model_lib.abstract_params(config.model)
  assert 0.9e9 < model_lib.count_params(shapes) < 1.2e9
  assert config.learners.hardware == ("v5p", "v6e") and len(set(config.learners.layouts)) == 2
  assert sum(config.learners.devices) == 128


def test_tpu_8b_config_is_about_eight_billion_parameters_with_a_subword_vocabulary():
  config = importlib.import_module("configs.tpu_8b").get_config()
  _, shapes, _ = model_lib.abstract_params(config.model)
  assert 7.5e9 < model_lib.count_params(shapes) < 8.5e9 and config.model.vocab_size >= 32_000
  assert config.mode == "decoupled" and config.learners.hardware == ("v5p", "v6e")


def test_tpu_12b_config_is_gemma_shaped_about_twelve_billion_parameters_on_two_v6e_and_two_v5p_slices():
  config = importlib.import_module("configs.tpu_12b").get_config()
  _, shapes, _ = model_lib.abstract_params(config.model)
  assert 11e9 < model_lib.count_params(shapes) < 13e9 and config.model.tie_embeddings
  assert sorted(config.learners.hardware) == ["v5p", "v5p", "v6e", "v6e"]
  assert config.streaming.num_fragments > 1 and config.compression.format == "int4"


@pytest.mark.parametrize("key, value, message", [
    ("inner.lr", -0.5, "inner.lr=-0.5 must be > 0"),
    ("inner.warmup_steps", -10, "inner.warmup_steps=-10 must be >= 0"),
    ("inner.clip_norm", -1.0, "inner.clip_norm=-1.0 must be > 0"),
    ("inner.b1", 2.0, "inner.b1=2.0 must be in [0, 1)"),
    ("inner.b2", 1.0, "inner.b2=1.0 must be in [0, 1)"),
    ("inner.weight_decay", -1.0, "inner.weight_decay=-1.0 must be >= 0"),
    ("inner.final_lr_fraction", -3.0, "inner.final_lr_fraction=-3.0 must be in [0, 1]"),
    ("outer.momentum", -1.0, "outer.momentum=-1.0 must be in [0, 1)"),
    ("outer.momentum", 1.0, "outer.momentum=1.0 must be in [0, 1)"),
    ("data.eval_fraction", 2.0, "data.eval_fraction=2.0 must be in (0, 1)"),
    ("syncer.quorum", 5, "syncer.quorum=5 exceeds the 4 learners"),])
def test_out_of_range_settings_are_refused_before_anything_is_built(key, value, message):
  """Values optax or the syncer would take silently (a negative lr ascends the loss) are refused by validate."""
  config = importlib.import_module("configs.demo").get_config()
  config = experiment.with_overrides(config, {key: value})
  with pytest.raises(ConfigError, match=re.escape(message)):
    experiment.validate(config)

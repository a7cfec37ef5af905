"""Every shipped config loads, validates and names a runnable command in its docstring."""

import importlib
import pathlib

import pytest

from decoupled_diloco import experiment, model as model_lib

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
  bare = [line for line in source.splitlines() if line.strip().startswith("config.") and " = " in line
          and "ConfigDict()" not in line and "#" not in line]
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

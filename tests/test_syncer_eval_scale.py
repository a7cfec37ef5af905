"""Issue 16's wall at 1B: the syncer process must never compile or run the model. The TPU configs evaluate
on an evaluator process (service.evaluate_on='evaluator'), validation refuses syncer-host evaluation at that
scale, and a syncer built with it off merges and finishes without tracing the model's loss (jax's compile log)."""

import importlib
import time

import pytest

from decoupled_diloco import metrics as metrics_lib, model as model_lib
from decoupled_diloco.data import sources
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import records
from decoupled_diloco.service import runconfig, syncer_main
from tests import service_config


def _model_traces(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if "loss" in r.getMessage() and "jit" in r.getMessage()]


@pytest.mark.parametrize("name", ["tpu_1b", "tpu_8b"])
def test_tpu_configs_keep_the_model_off_the_syncer_host(name, compile_log):
  config = importlib.import_module(f"configs.{name}").get_config()
  assert config.service.evaluate_on == "evaluator"
  runconfig.validate(config)
  model, _, _ = model_lib.abstract_params(config.model)
  assert syncer_main.build_evaluator(config, model, None, records.Recorder()) is None
  assert not _model_traces(compile_log)
  config.service.evaluate_on = "syncer"
  with pytest.raises(ConfigError, match=r"syncer host's CPU .* set --config.service.evaluate_on=evaluator"):
    runconfig.validate(config)


def test_an_unknown_evaluate_on_is_refused():
  config = service_config.get_config()
  config.service.evaluate_on = "learner0"
  with pytest.raises(ConfigError, match="service.evaluate_on='learner0' must be one of"):
    runconfig.validate(config)


def _merge_and_finish(config, tmp_path):
  """The service syncer's evaluation path: build, one merge past the eval interval, finish."""
  model, params, _ = model_lib.build_model(config.model, config.seed)
  corpus = sources.load_corpus(config.data, config.model.seq_len, train=False)
  with metrics_lib.MetricsWriter(str(tmp_path)) as writer:
    recorder = records.Recorder(writer)
    evaluator = syncer_main.build_evaluator(config, model, corpus, recorder)
    core = syncer_main.build_core(config, params, str(tmp_path), recorder, evaluator)
    core.start(time.time())
    core.tokens_done = 10**9  # Past the first eval interval.
    core.on_merge(1, params, time.time())
    if evaluator is not None:
      evaluator.close()
    core.close()
  return [r for r in metrics_lib.read_metrics(writer.path) if r["kind"] == "eval"]


@pytest.mark.parametrize("evaluate_on", ["syncer", "evaluator", "none"])
def test_a_syncer_with_evaluation_off_never_traces_the_model(evaluate_on, tmp_path, compile_log):
  config = service_config.get_config()
  config.service.evaluate_on = evaluate_on
  runconfig.validate(config)
  evals = _merge_and_finish(config, tmp_path)
  assert bool(evals) == bool(_model_traces(compile_log)) == (evaluate_on == "syncer")


def test_an_eval_batch_the_evaluator_cannot_split_is_refused():
  config = service_config.get_config()
  config.service.evaluate_on, config.service.evaluator_devices, config.eval_batch_size = "evaluator", 3, 4
  with pytest.raises(ConfigError, match=r"eval_batch_size=4 does not split over the evaluator's .*fsdp=3"):
    runconfig.validate(config)

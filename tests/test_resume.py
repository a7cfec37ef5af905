"""Which workdir a syncer may start in (service/resume.py): a fresh run, or a resume of the same run, nothing else.

The run's state is real: a syncer core checkpoints with orbax where one syncer (<workdir>) or a shard
(<workdir>/shards/<s>) keeps it; each refusal is one ConfigError line and writes nothing.
"""

import logging
import os
import time

import pytest

from decoupled_diloco import experiment
from decoupled_diloco import model as model_lib
from decoupled_diloco import outer
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import resume, shardrun
from decoupled_diloco.syncer import Settings, Syncer
from tests import service_config
from tests.test_durability import _snapshot


def _config(shards=1, **overrides):
  config = service_config.get_config()
  sharded = {
      "service.shards": 2, "streaming.num_fragments": 2, "streaming.strategy": "balanced", "service.evaluate_on": "none"
  } if shards == 2 else {}
  return experiment.with_overrides(config, {**sharded, **overrides})


def _checkpoint(directory, config):
  """A syncer's checkpoint 0 of `config` in `directory` (a workdir, or a shard's folder of one)."""
  params = model_lib.build_model(config.model, 0)[1]
  syncer = Syncer(outer.outer_optimizer(config.outer), params, range(2), Settings(quorum=1))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=100, directory=str(directory), checkpoint_every_merges=10,
                             lease_seconds=30.0, metadata={"config": config.to_dict()})
  core.start(time.time())
  core.close()


def _refused(config, workdir, shard=None) -> str:
  """The one line a refused start says; nothing in `workdir` changed."""
  before = _snapshot(workdir)
  _, shard_workdir = shardrun.for_shard(config, str(workdir), shard)
  with pytest.raises(ConfigError) as refused:
    resume.check(config, str(workdir), shard_workdir)
  assert _snapshot(workdir) == before and "\n" not in str(refused.value)
  return str(refused.value)


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)])
def test_another_shard_count_is_refused_on_resume_and_on_a_fresh_start(tmp_path, before, after):
  """Before: either change started a fresh run at version 0 beside the old state."""
  _checkpoint(tmp_path if before == 1 else shardrun.shard_workdir(str(tmp_path), 0), _config(before))
  for resuming in (True, False):
    error = _refused(_config(after, resume=resuming), tmp_path, shard=0 if after == 2 else None)
    assert f"service.shards is {after} but the run in {tmp_path} was checkpointed with {before}" in error


def test_a_changed_compression_format_is_refused_and_the_same_config_resumes(tmp_path):
  _checkpoint(tmp_path, _config())
  error = _refused(_config(resume=True, **{"compression.format": "int8"}), tmp_path)
  assert "compression.format is 'int8'" in error and "checkpointed with 'fp32'" in error
  assert "already holds a syncer run" in _refused(_config(), tmp_path)  # A fresh start over it.
  resume.check(_config(resume=True), str(tmp_path), str(tmp_path))


def test_a_fresh_sharded_run_starts_beside_its_sibling_shards_and_a_resume_needs_its_own_state(tmp_path):
  _checkpoint(shardrun.shard_workdir(str(tmp_path), 0), _config(2))  # Shard 0 started first.
  resume.check(_config(2), str(tmp_path), shardrun.shard_workdir(str(tmp_path), 1))
  assert "no syncer checkpoint of this shard" in _refused(_config(2, resume=True), tmp_path, shard=1)


def test_resume_with_nothing_to_resume_is_refused_in_a_used_workdir_and_starts_fresh_in_an_empty_one(tmp_path, caplog):
  """Before: both started a fresh run without a word."""
  (tmp_path / "logs").mkdir()  # A launcher's logs are no run.
  with caplog.at_level(logging.WARNING):
    resume.check(_config(resume=True), str(tmp_path), str(tmp_path))
  fresh = [r.getMessage() for r in caplog.records if "starts a fresh one" in r.getMessage()]
  assert len(fresh) == 1 and str(tmp_path) in fresh[0]
  (tmp_path / "metrics.jsonl").write_text("{}\n")  # What a run left behind, no checkpoint among it.
  assert "holds no syncer checkpoint of this run to resume" in _refused(_config(resume=True), tmp_path)
  assert not os.path.exists(tmp_path / "checkpoints")

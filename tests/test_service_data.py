"""A service learner on packed documents, SIGKILLed and restarted, continues its grain stream exactly.

Real processes (experiments.launch_local.LocalCluster): a syncer and two learners reading byte-level
documents from ArrayRecord shards, with document masking on. Each learner records the crc32 of every
batch it trains on (`batches` records); the restarted learner's batches must be the batches of an
uninterrupted stream, which `learner_batches` rebuilds here from the same config.
"""

import os
import zlib

import pytest

from decoupled_diloco import experiment
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco.data import batches, sources
from experiments.launch_local import LocalCluster
from tests import helpers, service_config

pytestmark = pytest.mark.slow  # Real syncer and learner processes.

RUN_TIMEOUT = 400.0


def _records(workdir, name, kind):
  path = os.path.join(workdir, name, "metrics.jsonl")
  return [r for r in metrics_lib.read_metrics(path) if r["kind"] == kind] if os.path.exists(path) else []


def test_a_restarted_learner_continues_its_packed_stream_exactly(tmp_path):
  (tmp_path / "data").mkdir()
  data = helpers.write_documents(tmp_path / "data")
  # A budget far beyond the test: it stops the run once the restarted learner has trained two periods. With int4
  # error feedback the learner's checkpoint holds its residuals too, which the restart restores.
  overrides = [
      "--config.outer_steps=1000", "--config.data.source=array_record", f"--config.data.path={data}",
      "--config.data.mask_document_boundaries=True", "--config.service.learner_checkpoint_every=1",
      "--config.compression.format=int4", "--config.compression.error_feedback=True"]
  cluster = LocalCluster("tests/service_config.py", str(tmp_path / "run"), overrides, 2,
                         env=dict(os.environ, DD_SYNCER_TOKEN="d" * 32))
  try:
    cluster.start()
    assert helpers.wait_for(lambda: len(_records(cluster.workdir, "learner_1", "batches")) >= 3, RUN_TIMEOUT,
                            0.2), "timed out waiting for learner 1's third period"
    cluster.kill("learner_1")
    before = len(_records(cluster.workdir, "learner_1", "batches"))
    cluster.restart("learner_1")
    assert helpers.wait_for(lambda: len(_records(cluster.workdir, "learner_1", "batches")) > before + 1, RUN_TIMEOUT,
                            0.2), "timed out waiting for learner 1 to train two periods after its restart"
    assert cluster.running() == ["learner_0", "learner_1", "syncer"]  # Nothing failed meanwhile.
  finally:
    cluster.stop()
  starts = [r["start_step"] for r in _records(cluster.workdir, "learner_1", "first_round")]
  assert len(starts) == 2 and starts[0] == 0 and starts[1] > 0, starts  # Resumed from its checkpoint.
  trained = {}  # step -> crc32 of the batch each incarnation trained on at that step.
  for record in _records(cluster.workdir, "learner_1", "batches"):
    for step, digest in enumerate(record["crc32"], record["first_step"]):
      assert trained.setdefault(step, digest) == digest, f"step {step} trained on two different batches"
  assert max(trained) > starts[1] + 4 and sorted(trained) == list(range(max(trained) + 1))
  config = service_config.get_config()
  corpus = sources.load_corpus(
      experiment.with_overrides(config, {"data.source": "array_record", "data.path": data}).data, config.model.seq_len)
  stream = batches.learner_batches(corpus, config.model.seq_len, learner_index=1, num_learners=2,
                                   batch_size=config.learners.batch_size[1], split=config.data.split, seed=config.seed)
  try:
    assert [zlib.crc32(stream.batch(step)) for step in sorted(trained)] == [trained[s] for s in sorted(trained)]
  finally:
    stream.close()

"""The config fingerprint at Join (service/fingerprint.py): a learner whose config differs from the syncer's in what
both must agree on is refused with one line naming the field, and its process exits 2 before it trains."""

import os
import subprocess
import sys
import time

import grpc
import pytest

from decoupled_diloco import experiment
from decoupled_diloco import model as model_lib
from decoupled_diloco import outer
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import fingerprint, security
from decoupled_diloco.syncer import Settings, Syncer
from experiments.launch_local import LocalCluster
from tests import service_config
from tests.test_datachannel import _serving
from tests.test_service_units import TOKEN

CONFIG = "tests/service_config.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides):
  config = experiment.with_overrides(service_config.get_config(), overrides)
  config.runtime = "service"
  experiment.validate(config)  # Resolves the mode's 'auto' fields, as both processes do.
  return config


def test_a_fingerprint_names_the_first_field_that_differs():
  syncer = fingerprint.of(_config())
  assert syncer == fingerprint.of(_config().to_dict()) and syncer["model.d_model"] == "32"
  fingerprint.check(syncer, fingerprint.of(_config(**{"model.remat": "full"})), 0)  # A learner's own business.
  fingerprint.check(syncer, {}, 0)  # An operator's tool sends none: not compared.
  expected = r'learner 1\'s config .*: compression.format is "int8" there but "fp32" at the syncer'
  with pytest.raises(fingerprint.Mismatch, match=expected):
    fingerprint.check(syncer, fingerprint.of(_config(**{"compression.format": "int8", "outer.lr": 0.5})), 1)


def test_a_join_with_another_config_is_refused_counted_and_changes_nothing(tmp_path):
  config = _config()
  params = model_lib.build_model(config.model, 0)[1]
  syncer = Syncer(outer.outer_optimizer(config.outer), params, range(2), Settings(quorum=1))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=100, directory=str(tmp_path), checkpoint_every_merges=10,
                             lease_seconds=30.0, metadata={"config": config.to_dict()})
  core.start(time.time())
  with _serving(core) as (server, address):
    learner = client_lib.SyncerClient(address, security.learner_credential(TOKEN, 0), 0, chunk_bytes=1 << 16,
                                      timeout_seconds=10, retry_seconds=5)
    with pytest.raises(grpc.RpcError) as refused:
      learner.join(fingerprint.of(_config(**{"model.d_model": 64})))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and learner.retries == 0
    assert "model.d_model is 64 there but 32 at the syncer" in refused.value.details()
    assert server.rejections["mismatch"] == 1 and core.incarnations == {0: 0, 1: 0}
    status, _ = learner.join(fingerprint.of(config))
    assert status["incarnation"] == 1
  core.close()


@pytest.fixture(scope="module")
def syncer(tmp_path_factory):
  """(address, workdir, the run secret) of a real syncer process of tests/service_config.py."""
  workdir = str(tmp_path_factory.mktemp("fingerprint"))
  cluster = LocalCluster(CONFIG, workdir, ["--config.outer_steps=2", "--config.inner_steps=3"], 2)
  address = cluster.start_syncer()
  yield address, workdir, cluster.env[security.TOKEN_ENV]
  cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("overrides, field", [
    (["--config.model.d_model=64"], "model.d_model is 64 there but 32"),
    (["--config.streaming.num_fragments=2", "--config.streaming.strategy=balanced"], "streaming.num_fragments is 2"),
    (["--config.compression.format=int8"], 'compression.format is "int8" there but "fp32"'),])
def test_a_learner_process_with_another_config_exits_2_in_one_line_at_join(syncer, overrides, field):
  """Before the fingerprint: another d_model died in a 73-line JAX traceback, another num_fragments in an
  IndexError, another compression.format trained to the end with every push refused and exited 0."""
  address, workdir, secret = syncer
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env[security.TOKEN_ENV] = security.learner_credential(secret, 0)
  result = subprocess.run([
      sys.executable, "-m", "experiments.train", f"--config={CONFIG}", "--config.outer_steps=2",
      "--config.inner_steps=3", *overrides, "--role=learner", "--learner_id=0", f"--syncer={address}",
      f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2 and len(errors) == 1 and field in errors[0], result.stderr[-3000:]
  with open(os.path.join(workdir, "logs", "syncer.log"), encoding="utf-8") as log:
    assert "Traceback" not in result.stderr and "refused (mismatch)" in log.read()

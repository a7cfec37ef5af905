"""Evaluation off the syncer (service.evaluate_on='evaluator', issue 16): the evaluator's read-only credential
against a real server, and a real service run (syncer, two learners, evaluator processes) whose eval records
name the Θ versions they evaluated, the last one the final Θ."""

import os
import pathlib
import shlex
import subprocess
import sys
import time

import grpc
import jax
import numpy as np
import pytest

from decoupled_diloco import fragments, metrics as metrics_lib, model as model_lib, outer
from decoupled_diloco.research import report
from decoupled_diloco.run import records
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import evaluator_main, security, server as server_lib, syncer_main
from decoupled_diloco.syncer import Settings, Syncer
from experiments import launch_tpu
from experiments.launch_local import LocalCluster
from tests import service_config

REPO = pathlib.Path(__file__).parents[1]
TOKEN = "e" * 32


def _leaves_equal(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(name="served")
def _served(tmp_path):
  """A syncer core (2 learners, a budget of two 4-step pushes) served over gRPC and the data channel."""
  config = service_config.get_config()
  params = model_lib.build_model(config.model, 0)[1]
  syncer = Syncer(outer.outer_optimizer(config.outer), params, range(2), Settings(quorum=1))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=8, directory=str(tmp_path), checkpoint_every_merges=100,
                             lease_seconds=30.0, metadata={})
  core.start(time.time())
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16,
                                   max_payload_bytes=1 << 24, data_port=0)
  port = server.start()

  def client(credential: str, learner: int) -> client_lib.SyncerClient:
    return client_lib.SyncerClient(f"127.0.0.1:{port}", credential, learner, chunk_bytes=1 << 16, timeout_seconds=10,
                                   retry_seconds=5, data_channel=True)

  yield core, server, params, client
  server.stop(grace=0)
  core.close()


def test_the_evaluator_credential_reads_theta_and_nothing_else(served):
  core, server, params, client = served
  evaluator = client(security.evaluator_credential(TOKEN), security.EVALUATOR)
  status = evaluator.heartbeat()
  assert (status["version"], status["tokens"], status["done"], status["final"]) == (0, 0, False, False)
  status, theta = evaluator.pull(-1, 0)
  assert _leaves_equal(theta, params) and evaluator.pull(status["versions"][0], 0)[1] is None

  delta = jax.tree.map(lambda x: np.full(np.shape(x), 0.01, np.float32), params)
  refused = []
  for call in (lambda: evaluator.push(0, delta, base_version=0, tokens=64, local_steps=4, compute_seconds=0.1),
               evaluator.join, lambda: client(security.evaluator_credential(TOKEN), 0).pull(0, 0)):
    with pytest.raises(grpc.RpcError) as error:
      call()
    refused.append(error.value.code())
  assert refused == [grpc.StatusCode.PERMISSION_DENIED] * 3 and server.rejections["read_only"] == 3
  assert core.counts["applied"] == 0 and core.incarnations == {0: 0, 1: 0}  # Nothing it sent touched the run.

  learners = [client(security.learner_credential(TOKEN, m), m) for m in range(2)]
  for seq, learner in enumerate(learners):  # Each push takes half the budget: the second one ends the run.
    learner.join()
    learner.push(0, delta, base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
  status = evaluator.heartbeat()
  assert status["done"] and not status["final"]  # No learner said goodbye: a final push could still move Θ.
  learners[0].pull(0, 0)  # Now both have (a learner's pull after its final pushes).
  learners[1].pull(0, 0)
  status, theta = evaluator.pull(0, 0)  # A learner told 'done' gets no Θ; the evaluator gets the final one.
  assert status["final"] and status["version"] == core.syncer.version >= 1 and status["tokens"] == 128
  assert _leaves_equal(theta, core.syncer.params) and not _leaves_equal(theta, params)
  assert server.reader.has_final()


@pytest.mark.slow
def test_a_service_run_with_an_evaluator_writes_eval_records_tagged_with_theta_versions(tmp_path):
  workdir = str(tmp_path / "run")
  cluster = LocalCluster("tests/service_config.py", workdir, [
      "--config.service.evaluate_on=evaluator", "--config.streaming.num_fragments=2",
      "--config.streaming.strategy=balanced"], 2, env=dict(os.environ, DD_SYNCER_TOKEN=TOKEN), evaluator=True)
  try:
    cluster.start()
    codes = cluster.wait(400.0)
  finally:
    cluster.stop()
  assert codes == {"syncer": 0, "learner_0": 0, "learner_1": 0, "evaluator": 0}, codes
  syncer = metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  summary, = [r for r in syncer if r["kind"] == "summary"]
  outers = {r["outer_step"]: r for r in syncer if r["kind"] == "outer"}
  assert not [r for r in syncer if r["kind"] == "eval"]  # The syncer evaluated nothing.
  records = metrics_lib.read_metrics(os.path.join(workdir, "evaluator", "metrics.jsonl"))
  evals = [r for r in records if r["kind"] == "eval"]
  versions = [r["outer_step"] for r in evals]
  assert len(evals) >= 2 and versions == sorted(set(versions))
  assert versions[-1] == summary["outer_updates"] and evals[-1]["tokens"] == summary["tokens"]
  for record in evals[:-1]:  # Tagged with a version the syncer merged, and the tokens counted by then at least.
    assert record["outer_step"] in outers and record["tokens"] >= outers[record["outer_step"]]["tokens"]
  done, = [r for r in records if r["kind"] == "evaluator_summary"]
  assert done["evaluated_version"] == summary["outer_updates"] and done["eval_loss"] == evals[-1]["eval_loss"]
  assert report.summarize_run(report.load_runs([workdir])["run"])["eval_loss"] == evals[-1]["eval_loss"]


def test_launch_tpu_places_the_evaluator_on_its_own_slice_with_its_own_credential(tmp_path):
  token = tmp_path / "token"
  token.write_text(TOKEN + "\n")
  result = subprocess.run([
      sys.executable, "-m", "experiments.launch_tpu", "--config=configs/default.py",
      "--config.learners.devices=(16, 32)", "--config.learners.batch_size=(16, 32)",
      "--config.service.evaluate_on=evaluator", "--config.service.evaluator_devices=4",
      "--slices=v5p-32@us-east5-a,v6e-32@us-east1-d", "--project=proj", "--run_name=dd-t", f"--token_file={token}",
      "--dry_run"], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr
  commands = [shlex.split(line) for line in result.stdout.splitlines() if line and not line.startswith("#")]
  creates = [c[5:8] for c in commands if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]]
  assert creates[-1] == ["dd-t-eval", "--zone=us-east5-a", "--accelerator-type=v5p-8"]  # 4 chips, slice 0's kind.
  derived, = [c for c in commands if c[1:4] == ["-m", "experiments.credentials", "evaluator"]]
  out = derived[-1][len("--out="):]
  assert [c[6] for c in commands if c[4:5] == ["scp"] and c[5] == out] == ["dd-t-eval:dd/dd-t/token"]
  assert not [c for c in commands if c[4:5] == ["scp"] and c[5] == str(token) and c[6].startswith("dd-t-eval")]
  start, = [c for c in commands if any("--role=evaluator" in a for a in c)]
  remote = next(a for a in start if a.startswith("--command="))
  assert start[5] == "dd-t-eval" and "--syncer=SYNCER_IP:50051" in remote
  assert '--config.service.token_file="$D/token"' in remote and '--config.service.tls_ca="$D/tls_ca.pem"' in remote
  assert "--config.service.evaluator_devices=4" in remote
  assert subprocess.run([sys.executable, *derived[1:4], f"--secret_file={token}", f"--out={tmp_path / 'cred'}"],
                        cwd=REPO, timeout=60).returncode == 0
  assert (tmp_path / "cred").read_text().strip() == security.evaluator_credential(TOKEN)
  options = launch_tpu.Options("configs/default.py", (), tuple(launch_tpu.parse_slices("v5p-32@us-east5-a")), "proj",
                               "dd-t", evaluator_slice=launch_tpu.parse_slices("v6e-4@us-east1-d")[0])
  deletes = [s.argv[5] for s in launch_tpu.plan(options, "down") if s.argv[4:5] == ("delete",)]
  assert deletes == ["dd-t-0", "dd-t-eval"]


def test_the_evaluator_reads_theta_again_until_it_holds_one_version(tmp_path, monkeypatch):
  """Streaming (2 fragments): fragment 0 merges after the evaluator pulled it and before it pulls fragment 1, so
  the pair it holds never existed; its read goes round again, and the Θ it then holds is the syncer's at the
  version it names."""
  config = service_config.get_config()
  config.service.evaluate_on, config.syncer.min_learners_to_start = "evaluator", 1
  config.streaming.num_fragments, config.streaming.strategy = 2, "balanced"
  params = model_lib.build_model(config.model, config.seed)[1]
  core = syncer_main.build_core(config, params, str(tmp_path / "run"), records.Recorder(), None)
  core.start(time.time())
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=0, chunk_bytes=1 << 16,
                                   max_payload_bytes=1 << 24)
  target = f"127.0.0.1:{server.start()}"
  monkeypatch.setenv(security.TOKEN_ENV, security.evaluator_credential(TOKEN))
  process = evaluator_main.EvaluatorProcess(config, str(tmp_path / "run"), target)
  try:
    learner = client_lib.SyncerClient(target, security.learner_credential(TOKEN, 0), 0, chunk_bytes=1 << 16,
                                      timeout_seconds=10, retry_seconds=5)
    learner.join()
    delta = fragments.select(jax.tree.map(lambda x: np.full(np.shape(x), 0.01, np.float32), params), process.assignment,
                             0)
    pulls, pull = [], process.client.pull

    def pull_then_merge(have_version, fragment):
      pulls.append(fragment)
      reply = pull(have_version, fragment)
      if len(pulls) == 1:  # Between this pull and the next, fragment 0 merges.
        learner.push(0, delta, base_version=0, tokens=64, local_steps=4, compute_seconds=0.1, fragment=0)
      return reply

    process.client.pull = pull_then_merge
    status = process.read()
    assert pulls == [0, 1, 0, 1] and status["versions"] == list(core.syncer.versions) == [1, 0]
    assert status["version"] == core.syncer.version == 1
    assert _leaves_equal(fragments.combine(process.held, process.assignment), core.syncer.params)
  finally:
    process.close()
    server.stop(grace=0)
    core.close()

"""The file-system layer: every output a run writes, on a local directory and on gs:// (a GCS emulator).

The same tests run on both: metrics.jsonl with its resume truncation, TensorBoard event files,
orbax checkpoints of host and sharded state, sweep results and reports. Paths the layer cannot
open are refused in one line and never become local directories such as ./gs:/BUCKET.
"""

import json
import os
import pathlib
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tensorboardX.proto import event_pb2

from decoupled_diloco import storage
from decoupled_diloco.research import report, sweep
from decoupled_diloco.checkpoint import Checkpointer, abstract_like
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.metrics import MetricsWriter, read_metrics
from experiments.launch_local import free_port
from tests.fake_gcs import BUCKET, fake_gcs  # noqa: F401  pylint: disable=unused-import

REPO = pathlib.Path(__file__).parents[1]
UNOPENABLE = ["foo://x/run", "memory://run", "s3://bucket/run", "gs:/BUCKET/run", "gs:///run"]


@pytest.fixture(params=["local", "gcs"])
def workdir(request, tmp_path) -> str:
  """A fresh workdir: a local directory, or a gs:// prefix on the emulator."""
  if request.param == "local":
    return str(tmp_path / "run")
  request.getfixturevalue("fake_gcs")
  return f"gs://{BUCKET}/{request.node.name.replace('[', '_').replace(']', '')}"


def _scalars(tensorboard_dir) -> list[tuple[str, int, float]]:
  """(tag, step, value) of every scalar in a TensorBoard run's event files, read through the layer."""
  scalars = []
  for path in sorted(storage.path(tensorboard_dir).glob("events.out.tfevents.*")):
    data, offset = path.read_bytes(), 0
    while offset < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc.
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      scalars += [(v.tag, event.step, v.simple_value) for v in event.summary.value if v.HasField("simple_value")]
      offset += 16 + length
  return scalars


@pytest.mark.parametrize("location", UNOPENABLE)
def test_a_path_the_layer_cannot_open_is_refused_and_nothing_is_made_locally(location, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for make in (storage.path, MetricsWriter, Checkpointer, storage.makedirs):
    with pytest.raises(ConfigError, match="gs://BUCKET/PATH"):
      make(location)
  assert not list(tmp_path.iterdir())


def test_gs_without_its_backend_is_refused(monkeypatch):
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # What an install without gcsfs imports.
  monkeypatch.setenv("EPATH_USE_TF", "false")
  with pytest.raises(ConfigError, match=r"gs:// paths need gcsfs \(pip install gcsfs\)"):
    storage.path("gs://bucket/run")


def test_tensorboard_comes_without_its_gcs_client_which_stays_importable():
  # Its gs:// writer is this layer's (_TensorBoardFactory); the client cost every process ~320 modules at start-up.
  code = ("import sys, decoupled_diloco.metrics, tensorboardX.record_writer as w; "
          "print(w.GCS_ENABLED, 'google.cloud.storage' in sys.modules, sys.modules.get('google.cloud.storage', 0))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
  assert out.split() == ["False", "False", "0"]  # Not imported, and no sentinel left behind for other importers.


def test_local_paths_come_back_absolute_and_gs_ones_as_given(fake_gcs):  # pylint: disable=redefined-outer-name
  del fake_gcs
  assert str(storage.path("run")) == os.path.abspath("run")
  assert str(storage.path(f"gs://{BUCKET}/a/b")) == f"gs://{BUCKET}/a/b"
  assert storage.is_remote(f"gs://{BUCKET}/a") and not storage.is_remote("/tmp/a")


def test_the_write_ahead_log_and_locks_stay_on_local_disk(tmp_path):
  assert storage.local_dir(str(tmp_path), "", "the log") == str(tmp_path)
  assert storage.local_dir("gs://bucket/run", str(tmp_path / "local"), "the log") == str(tmp_path / "local")
  with pytest.raises(ConfigError, match="needs local disk: set --config.service.local_dir"):
    storage.local_dir("gs://bucket/run", "", "the log")
  with pytest.raises(ConfigError, match="must be on local disk"):
    storage.local_dir(str(tmp_path), "gs://bucket/wal", "the log")


def test_metrics_and_tensorboard_round_trip_and_resume(workdir):
  with MetricsWriter(workdir) as writer:
    for step in range(1, 5):
      writer.write({"kind": "train", "outer_step": step, "inner_step": 10 * step, "loss": 3.0 - step / 10})
  path = storage.path(workdir) / "metrics.jsonl"
  assert [r["outer_step"] for r in read_metrics(path)] == [1, 2, 3, 4]
  expected = [("train/loss", 10 * step, pytest.approx(3.0 - step / 10)) for step in range(1, 5)]
  assert _scalars(f"{workdir}/tensorboard") == expected

  path.write_text(path.read_text() + '{"kind": "train", "outer_')  # A crash cut the last record short.
  with MetricsWriter(workdir, resume_from_step=2) as writer:  # Resumed from the checkpoint at outer step 2.
    assert writer.records == 2
    writer.write({"kind": "train", "outer_step": 3, "inner_step": 30, "loss": 0.5})
    writer.sync()
    assert [r["outer_step"] for r in read_metrics(path)] == [1, 2, 3]  # Durable before close.
  assert path.read_text().endswith("\n")


def _state():
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  sharded = jax.device_put(jnp.arange(8, dtype=jnp.float32), NamedSharding(mesh, P("data")))
  return {"learner": {"w": sharded}, "syncer": {"theta": np.linspace(0, 1, 5, dtype=np.float32)}}


def test_checkpoints_save_restore_and_quarantine(workdir):
  state = _state()
  with Checkpointer(f"{workdir}/checkpoints", max_to_keep=2) as checkpointer:
    for step in (1, 2, 3):
      checkpointer.save(step, state, {"outer_step": step})
    assert checkpointer.all_steps() == [2, 3]
    restored, metadata = checkpointer.restore(3, abstract_like(state))
    assert metadata == {"outer_step": 3}
    np.testing.assert_array_equal(restored["learner"]["w"], np.arange(8))
    assert restored["learner"]["w"].sharding == state["learner"]["w"].sharding
    np.testing.assert_array_equal(restored["syncer"]["theta"], state["syncer"]["theta"])
    moved = checkpointer.quarantine(3)
    assert checkpointer.latest_step() == 2 and storage.path(moved).exists()
  assert checkpointer.directory == str(storage.path(f"{workdir}/checkpoints"))


def test_sweep_results_and_reports(workdir):
  for name, loss in (("a", 2.0), ("b", 1.5)):
    with MetricsWriter(f"{workdir}/{name}") as writer:
      writer.write({"kind": "eval", "outer_step": 1, "inner_step": 4, "eval_loss": loss})
  points = [sweep.Point("b", {}, None), sweep.Point("a", {}, None)]
  sweep.write_results(f"{workdir}/results.csv", points, {"a": {"status": "ok"}, "b": {"status": "ok"}})
  assert storage.path(f"{workdir}/results.csv").read_text().splitlines()[1].startswith("b,ok")
  runs = report.find_runs([workdir])
  assert list(runs) == ["b", "a"]  # The sweep's order, from its results.csv.
  written = report.write_report(report.load_runs([workdir]), f"{workdir}/report")
  assert written[-1] == f"{workdir}/report/report.md"
  assert "| b |" in storage.path(written[-1]).read_text()
  for path in written[:-1]:
    assert storage.path(path).read_bytes().startswith(b"\x89PNG")


def _train(workdir: str, env: dict, *flags: str) -> subprocess.CompletedProcess:
  """The README's demo command on `workdir`, shortened through config overrides, as a real process."""
  shorten = [
      "--config.outer_steps=2", "--config.inner_steps=3", "--config.checkpoint_every=1",
      "--config.data.synthetic.num_tokens=50000", "--config.eval_batches=1", "--config.log_every=2"]
  return subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/demo.py", f"--workdir={workdir}", *shorten, *flags],
      cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})


@pytest.mark.parametrize("location", ["foo://x/run", "gs:/BUCKET/run"])
def test_train_refuses_a_workdir_it_cannot_open_in_one_line(location, tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--config={REPO}/configs/demo.py", f"--workdir={location}"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      f"error: cannot open {location!r}: only local paths and "
      "gs://BUCKET/PATH are supported"]
  assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_train_on_a_gs_workdir_writes_every_output_and_resumes(fake_gcs):  # pylint: disable=redefined-outer-name
  workdir = f"gs://{BUCKET}/dd_demo"
  result = _train(workdir, fake_gcs)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "outer 2/2 | step 6 | loss" in result.stderr
  records = read_metrics(f"{workdir}/metrics.jsonl")
  assert {r["kind"] for r in records} == {"train", "outer", "eval", "summary"}
  assert "train/loss" in {tag for tag, _, _ in _scalars(f"{workdir}/tensorboard/learner_0")}
  assert "eval/eval_loss" in {tag for tag, _, _ in _scalars(f"{workdir}/tensorboard")}
  assert sorted(p.name for p in storage.path(f"{workdir}/checkpoints").iterdir()) == ["1", "2"]
  assert not (REPO / "gs:").exists()

  again = _train(workdir, fake_gcs)
  assert again.returncode == 2 and "already holds a run" in again.stderr

  resumed = _train(workdir, fake_gcs, "--config.resume=True", "--config.outer_steps=3")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from checkpoint at outer step 2" in resumed.stderr
  records = read_metrics(f"{workdir}/metrics.jsonl")
  assert [r["outer_step"] for r in records if r["kind"] == "eval"] == [1, 2, 3]
  assert sorted(p.name for p in storage.path(f"{workdir}/checkpoints").iterdir()) == ["1", "2", "3"]


def _service_process(role_flags: list[str], workdir: str, local_dir: str, env: dict) -> subprocess.Popen:
  """One process of a 2-learner decoupled run on `workdir`, its log and locks in `local_dir`."""
  env = {k: v for k, v in {**os.environ, **env}.items() if k != "XLA_FLAGS"}
  env["DD_SYNCER_TOKEN"] = "0123456789abcdef0123456789abcdef"
  return subprocess.Popen([
      sys.executable, "-m", "experiments.train", "--config=configs/demo.py", "--config.mode=decoupled",
      "--config.learners.devices=(2,2)", "--config.learners.batch_size=(16,16)", "--config.outer_steps=2",
      "--config.inner_steps=3", "--config.data.synthetic.num_tokens=50000", "--config.eval_batches=1",
      f"--workdir={workdir}", f"--config.service.local_dir={local_dir}", *role_flags], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)


def test_a_syncer_on_a_gs_workdir_without_a_local_dir_is_refused(fake_gcs):  # pylint: disable=W0621
  process = _service_process(["--role=syncer"], f"gs://{BUCKET}/svc_refused", "", fake_gcs)
  _, stderr = process.communicate(timeout=300)
  assert process.returncode == 2
  assert stderr.strip().splitlines() == [
      f"error: --workdir gs://{BUCKET}/svc_refused is remote but the syncer's "
      "write-ahead log and lock needs local disk: set --config.service.local_dir "
      "to a local directory"]
  assert not storage.path(f"gs://{BUCKET}/svc_refused").exists()


@pytest.mark.slow
def test_a_service_run_keeps_its_log_local_and_the_rest_on_gs(fake_gcs, tmp_path):  # pylint: disable=W0621
  workdir, port = f"gs://{BUCKET}/svc", free_port()
  syncer = _service_process(["--role=syncer", f"--config.service.port={port}"], workdir, str(tmp_path / "syncer"),
                            fake_gcs)
  learners = [
      _service_process(["--role=learner", f"--learner_id={m}", f"--syncer=127.0.0.1:{port}"], workdir,
                       str(tmp_path / f"host_{m}"), fake_gcs) for m in range(2)]
  for process in [*learners, syncer]:
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
  records = read_metrics(f"{workdir}/metrics.jsonl")
  summary, = [r for r in records if r["kind"] == "summary"]
  assert summary["done"] and summary["rejected_pushes"] == 0
  for m in range(2):
    assert any(r["kind"] == "learner_summary" for r in read_metrics(f"{workdir}/learner_{m}/metrics.jsonl"))
    assert (tmp_path / f"host_{m}" / f"learner_{m}" / "learner.0.lock").exists()
  assert list((tmp_path / "syncer" / "wal").iterdir()) and (tmp_path / "syncer" / "syncer.lock").exists()
  assert not storage.path(f"{workdir}/wal").exists()
  assert storage.path(f"{workdir}/checkpoints").is_dir()
  assert storage.path(f"{workdir}/syncer_address").read_text() == f"127.0.0.1:{port}"

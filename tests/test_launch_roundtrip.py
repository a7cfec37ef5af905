"""launch_tpu's verbs run for real against local stand-ins: up, start, status, a preemption that watch repairs, down.

The stand-ins are tests/launch_shims/gcloud (every VM and slice host a directory whose commands
run as local processes) and the fake GCS server of tests/fake_gcs.py for the gs:// workdir, so
the commands the dry run prints are the ones that start the syncer, the learners and the
evaluator here, from the shipped checkout, config and credentials.
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from experiments.launch_local import free_port
from tests.fake_gcs import fake_gcs  # noqa: F401  pylint: disable=unused-import
from tests.helpers import wait_for

REPO = pathlib.Path(__file__).parents[1]
SHIMS = REPO / "tests" / "launch_shims"
RUN = "dd-rt"
BUCKET = "proj-decoupled-diloco"  # The bucket `up` creates for --project=proj.


def _launch(env: dict, verb: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([
      sys.executable, "-m", "experiments.launch_tpu", verb, "--config=tests/launch_shims/tiny_config.py",
      "--slices=v6e-1@us-east1-d,v6e-1@us-east1-d", "--project=proj", f"--run_name={RUN}", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300, env=env)


def _records(env: dict, path: str) -> list[dict]:
  """The records of gs://BUCKET/RUN/`path` as the fake GCS serves them now ([] before the first upload)."""
  url = f"{env['STORAGE_EMULATOR_HOST']}/storage/v1/b/{BUCKET}/o/{RUN}%2F{path.replace('/', '%2F')}?alt=media"
  try:
    with urllib.request.urlopen(url, timeout=30) as response:
      lines = response.read().decode().splitlines()
  except urllib.error.HTTPError:
    return []
  return [json.loads(line) for line in lines if line.strip()]


def _pushes(env: dict, learner: int) -> int:
  return sum(r["kind"] == "push" and r["learner"] == learner and r["accepted"] for r in _records(env, "metrics.jsonl"))


def _evals(env: dict) -> list[float]:
  return [r["eval_loss"] for r in _records(env, "evaluator/metrics.jsonl") if r["kind"] == "eval"]


def _running(root: pathlib.Path, host: str = "") -> list[int]:
  """Pids of processes the shim's hosts (or `host`) started that are alive."""
  mark = f"DD_SHIM_HOST={root / 'hosts' / host}".encode()
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
      continue
    if any(entry == mark or (not host and entry.startswith(mark)) for entry in environ):
      found.append(int(pid))
  return found


@pytest.mark.slow
def test_up_start_status_preemption_watch_and_down_against_local_stand_ins(fake_gcs, tmp_path):  # noqa: F811
  root = tmp_path / "cloud"
  root.mkdir()
  (tmp_path / "home").mkdir()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(fake_gcs, PATH=f"{SHIMS}{os.pathsep}{env['PATH']}", HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path),
             DD_SHIM_ROOT=str(root), DD_SHIM_PYTHON=sys.executable)
  port = ("--port", str(free_port(count=2)))
  try:
    up = _launch(env, "up", *port)
    assert up.returncode == 0, up.stderr
    assert sorted(os.listdir(root / "hosts")) == [f"{RUN}-0", f"{RUN}-1", f"{RUN}-eval", f"{RUN}-syncer"]
    start = _launch(env, "start", *port)
    assert start.returncode == 0, start.stderr
    home = root / "hosts" / f"{RUN}-1" / "worker-0" / "dd" / RUN
    assert (home / "config.py").read_text() == (SHIMS / "tiny_config.py").read_text()  # Shipped, and used:
    assert _running(root, f"{RUN}-syncer") and _running(root, f"{RUN}-0") and _running(root, f"{RUN}-eval")
    # The syncer serves, every learner joins and pushes, the evaluator writes evals (uploaded every 30 s).
    assert wait_for(lambda: _pushes(env, 0) and _pushes(env, 1), 240, 2), (home / "learner_1.log").read_text()[-3000:]
    assert wait_for(lambda: any(r["kind"] == "eval" for r in _records(env, "evaluator/metrics.jsonl")), 120, 2)
    # Slice 1 is taken back: its learner dies with it; watch recreates the slice and starts learner 1 again.
    subprocess.run(["gcloud", "_shim", "preempt", f"{RUN}-1"], env=env, check=True)
    assert wait_for(lambda: not _running(root, f"{RUN}-1"), 10, 0.1)
    before = _pushes(env, 1)
    status = _launch(env, "status", *port)
    assert status.returncode == 0 and f"{RUN}-1" in status.stdout and "PREEMPTED" in status.stdout, status.stderr
    watched = _launch(env, "watch", *port, "--watch_rounds=1", "--watch_seconds=0")
    assert watched.returncode == 0, watched.stderr
    assert f"slice {RUN}-1 is lost: recreating it and restarting learner 1" in watched.stdout
    assert _running(root, f"{RUN}-1")
    assert wait_for(lambda: _pushes(env, 1) > before + 1, 240, 2), (home / "learner_1.log").read_text()[-3000:]
    # What the run learned, evaluated on the evaluator's own slice: below the untrained ln(V) and falling.
    assert wait_for(lambda: len(_evals(env)) >= 2, 60, 2)
    losses = _evals(env)
    assert losses[-1] < min(math.log(256), losses[0]), losses
    logs = _launch(env, "logs", *port, "--lines=2")
    assert logs.returncode == 0 and logs.stdout.count("# learner ") == 2, logs.stderr
    status = _launch(env, "status", *port)
    rows = [line.split() for line in status.stdout.splitlines()[1:]]
    assert [(row[0], row[2]) for row in rows] == [
        ("0", "READY"), ("1", "READY")] and all(int(row[3]) > 0 for row in rows), status.stdout
    down = _launch(env, "down", *port)
    assert down.returncode == 0, down.stderr
    assert not os.listdir(root / "hosts") and wait_for(lambda: not _running(root), 10, 0.1)
  finally:
    for pid in _running(root):
      os.kill(pid, 9)
    time.sleep(0.1)

"""experiments.train's start-up: the multi-host runtime where it is right, one line naming the launcher where not."""

import os
import pathlib
import subprocess
import sys

from experiments import startup

REPO = pathlib.Path(__file__).parents[1]


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.train", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env=env)


def test_groups_beyond_the_visible_devices_are_refused_naming_the_launcher():
  # A v5p-128 + v6e-64 config on one v5p host (4 chips): each group is its own process on its own slice.
  message = startup.shortfall((64, 64), "local", None, 4, "tpu")
  assert message.startswith("learners.devices=(64, 64) needs 128 devices but this process sees 4 (tpu)")
  assert "python -m experiments.launch_tpu up/start" in message and "\n" not in message
  # One group over a multi-host slice: its learner process on every host, joined by --group_coordinator=auto.
  assert "--group_coordinator=auto" in startup.shortfall((64,), "local", None, 4, "tpu")
  assert "--group_coordinator=auto" in startup.shortfall((64, 64), "learner", 1, 4, "tpu")
  # What fits, and the syncer (CPU only), start.
  assert startup.shortfall((64, 64), "learner", 1, 64, "tpu") == ""
  assert startup.shortfall((2, 2, 2, 2), "local", None, 8, "cpu") == ""
  assert startup.shortfall((64, 64), "syncer", None, 1, "cpu") == ""


def test_the_documented_tpu_config_run_in_one_process_names_launch_tpu_and_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  result = _train("--config=configs/tpu_1b.py", f"--workdir={workdir}")
  assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
  assert result.stderr.startswith("error: runtime 'service' runs as separate processes")
  assert "python -m experiments.launch_tpu up/start" in result.stderr
  assert not workdir.exists()


def test_the_group_flags_come_from_the_launchers_environment(tmp_path):
  # demo's learner group 0 has 2 devices: 3 processes cannot split them, which shows DD_GROUP_PROCESSES was read.
  env = dict(os.environ, DD_GROUP_COORDINATOR="127.0.0.1:1", DD_GROUP_PROCESSES="3", DD_GROUP_PROCESS_ID="1")
  env.pop("XLA_FLAGS", None)
  result = _train("--config=configs/demo.py", "--role=learner", "--learner_id=0", "--syncer=127.0.0.1:1",
                  f"--workdir={tmp_path / 'run'}", env=env)
  assert result.returncode == 2, result.stderr
  assert "a learner group of 2 devices cannot be split over 3 processes" in result.stderr
  assert not (tmp_path / "run").exists()

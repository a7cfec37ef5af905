"""launch_tpu's verbs against a fake `gcloud` on PATH (a script that records its calls), and their dry runs."""

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import security
from experiments import credentials, launch_tpu
from experiments.launch import provision, watch

REPO = pathlib.Path(__file__).parents[1]
SLICES = "v5p-32@us-east5-a,v6e-32@us-east1-d"
OVERRIDES = ("--config.learners.devices=(16, 32)", "--config.learners.batch_size=(16, 32)")
SECRET = "s3cr3t-token-that-must-never-show-0123456789"
SYNCER_VM_IP = "10.1.2.3"

# Records its argv (one JSON line per call) and answers like gcloud would: slice dd-t-1 is PREEMPTED the first
# time its state is asked for, every other slice READY (describe fails for the slices in $FAKE_GCLOUD_FAIL; the
# zone lists $FAKE_GCLOUD_LISTED); the syncer VM's internal IP; the syncer's records.
FAKE_GCLOUD = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
  log.write(json.dumps(args) + "\\n")
describe = args[:4] == ["compute", "tpus", "tpu-vm", "describe"]
if describe and args[4] in os.environ.get("FAKE_GCLOUD_FAIL", "").split(","):
  sys.exit(1)  # gcloud could not tell (the slice is gone, or gcloud failed).
elif args[:4] == ["compute", "tpus", "tpu-vm", "list"]:
  if os.environ.get("FAKE_GCLOUD_LIST_FAILS"):
    sys.exit(1)
  print("\\n".join(os.environ.get("FAKE_GCLOUD_LISTED", "").split(",")))
elif describe and "--format=value(state)" in args:
  flag = os.path.join(os.path.dirname(os.environ["FAKE_GCLOUD_LOG"]), "preempted_once")
  if args[4] == "dd-t-1" and not os.path.exists(flag):
    open(flag, "w").close()
    print("PREEMPTED")
  else:
    print("READY")
elif args[:3] == ["compute", "instances", "describe"]:
  print("{ip}")
elif args[:2] == ["storage", "cat"]:
  sys.stdout.write(open(os.environ["FAKE_GCLOUD_RECORDS"]).read())
"""


@pytest.fixture
def fake_gcloud(tmp_path):
  """A PATH whose `gcloud` is the recording fake, a HOME and TMPDIR of the test's own, and the run's token."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  gcloud = bin_dir / "gcloud"
  gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable, ip=SYNCER_VM_IP))
  gcloud.chmod(0o755)
  token = tmp_path / "token"
  token.write_text(SECRET + "\n")
  (tmp_path / "home").mkdir()
  env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path / "home"),
             TMPDIR=str(tmp_path), FAKE_GCLOUD_LOG=str(tmp_path / "calls.jsonl"),
             FAKE_GCLOUD_RECORDS=str(tmp_path / "metrics.jsonl"))
  return env, token


def _launch(verb: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([
      sys.executable, "-m", "experiments.launch_tpu", verb, "--config=configs/default.py", *OVERRIDES,
      f"--slices={SLICES}", "--project=proj", "--run_name=dd-t", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env=env)


def _calls(env: dict) -> list[list[str]]:
  with open(env["FAKE_GCLOUD_LOG"], encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _commands(stdout: str) -> list[list[str]]:
  return [shlex.split(line) for line in stdout.splitlines() if line and not line.startswith("#")]


def _remote(command: list[str]) -> str:
  return next(a.split("=", 1)[1] for a in command if a.startswith("--command="))


def test_watch_recreates_the_preempted_slice_and_restarts_its_learner_with_the_same_id(fake_gcloud):
  env, token = fake_gcloud
  result = _launch("watch", f"--token_file={token}", "--watch_rounds=2", "--watch_seconds=0", env=env)
  assert result.returncode == 2 and "run start first" in result.stderr  # No CA of the run here yet.
  assert not os.path.exists(env["FAKE_GCLOUD_LOG"])
  tls = pathlib.Path(env["HOME"], ".config", "decoupled_diloco", "dd-t", "tls")
  ca = credentials.make_certificates(str(tls), SYNCER_VM_IP)["ca.pem"]  # What `start` made.
  result = _launch("watch", f"--token_file={token}", "--watch_rounds=2", "--watch_seconds=0", env=env)
  assert result.returncode == 0, result.stderr
  calls = _calls(env)
  reads = [c for c in calls if c[3] == "describe" or c[2] == "describe"]
  changes = [c for c in calls if c not in reads]
  # Two rounds looked at both slices; only the syncer VM's IP was read besides.
  states = [c[4] for c in reads if "--format=value(state)" in c]
  assert sorted(states) == ["dd-t-0", "dd-t-0", "dd-t-1", "dd-t-1"]
  assert [c[3] for c in reads if c[1] == "instances"] == ["dd-t-syncer"]
  # Slice 1 deleted and created once, as `up` creates it; every other change is on slice 1 only.
  assert [c[:5] for c in changes[:2]] == [["compute", "tpus", "tpu-vm", "delete", "dd-t-1"],
                                          ["compute", "tpus", "tpu-vm", "create", "dd-t-1"]]
  assert "--accelerator-type=v6e-32" in changes[1] and "--version=v2-alpha-tpuv6e" in changes[1]
  assert all(
      c[:3] == ["compute", "tpus", "tpu-vm"] and (c[4] == "dd-t-1" or c[5].startswith("dd-t-1:")) for c in changes)
  starts = [c for c in changes if c[3] == "ssh" and "--role=learner" in _remote(c)]
  assert len(starts) == 1 and "--worker=all" in starts[0]
  learner = _remote(starts[0])
  assert "--learner_id=1 " in learner and f"--syncer={SYNCER_VM_IP}:50051 " in learner
  assert "--workdir=gs://proj-decoupled-diloco/dd-t " in learner and "--role=syncer" not in str(changes)
  # Its credential (learner 1's, derived from the run secret for real), the run's CA and the config went to the new
  # slice.
  copied = {c[5].split(":", 1)[1]: c[4] for c in changes if c[3] == "scp"}
  assert set(copied) == {"dd/dd-t/src.tar.gz", "dd/dd-t/config.py", "dd/dd-t/token", "dd/dd-t/tls_ca.pem"}
  assert copied["dd/dd-t/config.py"] == "configs/default.py" and '--config="$D/config.py" ' in learner
  assert pathlib.Path(copied["dd/dd-t/token"]).read_text().strip() == security.learner_credential(SECRET, 1)
  assert copied["dd/dd-t/tls_ca.pem"] == ca
  assert SECRET not in result.stdout + result.stderr + str(calls)


def test_watch_counts_a_slice_as_gone_only_when_the_zone_does_not_list_it(fake_gcloud, monkeypatch):
  env, token = fake_gcloud
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  options = launch_tpu.Options("configs/default.py", OVERRIDES, tuple(launch_tpu.parse_slices(SLICES)), "proj", "dd-t",
                               token_file=str(token))
  monkeypatch.setenv("FAKE_GCLOUD_FAIL", "dd-t-0")
  monkeypatch.setenv("FAKE_GCLOUD_LISTED", "dd-t-0,dd-t-1")  # describe failed, yet the slice is there: transient.
  assert watch.lost(options) == [(1, True)]  # Only the PREEMPTED one.
  monkeypatch.setenv("FAKE_GCLOUD_LIST_FAILS", "1")  # Nothing known about dd-t-0 this round: left alone.
  assert watch.lost(options) == []
  monkeypatch.delenv("FAKE_GCLOUD_LIST_FAILS")
  monkeypatch.setenv("FAKE_GCLOUD_LISTED", "dd-t-1")
  assert watch.lost(options) == [(0, False)]  # Gone: created again, nothing to delete.
  assert [s.argv[3:5] for s in watch.recover(options, 0, False)[:1]] == [("tpu-vm", "create")]


def test_status_shows_each_learners_steps_version_staleness_and_last_push(fake_gcloud):
  env, token = fake_gcloud
  push = {"kind": "push", "fragment": 0, "accepted": 1, "tokens": 64, "wire_bytes": 10, "replayed": 0}
  records = [
      {"kind": "start", "outer_step": 0, "learners": [0, 1], "wall_time": 0.0},
      {**push, "learner": 0, "seq": 0, "local_steps": 20, "outer_step": 1, "staleness": 0, "wall_time": 5.0},
      {**push, "learner": 0, "seq": 1, "local_steps": 20, "outer_step": 3, "staleness": 1, "wall_time": 9.0},
      {
          **push, "learner": 0, "seq": 1, "local_steps": 20, "outer_step": 3, "staleness": 1, "wall_time": 9.0,
          "replayed": 1},  # A resumed syncer's replay of a push it had: counted once.
      {
          **push, "learner": 0, "seq": 2, "local_steps": 20, "outer_step": 3, "staleness": 4, "wall_time": 11.0,
          "accepted": 0}]
  pathlib.Path(env["FAKE_GCLOUD_RECORDS"]).write_text("".join(json.dumps(r) + "\n" for r in records) +
                                                      '{"kind": "pu')  # The tail of a file being written.
  result = _launch("status", f"--token_file={token}", env=env)
  assert result.returncode == 0, result.stderr
  rows = [line.split() for line in result.stdout.splitlines()[1:]]
  assert rows == [["0", "dd-t-0", "READY", "40", "3", "4", "11s", "0s"],
                  ["1", "dd-t-1", "PREEMPTED", "-", "-", "-", "-", "-"]]
  records = ["storage", "cat", "gs://proj-decoupled-diloco/dd-t/metrics.jsonl"]
  assert all(c[2:4] == ["tpu-vm", "describe"] or c == records for c in _calls(env))  # Read-only.


def test_dry_run_of_up_and_start_for_v5p_and_v6e(tmp_path):
  token = tmp_path / "token"
  token.write_text(SECRET + "\n")
  up = _launch("up", f"--token_file={token}", "--dry_run", "--spot")
  start = _launch("start", f"--token_file={token}", "--dry_run")
  assert up.returncode == 0 and start.returncode == 0, up.stderr + start.stderr
  assert SECRET not in up.stdout + start.stdout
  created = _commands(up.stdout)
  assert [c[:6] for c in created
         ] == [["gcloud", "storage", "buckets", "create", "gs://proj-decoupled-diloco", "--project=proj"],
               ["gcloud", "compute", "tpus", "tpu-vm", "create", "dd-t-0"],
               ["gcloud", "compute", "tpus", "tpu-vm", "create", "dd-t-1"],
               ["gcloud", "compute", "instances", "create", "dd-t-syncer", "--zone=us-east5-a"]]
  assert all("--spot" in c for c in created[1:3]) and "--spot" not in created[3]  # Only the slices are Spot.
  assert created[3][6].startswith("--machine-type=n2-highmem-")  # The syncer's own CPU VM, no accelerator.
  commands = _commands(start.stdout)
  syncer, = [c for c in commands if "--role=syncer" in " ".join(c)]
  assert syncer[:4] == ["gcloud", "compute", "ssh", "dd-t-syncer"] and "JAX_PLATFORMS" not in _remote(syncer)
  assert not any("--role=learner" in _remote(c) for c in commands if c[:4] == syncer[:4])
  lookup = commands.index([
      "gcloud", "compute", "instances", "describe", "dd-t-syncer", "--zone=us-east5-a", "--project=proj",
      "--format=value(networkInterfaces[0].networkIP)"])
  learners = [c for c in commands if "--role=learner" in " ".join(c)]
  assert [c[5] for c in learners] == ["dd-t-0", "dd-t-1"]
  for i, command in enumerate(learners):
    remote = _remote(command)
    assert commands.index(command) > lookup and f"--learner_id={i} " in remote
    assert "--syncer=SYNCER_IP:50051 " in remote and '--config.service.tls_ca="$D/tls_ca.pem"' in remote
  for command in learners + [syncer]:
    assert "--workdir=gs://proj-decoupled-diloco/dd-t " in _remote(command)
  # TLS material: a certificate naming the syncer's internal IP; it and its key to the syncer only, the CA to
  # every slice; each slice its own learner credential, the run secret to the syncer only.
  certs, = [c for c in commands if c[1:4] == ["-m", "experiments.credentials", "certs"]]
  assert certs[5] == "--host=SYNCER_IP" and commands.index(certs) > lookup
  copies = {
      tuple(next(a for a in c[3:] if ":" in a and not a.startswith("-")).split(":")) for c in commands
      if "scp" in c[2:5]}
  assert {(h, f) for h, f in copies if f.split("/")[-1] in ("tls.crt", "tls.key", "secret")} == {
      ("dd-t-syncer", "dd/dd-t/tls.crt"), ("dd-t-syncer", "dd/dd-t/tls.key"), ("dd-t-syncer", "dd/dd-t/secret")}
  assert {(h, f) for h, f in copies if f.endswith(("tls_ca.pem", "/token"))} == {("dd-t-0", "dd/dd-t/tls_ca.pem"),
                                                                                 ("dd-t-1", "dd/dd-t/tls_ca.pem"),
                                                                                 ("dd-t-0", "dd/dd-t/token"),
                                                                                 ("dd-t-1", "dd/dd-t/token")}
  assert '--config.service.tls_key="$D/tls.key"' in _remote(syncer)


def test_queued_slices_wait_until_active_and_down_deletes_them(tmp_path):
  options = launch_tpu.Options("configs/default.py", OVERRIDES, tuple(launch_tpu.parse_slices(SLICES)), "proj", "dd-t",
                               queued=True, spot=True, token_file=str(tmp_path / "token"))
  steps = provision.up(options)
  queued = [s for s in steps if s.argv[3:5] == ("queued-resources", "create")]
  assert [s.argv[5] for s in queued] == ["dd-t-0", "dd-t-1"] and all("--spot" in s.argv for s in queued)
  waits = [s for s in steps if s.until]
  assert [(s.argv[5], s.until) for s in waits] == [("dd-t-0", "ACTIVE"), ("dd-t-1", "ACTIVE")]
  down = [s.argv for s in provision.down(options)]
  assert [a[2:6] for a in down] == [("tpus", "queued-resources", "delete", "dd-t-0"),
                                    ("tpus", "queued-resources", "delete", "dd-t-1"),
                                    ("instances", "delete", "dd-t-syncer", "--zone=us-east5-a")]
  assert watch.recover(options, 1, True)[0].argv[3:6] == ("queued-resources", "delete", "dd-t-1")


def test_xpk_mode_runs_one_workload_per_slice_type_from_an_image_of_this_checkout(tmp_path):
  result = _launch("start", "--xpk_cluster=dd-gke", "--token_secret=dd-token", "--dry_run")
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  build, = [c for c in commands if c[:2] == ["docker", "build"]]
  assert build[-1] == str(REPO) and (REPO / "Dockerfile").is_file()
  workloads = [c for c in commands if c[:3] == ["xpk", "workload", "create"]]
  assert [(c[3], c[4], c[6], c[7]) for c in workloads] == [
      ("--cluster=dd-gke-v5p", "--zone=us-east5-a", "--workload=dd-t-0", "--tpu-type=v5p-32"),
      ("--cluster=dd-gke-v6e", "--zone=us-east1-d", "--workload=dd-t-1", "--tpu-type=v6e-32")]
  for i, command in enumerate(workloads):
    pod = _remote(command)
    assert "--num-slices=1" in command and "--docker-image=gcr.io/proj/decoupled-diloco:dd-t" in command
    assert f"--learner={i} " in pod and f"--learner_id={i} " in pod and "--syncer=SYNCER_IP:50051 " in pod
    assert "--group_coordinator=auto" in pod and "gs://proj-decoupled-diloco/dd-t/tls_ca.pem" in pod
  assert not any(c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] for c in commands)  # No TPU VMs.
  assert any(c[:4] == ["gcloud", "compute", "ssh", "dd-t-syncer"] and "--role=syncer" in _remote(c) for c in commands)


@pytest.mark.parametrize("changes, message", [
    ({"slices": tuple(launch_tpu.parse_slices("v5p-32@us-east5-a,v5p-32@us-east5-b"))}, "one slice per TPU type"),
    ({}, "needs --token_secret"),])
def test_xpk_mode_refuses_what_it_cannot_run(changes, message):
  from experiments.launch import xpk  # pylint: disable=g-import-not-at-top
  options = launch_tpu.Options("configs/default.py", OVERRIDES, tuple(launch_tpu.parse_slices(SLICES)), "proj", "dd-t",
                               xpk_cluster="dd-gke", token_secret="" if not changes else "s")
  with pytest.raises(ConfigError, match=message):
    xpk.check(launch_tpu.Options(**{**options.__dict__, **changes}))


def test_unknown_verbs_and_local_workdirs_or_tfds_dirs_are_one_error_line(tmp_path):
  for args, message in ((("--workdir=/tmp/x",), "every host must see the run's workdir"),
                        (("--config.data.source=tfds", "--config.data.tfds_name=tiny_shakespeare",
                          "--config.data.tfds_data_dir=/data/tfds"), "is not on GCS")):
    result = _launch("up", *args, "--dry_run")
    assert result.returncode == 2 and result.stdout == "" and message in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1
  result = _launch("launch-all", "--dry_run")
  assert result.returncode == 2 and "unknown verb 'launch-all'" in result.stderr
  result = _launch("down", env=dict(os.environ, PATH=str(tmp_path)))  # No gcloud: nothing can run.
  assert result.returncode == 2 and result.stderr.startswith("error: gcloud not found on PATH"), result.stderr


def test_the_syncer_vm_is_sized_from_the_plans_host_bytes():
  gb = 1 << 30
  assert provision.syncer_machine_type(15 * gb) == "n2-highmem-8"  # tpu_1b: 15 GB -> 38 GB needed, 64 GB.
  assert provision.syncer_machine_type(150 * gb) == "n2-highmem-48"  # tpu_8b: 150 GB -> 308 GB needed, 384 GB.
  with pytest.raises(ValueError, match="more than n2-highmem-128"):
    provision.syncer_machine_type(600 * gb)


@pytest.mark.parametrize("verb, expected", [
    ("status", [["gcloud", "compute", "tpus", "tpu-vm", "describe", "dd-t-0"]]),
    ("logs", [["gcloud", "compute", "ssh", "dd-t-syncer"], ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "dd-t-0"]]),
    ("watch", [["gcloud", "compute", "tpus", "tpu-vm", "describe", "dd-t-0"],
               ["gcloud", "compute", "tpus", "tpu-vm", "delete", "dd-t-0"]]),
    ("down", [["gcloud", "compute", "tpus", "tpu-vm", "delete", "dd-t-0"],
              ["gcloud", "compute", "instances", "delete", "dd-t-syncer"]]),])
def test_every_verb_has_a_dry_run_that_runs_nothing(tmp_path, verb, expected):
  # No gcloud on PATH and a HOME of its own: a dry run neither calls gcloud nor makes a token.
  env = dict(os.environ, PATH=str(tmp_path), HOME=str(tmp_path))
  result = _launch(verb, "--dry_run", env=env)
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  for prefix in expected:
    assert any(c[:len(prefix)] == prefix for c in commands), (prefix, result.stdout)
  assert all(c[0] in ("gcloud", "tar", sys.executable) for c in commands)
  assert os.listdir(tmp_path) == []


def test_logs_tails_every_syncer_shards_log_under_the_name_start_gave_it():
  options = launch_tpu.Options("configs/default.py", OVERRIDES, tuple(launch_tpu.parse_slices(SLICES)), "proj", "dd-t",
                               syncer_shards=2)
  tails = [_remote(list(s.argv)) for s in watch.logs(options, 7)]
  assert tails == [
      "tail -n 7 dd/dd-t/syncer_0.log", "tail -n 7 dd/dd-t/syncer_1.log", "tail -n 7 dd/dd-t/learner_0.log",
      "tail -n 7 dd/dd-t/learner_1.log"]
  started = [_remote(list(s.argv)) for s in launch_tpu.plan(options, "start") if "--role=syncer" in " ".join(s.argv)]
  assert ['"$D/syncer_0.log"' in started[0], '"$D/syncer_1.log"' in started[1]] == [True, True]


def test_watch_recreates_a_lost_evaluator_slice_and_starts_the_evaluator_again():
  options = launch_tpu.Options("configs/default.py", (*OVERRIDES, "--config.service.evaluate_on=evaluator"),
                               tuple(launch_tpu.parse_slices(SLICES)), "proj", "dd-t", syncer_address="10.0.0.7",
                               token_file="/t/dd-t.token",
                               evaluator_slice=launch_tpu.parse_slices("v5p-8@us-east5-a")[0])
  commands = [list(s.argv) for s in watch.recover(options, 2, True)]
  assert [c[4:6] for c in commands[:2]] == [["delete", "dd-t-eval"], ["create", "dd-t-eval"]]
  gcloud = [c for c in commands if c[0] == "gcloud"]
  assert all(c[2:4] == ["tpus", "tpu-vm"] and (c[5] == "dd-t-eval" or c[6].startswith("dd-t-eval:")) for c in gcloud)
  copied = {c[6].split(":", 1)[1] for c in gcloud if c[4] == "scp"}
  assert copied == {"dd/dd-t/src.tar.gz", "dd/dd-t/config.py", "dd/dd-t/token", "dd/dd-t/tls_ca.pem"}
  assert [c[3] for c in commands if c[1:3] == ["-m", "experiments.credentials"]] == ["evaluator"]
  started = _remote(commands[-1])
  assert "--role=evaluator " in started and "--syncer=10.0.0.7:50051 " in started and "--role=learner" not in started

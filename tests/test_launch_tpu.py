"""The Cloud TPU launcher's plan, checked through its dry run: what it would create and start."""

import pathlib
import shlex
import socket
import ssl
import subprocess
import sys
import threading

import pytest

from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import security
from experiments import credentials, launch_tpu
from experiments.launch import docs

REPO = pathlib.Path(__file__).parents[1]
SLICES = "v5p-32@us-east5-a,v6e-32@us-east1-d"
OVERRIDES = ("--config.learners.devices=(16, 32)", "--config.learners.batch_size=(16, 32)")


def _dry_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "experiments.launch_tpu", "--config=configs/default.py", *args, "--dry_run"], cwd=REPO,
      capture_output=True, text=True, timeout=300, env=env)


def _commands(stdout: str) -> list[list[str]]:
  return [shlex.split(line) for line in stdout.splitlines() if line and not line.startswith("#")]


def _remote(command: list[str]) -> str:
  return next(a.split("=", 1)[1] for a in command if a.startswith("--command="))


def _host(command: list[str]) -> str:
  return command[5] if command[2] == "tpus" else command[3]


def _options(**changes) -> launch_tpu.Options:
  base = launch_tpu.Options("configs/default.py", OVERRIDES, tuple(launch_tpu.parse_slices(SLICES)), "proj", "dd-t",
                            token_file="/home/me/.config/decoupled_diloco/dd-t.token")
  return launch_tpu.Options(**{**base.__dict__, **changes})


@pytest.mark.slow
def test_dry_run_creates_each_slice_and_starts_the_syncer_and_one_learner_per_slice(tmp_path):
  secret = "s3cr3t-token-that-must-never-show-0123456789"
  token = tmp_path / "token"
  token.write_text(secret + "\n")
  result = _dry_run(*OVERRIDES, f"--slices={SLICES}", "--project=proj", "--run_name=dd-t", f"--token_file={token}",
                    "--syncer_on_slice")
  assert result.returncode == 0, result.stderr
  assert secret not in result.stdout + result.stderr
  commands = _commands(result.stdout)
  creates = [c for c in commands if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]]
  assert [(c[5], c[6], c[7], c[8]) for c in creates] == [
      ("dd-t-0", "--zone=us-east5-a", "--accelerator-type=v5p-32", "--version=v2-alpha-tpuv5"),
      ("dd-t-1", "--zone=us-east1-d", "--accelerator-type=v6e-32", "--version=v2-alpha-tpuv6e")]
  assert all("--project=proj" in c for c in commands if c[0] == "gcloud")
  syncers = [c for c in commands if any("--role=syncer" in a for a in c)]
  assert len(syncers) == 1 and syncers[0][5:9] == ["dd-t-0", "--zone=us-east5-a", "--project=proj", "--worker=0"]
  syncer = _remote(syncers[0])
  assert "JAX_PLATFORMS=cpu " in syncer  # shares worker 0 with learner 0: keeps off its TPU
  assert "--config.service.host=0.0.0.0" in syncer and "--config.service.port=50051" in syncer
  assert "--config.service.data_port=50052" in syncer
  lookup = commands.index(next(c for c in commands if c[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "describe"]))
  learners = [c for c in commands if any("--role=learner" in a for a in c)]
  assert len(learners) == 2
  for i, command in enumerate(learners):
    assert command[5] == f"dd-t-{i}" and "--worker=all" in command and commands.index(command) > lookup
    remote = _remote(command)
    assert f"--learner_id={i} " in remote and "--syncer=SYNCER_IP:50051 " in remote
    assert "--group_coordinator=auto" in remote  # the slice's workers form one multi-host JAX program
    assert "--config.learners.devices=(16, 32)" in remote  # overrides reach every process
  # The workdir is gs://: what needs fsync and flock (the syncer's log, every lock) goes to the host's own disk,
  # or storage.local_dir refuses to start (service.wal_dir, tested for before, was renamed local_dir).
  assert all('--config.service.local_dir="$D/local"' in _remote(c) for c in [*syncers, *learners])
  # Secrets travel as file paths only: the run secret to the syncer's host, each learner its own credential.
  assert '--config.service.token_file="$D/secret"' in syncer and "DD_SYNCER_TOKEN" not in syncer
  for command in learners:
    assert '--config.service.token_file="$D/token"' in _remote(command) and "DD_SYNCER_TOKEN" not in _remote(command)
  secrets = [c for c in commands if c[4:5] == ["scp"] and c[5] == str(token)]
  assert [c[6] for c in secrets] == ["dd-t-0:dd/dd-t/secret"] and "--worker=0" in secrets[0]
  derived = [c for c in commands if c[1:4] == ["-m", "experiments.credentials", "learner"]]
  assert [c[5] for c in derived] == ["--learner=0", "--learner=1"]
  copies = [c for c in commands if c[4:5] == ["scp"] and c[6].endswith(":dd/dd-t/token")]
  assert [(c[5], c[6]) for c in copies] == [
      (d[6][len("--out="):], f"dd-t-{i}:dd/dd-t/token") for i, d in enumerate(derived)]
  # TLS by default: a certificate naming the looked-up IP, the CA to every host, the key to the syncer's.
  certs, = [c for c in commands if c[1:4] == ["-m", "experiments.credentials", "certs"]]
  assert certs[5] == "--host=SYNCER_IP" and commands.index(certs) > lookup
  assert '--config.service.tls_cert="$D/tls.crt"' in syncer and '--config.service.tls_key="$D/tls.key"' in syncer
  assert all('--config.service.tls_ca="$D/tls_ca.pem"' in _remote(c) for c in learners)
  keys = [c for c in commands if c[4:5] == ["scp"] and c[6].endswith(":dd/dd-t/tls.key")]
  assert [c[5].rsplit("/", 1)[1] for c in keys] == ["syncer.key"] and "--worker=0" in keys[0]


def test_plaintext_off_loopback_needs_insecure_and_says_so(tmp_path):
  token = tmp_path / "token"
  token.write_text("t" * 32 + "\n")
  result = _dry_run(*OVERRIDES, f"--slices={SLICES}", "--project=proj", "--run_name=dd-t", f"--token_file={token}",
                    "--insecure")
  assert result.returncode == 0 and "WARNING: --insecure" in result.stderr and "PLAINTEXT" in result.stderr
  assert "tls_c" not in result.stdout  # Neither the syncer nor the learners get TLS flags.
  assert not any("experiments.credentials certs" in " ".join(c) for c in _commands(result.stdout))
  with pytest.raises(ConfigError, match="--insecure and --tls_cert"):
    launch_tpu.check(_options(insecure=True, tls_cert="/c.pem", tls_key="/k.pem"), (16, 32))


def test_credentials_and_certificates_work_for_the_real_service(tmp_path):
  secret = tmp_path / "secret"
  secret.write_text("r" * 32 + "\n")
  out = tmp_path / "learner_1.token"
  assert credentials.main(["learner", f"--secret_file={secret}", "--learner=1", f"--out={out}"]) == 0
  assert out.read_text().strip() == security.learner_credential("r" * 32, 1)
  assert oct(out.stat().st_mode & 0o777) == "0o600"
  paths = credentials.make_certificates(str(tmp_path / "tls"), "127.0.0.1")
  ca = open(paths["ca.pem"], "rb").read()
  again = credentials.make_certificates(str(tmp_path / "tls"), "127.0.0.1")  # The CA is kept across calls.
  assert open(again["ca.pem"], "rb").read() == ca
  server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  server.load_cert_chain(paths["syncer.pem"], paths["syncer.key"])
  client = ssl.create_default_context(cadata=ca.decode())
  with socket.create_server(("127.0.0.1", 0)) as listener:

    def serve():
      connection, _ = listener.accept()
      with server.wrap_socket(connection, server_side=True) as tls:
        tls.sendall(tls.recv(5))

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(listener.getsockname()) as raw, client.wrap_socket(
        raw, server_hostname="127.0.0.1") as tls:
      tls.sendall(b"hello")
      assert tls.recv(5) == b"hello"
    thread.join()


@pytest.mark.parametrize("spec, message", [
    ("", "--slices is empty"),
    ("v5p32@us-east5-a", "bad --slices entry 'v5p32@us-east5-a': expected TYPE-SIZE@ZONE"),
    ("v7x-8@us-east5-a", "bad --slices entry 'v7x-8@us-east5-a'"),
    ("v5p-32", "bad --slices entry 'v5p-32'"),
    ("v5p-32@useast5", "bad zone 'useast5'"),
    ("v5p-31@us-east5-a", "two per chip: use an even size"),])
def test_bad_slice_specs_name_the_expected_form(spec, message):
  with pytest.raises(ConfigError, match=message) as error:
    launch_tpu.parse_slices(spec)
  assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_bad_slice_spec_on_the_command_line_is_one_error_line_and_status_2():
  result = _dry_run("--slices=v5p-32@us-east5-a,v6e32@us-east1-d", "--project=proj")
  assert result.returncode == 2 and result.stdout == ""
  assert result.stderr.startswith("error: bad --slices entry 'v6e32@us-east1-d'") and result.stderr.count("\n") == 1


def test_slices_must_match_the_learner_groups():
  options = _options()
  launch_tpu.check(options, (16, 32))
  with pytest.raises(ConfigError, match="lists 2 slices but the config has 4 learner groups"):
    launch_tpu.check(options, (2, 2, 2, 2))
  with pytest.raises(ConfigError, match=r"slice 1 \(v6e-32\) has 32 chips but learners.devices\[1\]=16"):
    launch_tpu.check(options, (16, 16))
  with pytest.raises(ConfigError, match="--run_name"):
    launch_tpu.check(_options(run_name="Bad_Name"), (16, 32))


def test_a_cpu_syncer_vm_with_secret_manager_and_tls_reusing_the_slices():
  options = _options(reuse=True, syncer_vm="dd-syncer@us-central1-a", token_file="", token_secret="dd-token",
                     tls_cert="/certs/syncer.pem", tls_key="/certs/syncer.key")
  commands = [list(s.argv) for s in launch_tpu.plan(options)]
  assert not any("create" in c for c in commands if c[0] == "gcloud")  # --reuse
  fetches = [c for c in commands if "secrets versions access latest --secret=dd-token" in " ".join(c)]
  assert [_host(c) for c in fetches] == ["dd-t-0", "dd-t-1", "dd-syncer"]
  assert not any(c[4:5] == ["scp"] and c[6].endswith("/token") for c in commands)
  keys = [c for c in commands if any(a.endswith(":dd/dd-t/tls.key") for a in c)]
  assert len(keys) == 1 and keys[0][:4] == ["gcloud", "compute", "scp", "/certs/syncer.key"]
  syncer = next(c for c in commands if "--role=syncer" in " ".join(c))
  assert syncer[:4] == ["gcloud", "compute", "ssh", "dd-syncer"] and "JAX_PLATFORMS" not in _remote(syncer)
  assert '--config.service.tls_key="$D/tls.key"' in _remote(syncer)
  lookup = next(c for c in commands if "describe" in c)
  assert lookup[:5] == ["gcloud", "compute", "instances", "describe", "dd-syncer"]
  for learner in (c for c in commands if "--role=learner" in " ".join(c)):
    assert '--config.service.tls_ca="$D/tls.crt"' in _remote(learner)


def test_a_given_syncer_address_needs_no_lookup():
  steps = launch_tpu.plan(_options(syncer_address="10.0.0.7", port=8470, reuse=True))
  assert not any(s.captures for s in steps)
  learners = [_remote(list(s.argv)) for s in steps if "--role=learner" in " ".join(s.argv)]
  assert len(learners) == 2 and all("--syncer=10.0.0.7:8470 " in l for l in learners)


def test_a_sharded_syncer_starts_one_process_per_shard_and_learners_and_the_evaluator_dial_every_shard():
  overrides = (*OVERRIDES, "--config.service.shards=2", "--config.service.evaluate_on=evaluator")
  steps = launch_tpu.plan(
      _options(syncer_address="10.0.0.7", port=8470, reuse=True, syncer_shards=2, overrides=overrides,
               evaluator_slice=launch_tpu.parse_slices("v5p-8@us-east5-a")[0]))
  syncers = [_remote(list(s.argv)) for s in steps if "--role=syncer" in " ".join(s.argv)]
  assert len(syncers) == 2
  for shard, command in enumerate(syncers):  # Shard s binds 8470 + s and its data channel 8472 + s.
    assert f"--shard={shard} " in command and "--config.service.shards=2 " in command
    assert "--config.service.port=8470 " in command and "--config.service.data_port=8472 " in command
    assert f'"$D/syncer_{shard}.log"' in command
  learners = [_remote(list(s.argv)) for s in steps if "--role=learner" in " ".join(s.argv)]
  assert len(learners) == 2 and all("--syncer=10.0.0.7:8470,10.0.0.7:8471 " in l for l in learners)
  evaluator, = [_remote(list(s.argv)) for s in steps if "--role=evaluator" in " ".join(s.argv)]
  assert "--syncer=10.0.0.7:8470,10.0.0.7:8471 " in evaluator
  with pytest.raises(ConfigError, match=r"--port=65533 must be in \[1, 65532\]"):
    launch_tpu.check(_options(port=65533, syncer_shards=2), (16, 32))


def test_the_config_and_a_sentencepiece_model_are_shipped_to_every_host_and_processes_read_the_copies():
  overrides = (*OVERRIDES, "--config.service.evaluate_on=evaluator")
  steps = launch_tpu.plan(
      _options(tokenizer_path="/models/sp.model", overrides=overrides,
               evaluator_slice=launch_tpu.parse_slices("v5p-8@us-east5-a")[0]))
  commands = [list(s.argv) for s in steps]
  scps = [(i, c[c.index("scp") + 1], c[c.index("scp") + 2]) for i, c in enumerate(commands) if "scp" in c[2:5]]
  copies = {(local, target) for _, local, target in scps}
  for host in ("dd-t-0", "dd-t-1", "dd-t-eval", "dd-t-syncer"):
    assert ("configs/default.py", f"{host}:dd/dd-t/config.py") in copies
    assert ("/models/sp.model", f"{host}:dd/dd-t/tokenizer.model") in copies
  processes = [_remote(c) for c in commands if "experiments.train" in " ".join(c)]
  assert len(processes) == 4  # The syncer, two learners, the evaluator.
  for command in processes:
    assert '--config="$D/config.py" ' in command and '--config.data.tokenizer_path="$D/tokenizer.model" ' in command
    assert "/models/sp.model" not in command and "configs/default.py" not in command
  # The copies are made before any process starts; without a SentencePiece model none is shipped.
  first_start = next(i for i, c in enumerate(commands) if "experiments.train" in " ".join(c))
  assert max(i for i, local, _ in scps if local in ("configs/default.py", "/models/sp.model")) < first_start
  assert not any("tokenizer" in " ".join(s.argv) for s in launch_tpu.plan(_options()))


def test_xpk_pods_fetch_the_shipped_files_from_the_bucket():
  options = _options(xpk_cluster="dd", token_secret="dd-token", token_file="", tokenizer_path="/models/sp.model",
                     slices=tuple(launch_tpu.parse_slices("v5p-32@us-east5-a,v6e-32@us-east1-d")))
  commands = [list(s.argv) for s in launch_tpu.plan(options, "start")]
  published = [c[3:] for c in commands if c[:3] == ["gcloud", "storage", "cp"] and "launch/" in c[4]]
  assert published == [["configs/default.py", "gs://proj-decoupled-diloco/dd-t/launch/config.py"],
                       ["/models/sp.model", "gs://proj-decoupled-diloco/dd-t/launch/tokenizer.model"]]
  for workload in (c for c in commands if c[:3] == ["xpk", "workload", "create"]):
    pod = _remote(workload)
    assert "gcloud storage cp gs://proj-decoupled-diloco/dd-t/launch/config.py /tmp/dd/config.py; " in pod
    assert '--config="/tmp/dd/config.py" ' in pod and '--config.data.tokenizer_path="/tmp/dd/tokenizer.model" ' in pod


@pytest.mark.slow
def test_the_dry_runs_printed_in_docs_launch_md_are_what_the_tool_prints():
  text = pathlib.Path(docs.DOC).read_text(encoding="utf-8")
  regenerated, stale = docs.regenerate(text)
  assert stale == [] and regenerated == text, "run python -m experiments.launch.docs"
  assert sum(bool(docs.MARKER.match(line)) for line in text.splitlines()) == 2  # up's and start's.
  with pytest.raises(ValueError, match="shows `python -m experiments.launch_tpu up --config=configs/tpu_1b.py"):
    docs.regenerate(text.replace("--run_name=dd-1b --spot --dry_run", "--run_name=dd-1b --dry_run", 1))


@pytest.mark.slow
def test_the_cli_ships_the_configs_sentencepiece_model_and_points_every_process_at_the_copy(tmp_path):
  from decoupled_diloco.data import tokenizer  # pylint: disable=import-outside-toplevel
  text = tmp_path / "text.txt"
  text.write_text(" ".join(f"word{i % 97} thing{i % 13}." for i in range(4000)))
  model = tokenizer.train_sentencepiece(str(text), 300, str(tmp_path / "sp.model"))
  result = _dry_run(*OVERRIDES, f"--slices={SLICES}", "--project=proj", "--run_name=dd-t", "--reuse",
                    "--config.data.source=text_file", f"--config.data.path={text}",
                    "--config.data.tokenizer=sentencepiece", f"--config.data.tokenizer_path={model}")
  assert result.returncode == 0, result.stderr
  commands = _commands(result.stdout)
  copies = [c for c in commands if "scp" in c[2:5] and c[c.index("scp") + 1] == model]
  assert [c[c.index("scp") + 2] for c in copies
         ] == [f"{host}:dd/dd-t/tokenizer.model" for host in ("dd-t-0", "dd-t-1", "dd-t-syncer")]
  processes = [_remote(c) for c in commands if "experiments.train" in " ".join(c)]
  # After the overrides (which name this machine's model), so the shipped copy is what each process loads.
  assert len(processes) == 3
  assert all('--config.data.tokenizer_path="$D/tokenizer.model" --workdir=' in p for p in processes)

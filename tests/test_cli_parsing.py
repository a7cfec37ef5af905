"""experiments/cli.py's flag parsing: `--help` exits 0 in every entry point; an unknown flag is one `error:` line.

The entry points are spawned as a user types them: each exits while parsing its flags, before
anything heavy is imported, so the whole file takes seconds.
"""

import pathlib
import subprocess
import sys

import pytest

from experiments import cli

REPO = pathlib.Path(__file__).parents[1]
ENTRY_POINTS = ("train", "launch_local", "sweep", "plan", "launch_tpu", "report", "prepare_data", "train_tokenizer",
                "notebooks")


def _run(entry_point: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", f"experiments.{entry_point}", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=300)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_help_exits_0_and_prints_usage(entry_point):
  result = _run(entry_point, "--help")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Try --helpfull to get a list of all flags." in result.stdout
  assert "error:" not in result.stderr


def test_helpfull_exits_0_even_beside_other_flags():
  result = _run("train", "--config=configs/demo.py", "--helpfull")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "--workdir" in result.stdout and "absl.logging" in result.stdout


def _refused(result: subprocess.CompletedProcess) -> str:
  """The one `error:` line of a refused command (exit 2, no traceback)."""
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  return errors[0]


@pytest.mark.parametrize("args, override", [
    (["--outer_steps=3"], "--config.outer_steps=3"),
    (["--config=configs/hetero_v5p_v6e.py", "--outer.lr", "0.5"], "--config.outer.lr=VALUE"),])
def test_a_bare_config_field_names_its_config_override(args, override, tmp_path):
  line = _refused(_run("train", *args, f"--workdir={tmp_path / 'run'}"))
  assert line.startswith(f"error: unknown flag --{override[len('--config.'):].split('=')[0]}:") and override in line
  assert not (tmp_path / "run").exists()


def test_an_unknown_flag_gets_absls_suggestion_not_a_config_key_message():
  line = _refused(_run("train", "--config=configs/demo.py", "--workdr=/tmp/x"))
  assert line == "error: unknown flag --workdr: did you mean --workdir? --helpfull lists every flag"
  assert _refused(_run("report", "--outt=/tmp/x",
                       "/tmp/x")).startswith("error: unknown flag --outt: did you mean --out?")


@pytest.mark.parametrize("argv, asked", [
    (["prog", "--help"], True),
    (["prog", "-?"], True),
    (["prog", "--config=c.py", "-helpfull=true"], True),
    (["prog", "--helpxml"], True),
    (["prog", "--", "--help"], False),
    (["prog", "--nohelp"], False),
    (["prog", "help"], False),])
def test_asks_for_help(argv, asked):
  assert cli._asks_for_help(argv) == asked  # pylint: disable=protected-access

"""Sweeps: grids, names and validation in process; the CLI's runs, CSV, dry run and report as real processes."""

import csv
import importlib
import pathlib
import shlex
import subprocess
import sys

import pytest

from decoupled_diloco.research import sweep
from decoupled_diloco.errors import ConfigError
from tests.helpers import tiny_config

REPO = pathlib.Path(__file__).parents[1]
# Shrinks a printed launch command to one small learner group (compiling is most of a short run's time).
SHORTEN = [
    "--config.outer_steps=2", "--config.inner_steps=3", "--config.data.synthetic.num_tokens=50000",
    "--config.eval_batches=1", "--config.log_every=2", "--config.model.d_model=32", "--config.model.num_layers=1",
    "--config.model.d_ff=64", "--config.model.seq_len=16", "--config.learners.devices=(2,)",
    "--config.learners.batch_size=(4,)", "--config.eval_batch_size=8"]
# A sweep over the tests' tiny config; {points} is get_sweep()'s body.
CONFIG_FILE = '''
from decoupled_diloco.research import sweep
from tests import helpers

def get_config():
  return helpers.tiny_config(outer_steps=2, inner_steps=3, checkpoint_every=1)

def get_sweep():
  return {points}
'''
TWO_POINTS = '[{"outer.lr": 0.5}, {"mode": "decoupled", "runtime": "sim"}]'


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def _config_file(tmp_path: pathlib.Path, points: str) -> str:
  path = tmp_path / "sweep_config.py"
  path.write_text(CONFIG_FILE.format(points=points))
  return str(path)


def test_product_and_zip_():
  assert sweep.product(**{"outer.lr": [0.5, 1.0], "inner_steps": [10, 50]}) == [{"outer.lr": 0.5, "inner_steps": 10},
                                                                                {"outer.lr": 0.5, "inner_steps": 50},
                                                                                {"outer.lr": 1.0, "inner_steps": 10},
                                                                                {"outer.lr": 1.0, "inner_steps": 50}]
  steps = sweep.zip_(**{"inner_steps": [10, 50], "outer_steps": [50, 10]})
  assert steps == [{"inner_steps": 10, "outer_steps": 50}, {"inner_steps": 50, "outer_steps": 10}]
  assert sweep.product(steps, **{"outer.lr": [0.5, 1.0]})[1] == {"inner_steps": 10, "outer_steps": 50, "outer.lr": 1.0}


@pytest.mark.parametrize("make, message", [
    (lambda: sweep.product(**{"outer.lr": []}), "sweep axis 'outer.lr' is empty"),
    (lambda: sweep.product(), "needs at least one axis"),
    (lambda: sweep.product(**{"outer.lr": 0.5}), "must be a list of values"),
    (lambda: sweep.zip_(**{"inner_steps": [1, 2], "outer.lr": [0.5]}), "differ in length"),])
def test_bad_grids_are_config_errors(make, message):
  with pytest.raises(ConfigError, match=message):
    make()


def test_point_names_are_readable_and_filesystem_safe():
  assert sweep.point_name({"outer.lr": 0.5, "inner_steps": 10}) == "outer.lr=0.5,inner_steps=10"
  assert sweep.point_name({"learners.speed": (2.0, 1.0),
                           "data.path": "a b/c.txt"}) == ("learners.speed=2.0-1.0,data.path=a_b_c.txt")
  assert sweep.point_name({}) == "base"
  long_a, long_b = (sweep.point_name({"data.path": "x" * 200 + tail}) for tail in "ab")
  assert len(long_a) == sweep.MAX_NAME and long_a != long_b


def test_expand_derives_validated_configs_without_touching_the_base():
  base = tiny_config()
  points = sweep.expand(base, [{"outer.lr": 1, "learners.speed": [2.0, 1.0]}, {}])
  assert [p.name for p in points] == ["outer.lr=1.0,learners.speed=2.0-1.0", "base"]
  assert points[0].config.outer.lr == 1.0 and points[0].overrides["learners.speed"] == (2.0, 1.0)
  assert base.outer.lr == 0.7 and base.learners.speed == ()


@pytest.mark.parametrize("points, message", [
    ([{"outer.lrr": 0.5}], "sweep point 1 of 1: unknown config key 'outer.lrr': fix get_sweep() (keys are config "
     'fields). Did you mean "outer.lr"?'),
    ([{"outer.lr": 0.5}, {"outer.lr": "fast"}], "sweep point 2 of 2: outer.lr='fast' is a str but the field holds a "
     "float (0.7): give a float"),
    ([{"inner_steps": True}], "inner_steps=True is a bool but the field holds a int"),
    ([{"outer": 0.5}], "'outer' is a group of fields: override a leaf such as 'outer."),
    ([{"inner_steps": 0}], "sweep point 1 of 1 (inner_steps=0): inner_steps (H) = 0 must be >= 1"),
    ([{"outer.lr": 0.5}, {"outer.lr": 0.5}], "repeats point 1"),
    ([{"runtime": "service"}], "runtime='service' runs as several processes, which a sweep does not start"),
    ([], "get_sweep() returned no points"),
    ({"outer.lr": 0.5}, "returned a dict: return a list of override dicts"),
    (["outer.lr=0.5"], "is 'outer.lr=0.5', not a dict of overrides"),])
def test_expand_rejects_bad_points_with_one_line(points, message):
  with pytest.raises(ConfigError) as error:
    sweep.expand(tiny_config(), points)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_load_sweep_needs_a_get_sweep():
  assert sweep.load_sweep("configs/hetero_v5p_v6e.py")[0] == {"syncer.staleness": "constant"}
  with pytest.raises(ConfigError, match="configs/demo.py defines no get_sweep"):
    sweep.load_sweep("configs/demo.py")


@pytest.mark.parametrize("name", ["diloco_sync", "hetero_v5p_v6e"])
def test_shipped_sweeps_validate(name):
  module = importlib.import_module(f"configs.{name}")
  points = sweep.expand(module.get_config(), module.get_sweep())
  assert len({p.name for p in points}) == len(points) > 1
  assert f"python -m experiments.sweep --config=configs/{name}.py" in module.__doc__


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
  """A two-point sweep (one lockstep point, one on the virtual clock) run by the CLI."""
  tmp_path = tmp_path_factory.mktemp("sweep")
  result = _run("experiments.sweep", f"--config={_config_file(tmp_path, TWO_POINTS)}",
                f"--workdir={tmp_path / 'sweep'}", "--config.eval_batches=1")
  return tmp_path / "sweep", result


@pytest.mark.slow
def test_two_point_sweep_runs_and_writes_one_csv_row_per_point(swept):
  root, result = swept
  assert result.returncode == 0, result.stderr[-3000:]
  assert "sweep [##########..........] 1/2 | running mode=decoupled,runtime=sim" in result.stderr
  with open(root / "results.csv", newline="") as f:
    rows = list(csv.DictReader(f))
  assert [r["name"] for r in rows] == ["outer.lr=0.5", "mode=decoupled,runtime=sim"]
  assert [(r["outer.lr"], r["mode"], r["runtime"]) for r in rows] == [("0.5", "", ""), ("", "decoupled", "sim")]
  for row in rows:
    assert row["status"] == "ok" and float(row["eval_loss"]) > 0 and int(row["tokens"]) > 0
    assert (root / row["name"] / "metrics.jsonl").exists() and (root / row["name"] / "tensorboard").is_dir()
  assert rows[0]["goodput"] == "" and 0 < float(rows[1]["goodput"]) <= 1 and float(rows[1]["virtual_seconds"]) > 0
  assert f"results: {root}/results.csv" in result.stdout and "| outer.lr=0.5 |" in result.stdout


@pytest.mark.slow
def test_rerun_reuses_finished_points(swept):
  root, _ = swept
  before = (root / "results.csv").read_text()
  again = _run("experiments.sweep", f"--config={root.parent / 'sweep_config.py'}", f"--workdir={root}",
               "--config.eval_batches=1")
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stderr.count("already finished") == 2
  assert (root / "results.csv").read_text() == before


@pytest.mark.slow
def test_report_on_the_sweep_writes_plots_and_table(swept):
  root, _ = swept
  result = _run("experiments.report", str(root))
  assert result.returncode == 0, result.stderr[-3000:]
  names = ["loss_vs_tokens", "loss_vs_wall_time", "loss_vs_virtual_time", "utilization", "staleness"]
  for name in names:
    assert (root / "report" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert f"![{name}]({name}.png)" in (root / "report" / "report.md").read_text()
  table = (root / "report" / "report.md").read_text()
  assert table.index("| outer.lr=0.5 |") < table.index("| mode=decoupled,runtime=sim |")  # The sweep's order.


@pytest.mark.slow
def test_dry_run_prints_one_valid_command_per_point(tmp_path):
  root = tmp_path / "dry"
  result = _run("experiments.sweep", "--config=configs/diloco_sync.py", f"--workdir={root}", "--dry_run",
                "--config.eval_batches=1", "--config.outer.lr=0.1")
  assert result.returncode == 0, result.stderr[-3000:]
  commands = result.stdout.splitlines()
  assert len(commands) == 9 and not root.exists()
  # Command-line overrides apply to every point, except where the point sets the key itself.
  assert commands[0] == (f"python -m experiments.train --config=configs/diloco_sync.py "
                         f"--workdir={root}/inner_steps=10,outer_steps=75,outer.lr=0.5 --config.eval_batches=1 "
                         "--config.inner_steps=10 --config.outer_steps=75 --config.outer.lr=0.5")
  args = shlex.split(commands[-1])
  assert args[:3] == ["python", "-m", "experiments.train"]
  workdir = tmp_path / "point"
  args = [f"--workdir={workdir}" if a.startswith("--workdir=") else a for a in args[3:]]
  trained = _run("experiments.train", *args, *SHORTEN)  # Shortening flags come last and win.
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert "final eval loss" in trained.stdout and (workdir / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("points, message", [
    ('[{"outer.lr": 0.5}, {"outer.lrr": 1.0}]', "sweep point 2 of 2: unknown config key 'outer.lrr'"),
    ('sweep.product(**{"outer.lr": [0.5], "inner_steps": []})', "sweep axis 'inner_steps' is empty"),
    ('[{"outer.lr": 0.5}, {"learners.batch_size": (3, 4)}]', "sweep point 2 of 2 (learners.batch_size=3-4): "
     "learner group 0: batch_size 3 is not divisible"),])
def test_bad_sweep_fails_with_one_line_before_any_run(points, message, tmp_path):
  root = tmp_path / "sweep"
  result = _run("experiments.sweep", f"--config={_config_file(tmp_path, points)}", f"--workdir={root}")
  assert result.returncode == 2
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
  assert "Traceback" not in result.stderr
  assert not root.exists()

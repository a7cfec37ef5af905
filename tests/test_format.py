"""The tree is formatted as `bash .ci/format` formats it (yapf, pyproject.toml's [tool.yapf])."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_format(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
  """`bash .ci/format ARGS` on the tree at `root`, run with this interpreter's yapf."""
  return subprocess.run(["bash", str(root / ".ci" / "format"), *args], cwd=root, capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, check=False)


@pytest.mark.slow  # yapf over ~200 files: about 20 CPU seconds.
def test_every_python_file_is_formatted():
  result = run_format(ROOT, "--check")
  assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_names_an_unformatted_file_and_the_formatter_fixes_it(tmp_path):
  for name in (".ci", "pyproject.toml"):
    subprocess.run(["cp", "-r", str(ROOT / name), str(tmp_path)], check=True)
  for folder in ("configs", "decoupled_diloco", "experiments", "tests"):
    (tmp_path / folder).mkdir()
  (tmp_path / "setup.py").write_text("x = 1\n")
  (tmp_path / "tests" / "good.py").write_text('def f(a, b):\n  return {"a": a, "b": b}\n')
  (tmp_path / "decoupled_diloco" / "bad.py").write_text('def f( a,b ):\n    return {"a":a,\n  "b":b}\n')
  result = run_format(tmp_path, "--check")
  assert result.returncode == 1 and result.stdout.split() == [
      "not", "formatted", "(run:", "bash", ".ci/format):", "decoupled_diloco/bad.py"], result.stdout
  assert run_format(tmp_path).returncode == 0
  assert (tmp_path / "decoupled_diloco" / "bad.py").read_text() == 'def f(a, b):\n  return {"a": a, "b": b}\n'
  assert run_format(tmp_path, "--check").returncode == 0

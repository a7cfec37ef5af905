"""Every notebook in colabs/ runs top to bottom in a real kernel, at the CI size, and draws its plots.

Why execute them: the notebooks are what researchers open first, and nothing else calls
their cells, so an API change they missed would only surface in front of a reader. Each
runs with DD_NOTEBOOK_SIZE=ci, which shrinks every run to about a minute, and TMPDIR set to
one directory per test session: the notebooks make their workdirs there with mkdtemp and
share JAX's compilation cache (tempdir/dd_jax_cache), so shapes compiled by one are not
compiled again by the next. One test per notebook, so pytest-xdist spreads them over its
workers.
"""

import json
import os
import pathlib
import sys

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
import nbclient
import nbformat
import pytest

# Executes each notebook in a kernel: the fast subset leaves them out.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "colabs").glob("*.ipynb"))
CELL_TIMEOUT_SECONDS = 600


def _kernel_manager(directory: pathlib.Path) -> KernelManager:
  """A kernel on this interpreter (sys.executable), whatever kernelspecs the machine has installed."""
  spec = directory / "kernels" / "dd_python"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(
      json.dumps({
          "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
          "display_name": "decoupled_diloco", "language": "python"}))
  return KernelManager(kernel_name="dd_python", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))


def _outputs(notebook) -> list[dict]:
  return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 4, f"expected the notebooks in {REPO / 'colabs'}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  assert not _outputs(notebook), f"{path.name} has outputs: clear them before committing"
  assert all(cell.get("execution_count") is None for cell in notebook.cells if cell.cell_type == "code")


@pytest.fixture(scope="session")
def notebook_tempdir(tmp_path_factory):
  return tmp_path_factory.mktemp("notebooks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_plots(path, tmp_path, monkeypatch, notebook_tempdir):
  monkeypatch.setenv("DD_NOTEBOOK_SIZE", "ci")
  monkeypatch.setenv("TMPDIR", str(notebook_tempdir))
  # The checkout's package, whether or not it is pip-installed in this environment.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, km=_kernel_manager(tmp_path), timeout=CELL_TIMEOUT_SECONDS,
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # Raises CellExecutionError, with the cell and its traceback, if any cell fails.
  outputs = _outputs(notebook)
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"

"""Every notebook in colabs/ is stored with its outputs, and runs top to bottom in a real kernel at the CI size.

Why both: the repository is where most readers first see a notebook, so the stored copy must
show its plots (`python -m experiments.notebooks` regenerates them); and nothing else calls the
cells, so an API change they missed would only surface in front of a reader. The executed copy
is never written back: the run here checks the code, the stored outputs are what a reader sees.
One test per notebook, so pytest-xdist spreads them over its workers; they share one TMPDIR, so
JAX's compilation cache (TMPDIR/dd_jax_cache) compiles each shape once.
"""

import nbformat
import pytest

from experiments import notebooks

NOTEBOOKS = notebooks.notebook_paths()
STORED_BYTES = 3_000_000  # All of colabs/: the plots are PNGs at a modest dpi.


def _outputs(notebook) -> list[dict]:
  return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def test_there_are_notebooks_and_they_stay_small():
  assert len(NOTEBOOKS) >= 4, f"expected the notebooks in {notebooks.NOTEBOOK_DIR}"
  assert sum(path.stat().st_size for path in notebooks.NOTEBOOK_DIR.iterdir()) < STORED_BYTES


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_notebook_has_its_outputs(path):
  """Stored as one top-to-bottom run left it: every code cell executed in order, plots, no error."""
  notebook = nbformat.read(path, as_version=4)
  nbformat.validate(notebook)
  code = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert [cell.execution_count for cell in code] == list(range(
      1,
      len(code) + 1)), (f"{path.name} is not stored as one run: python -m experiments.notebooks {path.stem}")
  outputs = _outputs(notebook)
  assert not [o for o in outputs if o.output_type == "error"], f"{path.name} is stored with an error"
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} is stored without a plot"


@pytest.fixture(scope="session")
def notebook_tempdir(tmp_path_factory):
  return tmp_path_factory.mktemp("notebooks")


@pytest.mark.slow  # Executes the notebook in a kernel: the fast subset leaves it out.
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_plots(path, notebook_tempdir):
  stored = path.read_bytes()
  notebook = nbformat.reads(stored.decode(), as_version=4)
  for cell in notebook.cells:  # Start from no outputs, so that every output checked below is this run's.
    if cell.cell_type == "code":
      cell.outputs, cell.execution_count = [], None
  notebooks.execute(notebook, "ci", notebook_tempdir)  # Raises CellExecutionError, with the cell, if one fails.
  outputs = _outputs(notebook)
  assert not [o for o in outputs if o.output_type == "error"]
  assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
  assert path.read_bytes() == stored, f"executing {path.name} rewrote the stored notebook"

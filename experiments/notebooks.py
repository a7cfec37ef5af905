r"""Executes the notebooks in colabs/ in place, so that the repository shows them with their outputs.

  python -m experiments.notebooks                            # every notebook at the CI size (~8 min on 2 cores)
  python -m experiments.notebooks --size=full 03_asynchrony  # one notebook at full size

Each notebook runs top to bottom in a fresh kernel of this interpreter, from this checkout (so
its setup cell installs nothing), with DD_NOTEBOOK_SIZE=--size; the stored notebook then holds
the outputs, its plots as PNGs at --dpi so that colabs/ stays small. A cell that fails stops
the command and leaves that notebook as it was. tests/test_notebooks.py executes the same way,
on copies, at the CI size, and checks that the stored notebooks hold their outputs.
"""

import json
import os
import pathlib
import sys
import tempfile
import time

from absl import app
from absl import flags

from experiments import cli

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "colabs"
SIZES = ("ci", "full")  # DD_NOTEBOOK_SIZE: ci shrinks every run to about a minute.
CELL_TIMEOUT_SECONDS = 1800

_SIZE = flags.DEFINE_enum("size", "ci", SIZES, "DD_NOTEBOOK_SIZE the notebooks run at.")
_DPI = flags.DEFINE_integer("dpi", 80, "Resolution of the stored plots (matplotlib's figure.dpi).")


def notebook_paths(names: list[str] = ()) -> list[pathlib.Path]:
  """colabs/*.ipynb, or those named (with or without .ipynb), in name order."""
  paths = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
  wanted = {name.removesuffix(".ipynb") for name in names}
  unknown = wanted - {path.stem for path in paths}
  if unknown:
    cli.fail(f"no notebook {', '.join(sorted(unknown))} in colabs/: pick from {', '.join(p.stem for p in paths)}")
  return [path for path in paths if not wanted or path.stem in wanted]


def _kernel_manager(directory: pathlib.Path):
  """A kernel on this interpreter (sys.executable), whatever kernelspecs the machine has installed."""
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
  from jupyter_client.manager import KernelManager  # pylint: disable=g-import-not-at-top
  spec = directory / "kernels" / "dd_python"
  spec.mkdir(parents=True, exist_ok=True)
  (spec / "kernel.json").write_text(
      json.dumps({
          "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
          "display_name": "decoupled_diloco", "language": "python"}))
  return KernelManager(kernel_name="dd_python", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))


def execute(notebook, size: str, directory: pathlib.Path, dpi: int = 80) -> None:
  """Runs `notebook` (an nbformat node, filled in place) at `size` in a fresh kernel started in `directory`.

  `directory` is also the kernel's TMPDIR: the notebooks make their workdirs there and share
  JAX's compilation cache (TMPDIR/dd_jax_cache), so several notebooks run with one directory
  compile each shape once. Raises nbclient's CellExecutionError, naming the cell, if one fails.
  """
  import nbclient  # pylint: disable=g-import-not-at-top  (Jupyter is a test dependency, not the library's)
  rc = directory / "matplotlibrc"
  rc.write_text(f"figure.dpi: {dpi}\n")
  env = {
      **os.environ,
      "DD_NOTEBOOK_SIZE": size,
      "TMPDIR": str(directory),
      "MATPLOTLIBRC": str(rc),
      # The checkout's package, whether or not it is pip-installed in this environment.
      "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  client = nbclient.NotebookClient(notebook, km=_kernel_manager(directory), timeout=CELL_TIMEOUT_SECONDS,
                                   record_timing=False, resources={"metadata": {"path": str(directory)}})
  client.execute(env=env)


def main(argv: list[str]) -> None:
  """Executes each notebook named in argv (default: all) and writes it back with its outputs."""
  import nbformat  # pylint: disable=g-import-not-at-top
  paths = notebook_paths(argv[1:])
  with tempfile.TemporaryDirectory(prefix="dd_notebooks_") as directory:
    for path in paths:
      start = time.monotonic()
      notebook = nbformat.read(path, as_version=4)
      execute(notebook, _SIZE.value, pathlib.Path(directory), _DPI.value)
      nbformat.write(notebook, path)
      print(f"{path.relative_to(REPO)}: executed at size {_SIZE.value} in {time.monotonic() - start:.0f} s, "
            f"{path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

r"""Writes docs/launch.md's printed dry runs from the tool itself, so the walkthrough never shows a command the
launcher no longer runs (a renamed flag, another machine type):

  python -m experiments.launch.docs           # rewrites every generated block of docs/launch.md
  python -m experiments.launch.docs --check   # exit 1 naming the stale blocks (tests/test_launch_tpu.py runs this)

A generated block is the fenced block after a marker line `<!-- dry run: VERB ARGS... -->`; the
fenced block before the marker must show that same command (`python -m experiments.launch_tpu VERB
ARGS... --dry_run`). The output is the dry run's, with this machine's home written `~`, this
checkout `CHECKOUT` and this Python `python`, so it reads the same wherever it is regenerated.
"""

import os
import re
import shlex
import subprocess
import sys

from experiments.launch import options as options_lib

DOC = os.path.join(options_lib.repo(), "docs", "launch.md")
MARKER = re.compile(r"^<!-- dry run: (.+) -->$")


def dry_run(args: list[str]) -> str:
  """What `launch_tpu ARGS --dry_run` prints, in the docs' spelling of this machine's paths."""
  env = dict(os.environ, TMPDIR="/tmp")  # The source archive's place, as the docs show it.
  result = subprocess.run([sys.executable, "-m", "experiments.launch_tpu", *args, "--dry_run"], cwd=options_lib.repo(),
                          capture_output=True, text=True, check=False, env=env)
  if result.returncode:
    raise RuntimeError(f"launch_tpu {shlex.join(args)} --dry_run failed: {result.stderr.strip()}")
  text = result.stdout.replace(sys.executable, "python").replace(options_lib.repo(), "CHECKOUT")
  return text.replace(f"{os.path.expanduser('~')}/", "~/")


def _fence_after(lines: list[str], start: int) -> tuple[int, int]:
  """(first line, closing line) of the first fenced block at or after `start`."""
  opening = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
  return opening + 1, next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))


def regenerate(text: str) -> tuple[str, list[str]]:
  """`text` with every generated block replaced by the tool's output, and the markers whose block changed.
  ValueError when the command shown before a marker is not the one it generates from."""
  lines, stale, i = text.split("\n"), [], 0
  while i < len(lines):
    match = MARKER.match(lines[i])
    if match:
      args = shlex.split(match.group(1))
      shown_start, shown_end = _fence_before(lines, i)
      shown = shlex.split(" ".join(lines[shown_start:shown_end]).replace("\\ ", " "))
      if shown != ["python", "-m", "experiments.launch_tpu", *args, "--dry_run"]:
        raise ValueError(f"docs/launch.md shows `{shlex.join(shown)}` before the marker of `{match.group(1)}`")
      first, closing = _fence_after(lines, i + 1)
      output = dry_run(args).rstrip("\n").split("\n")
      if lines[first:closing] != output:
        stale.append(match.group(1))
        lines[first:closing] = output
        closing = first + len(output)
      i = closing
    i += 1
  return "\n".join(lines), stale


def _fence_before(lines: list[str], end: int) -> tuple[int, int]:
  """(first line, closing line) of the last fenced block before line `end`."""
  closing = next(i for i in range(end - 1, -1, -1) if lines[i].startswith("```"))
  return next(i for i in range(closing - 1, -1, -1) if lines[i].startswith("```")) + 1, closing


def main(argv: list[str]) -> int:
  """Rewrites docs/launch.md (or, with --check, says which blocks are stale and exits 1)."""
  with open(DOC, encoding="utf-8") as f:
    text = f.read()
  new, stale = regenerate(text)
  if "--check" in argv:
    if stale:
      sys.stderr.write(f"error: docs/launch.md's dry runs of {', '.join(stale)} are stale: run python -m "
                       "experiments.launch.docs\n")
    return 1 if stale else 0
  with open(DOC, "w", encoding="utf-8") as f:
    f.write(new)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Runs planned steps (or prints them for --dry_run): one place for how a step's command is carried out.

Captured values (the syncer's IP) are substituted into later commands; a step with `unless`
is skipped when that command succeeds; a step with `until` is repeated until it prints that.
A failing step stops the launcher with exit status 1 and the command that failed.
"""

import shlex
import subprocess
import sys
import time

from experiments.launch.hosts import SYNCER_IP, Step

POLL_SECONDS = 30.0  # Between two looks at a queued resource that is not ACTIVE yet.
POLL_LIMIT_SECONDS = 24 * 3600.0  # A queued resource not granted in a day is left to the user.


def describe(step: Step) -> list[str]:
  """The dry run's lines for `step`: what it does (and how it is skipped or repeated), then its command."""
  note = (f" (prints {step.captures})" if step.captures else "") + (f" (repeated until it prints {step.until})"
                                                                    if step.until else "")
  lines = [f"# {step.what}{note}"]
  if step.unless:
    lines.append(f"#   skipped when this succeeds: {shlex.join(step.unless)}")
  return lines + [shlex.join(step.argv)]


def dry_run(steps: list[Step]) -> None:
  """Prints every step, runs nothing."""
  for step in steps:
    print("\n".join(describe(step)))


def probe(argv: tuple[str, ...] | list[str]) -> tuple[int, str]:
  """Runs a read-only command quietly: its exit status and stdout (stripped)."""
  result = subprocess.run(list(argv), check=False, text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  return result.returncode, result.stdout.strip()


def execute(steps: list[Step], values: dict[str, str] | None = None) -> dict[str, str]:
  """Runs the steps in order; returns the captured values (SYNCER_IP, states, records)."""
  values = {} if values is None else values
  for step in steps:
    argv = [arg.replace(SYNCER_IP, values.get(SYNCER_IP, SYNCER_IP)) for arg in step.argv]
    print(f"# {step.what}", flush=True)
    if step.unless and probe(step.unless)[0] == 0:
      print("#   already done: skipped", flush=True)
      continue
    if step.until:
      _wait(step, argv)
      continue
    result = subprocess.run(argv, check=False, text=True, stdout=subprocess.PIPE if step.captures else None)
    if result.returncode:
      _stop(f"'{step.what}' failed with exit status {result.returncode}: {shlex.join(argv)}")
    if step.captures:
      values[step.captures] = result.stdout.strip()
      if not values[step.captures] and step.captures == SYNCER_IP:
        _stop(f"'{step.what}' printed nothing: is the host up? {shlex.join(argv)}")
      if step.captures == SYNCER_IP:
        print(f"# {step.captures} = {values[step.captures]}", flush=True)
  return values


def _wait(step: Step, argv: list[str]) -> None:
  deadline = time.monotonic() + POLL_LIMIT_SECONDS
  while (state := probe(argv)[1]) != step.until:
    if time.monotonic() > deadline:
      _stop(f"'{step.what}': still {state!r} after {POLL_LIMIT_SECONDS / 3600:.0f} h: {shlex.join(argv)}")
    print(f"#   {state or 'not there yet'}; looking again in {POLL_SECONDS:.0f} s", flush=True)
    time.sleep(POLL_SECONDS)


def _stop(message: str) -> None:
  sys.stderr.write(f"error: {message}\n")
  sys.exit(1)

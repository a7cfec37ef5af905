"""Sweeps: a config file's `get_sweep()` points, all validated up front, named, run or printed.

A point is a dict of dotted-key overrides ({'outer.lr': 0.5, 'inner_steps': 10}) applied to
the file's `get_config()` as `--config.outer.lr=0.5 --config.inner_steps=10` would be. A
sweep is a list of points; `product` and `zip_` write grids:

  def get_sweep():
    return sweep.product(**{"outer.lr": [0.5, 0.7, 1.0], "inner_steps": [10, 25]})

Every point is checked (the key exists, the value's type fits the field, the derived
config passes experiment.validate) before anything runs, so a typo in point 9 costs one
error line rather than eight finished runs and a crash. Each point runs in
`<root>/<name>`, its name spelled from its overrides (`outer.lr=0.5,inner_steps=10`), so
`ls`, TensorBoard's run list and the results CSV all read the same. `run_sweep` trains
the points one after another in this process and collects `<root>/results.csv`;
`launch_command` spells one point as an `experiments.train` command instead.
"""

from collections.abc import Iterable, Mapping
import copy
import csv
import dataclasses
import difflib
import hashlib
import importlib.util
import io
import itertools
import json
import os
import re
import shlex
import time
from typing import Any

from absl import logging
import ml_collections
import numpy as np

from decoupled_diloco import experiment, metrics, storage
from decoupled_diloco.research import report
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import lockstep, sim, threads

MAX_NAME = 120  # Characters of a point's directory name; longer names end in a hash.
RESULTS_FILE = "results.csv"  # One row per point, in the sweep's root.
POINT_FILE = "sweep_point.json"  # In a point's workdir once it finished: its config and result row.
# Runtimes that train a whole run in one process (a sweep point, or one experiments.train command).
RUNTIMES = {"lockstep": lockstep, "sim": sim, "threads": threads}


@dataclasses.dataclass(frozen=True)
class Point:
  """One run of a sweep: its directory name, its overrides and the config they derive."""
  name: str
  overrides: dict[str, Any]  # Dotted key -> value as the config field holds it.
  config: ml_collections.ConfigDict


def _axes(axes: dict, helper: str) -> dict[str, list]:
  """The axes as lists; a grid with no axis or an empty axis has no points, which is a mistake."""
  if not axes:
    raise ConfigError(f"{helper}() needs at least one axis, e.g. {helper}(**{{'outer.lr': [0.5, 1.0]}})")
  lists = {}
  for key, values in axes.items():
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
      raise ConfigError(f"sweep axis {key!r} must be a list of values, got {values!r}: write [{values!r}]")
    lists[key] = list(values)
    if not lists[key]:
      raise ConfigError(f"sweep axis {key!r} is empty: give it at least one value")
  return lists


def product(*sweeps: list[dict], **axes) -> list[dict]:
  """Every combination of the axes' values (and of the given sweeps' points): an ablation grid.

  product(**{'outer.lr': [0.5, 1.0], 'inner_steps': [10, 50]}) -> 4 points, the last axis
  varying fastest; product(zip_(...), **{'outer.lr': [...]}) crosses a zipped sweep with
  an axis. Keyword axes with dotted keys read like the --config.* flags they stand for.
  """
  for points in sweeps:
    if not isinstance(points, (list, tuple)) or not points or not all(isinstance(p, Mapping) for p in points):
      raise ConfigError(f"product() takes sweeps (non-empty lists of override dicts) before its axes, got {points!r}")
  factors = [list(points) for points in sweeps]
  if axes or not sweeps:
    factors += [[{key: value} for value in values] for key, values in _axes(axes, "product").items()]
  return [{k: v for point in combination for k, v in point.items()} for combination in itertools.product(*factors)]


def zip_(**axes) -> list[dict]:
  """The i-th value of every axis together: knobs that move in step (H with the lr it needs).

  zip_(**{'inner_steps': [10, 50], 'outer.lr': [0.5, 0.9]}) -> 2 points. Combine sweeps
  with `+` (one after the other).
  """
  lists = _axes(axes, "zip_")
  lengths = {key: len(values) for key, values in lists.items()}
  if len(set(lengths.values())) > 1:
    raise ConfigError(f"zip_ axes differ in length {lengths}: give every axis the same number of values")
  return [dict(zip(lists, values)) for values in zip(*lists.values())]


def _name_value(value) -> str:
  if isinstance(value, (tuple, list)):
    return "-".join(_name_value(v) for v in value)
  return str(value)


def point_name(overrides: Mapping[str, Any]) -> str:
  """'outer.lr=0.5,inner_steps=10': readable in `ls` and TensorBoard, safe as a directory name.

  Characters other than letters, digits and `._=,+-` become `_`; names longer than
  MAX_NAME keep their start and end in a hash of the whole, so they stay unique.
  """
  if not overrides:
    return "base"
  text = ",".join(f"{key}={_name_value(value)}" for key, value in overrides.items())
  safe = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
  if len(safe) > MAX_NAME:
    safe = f"{safe[:MAX_NAME - 9]}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
  return safe


def flag_value(value) -> str:
  """The text `--config.key=<text>` must carry for config_flags to parse back `value`."""
  if isinstance(value, str):
    return value
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return repr(value)


def _override(config, key, value, where: str):
  """Sets one dotted key on `config` in place; returns the value as the field now holds it."""
  if not isinstance(key, str) or not key:
    raise ConfigError(f"{where}: override key {key!r} is not a dotted config key like 'outer.lr'")
  node, path = config, key.split(".")
  for depth, part in enumerate(path):
    fields = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
    if part not in fields:
      close = difflib.get_close_matches(part, fields, n=1)
      hint = f' Did you mean "{".".join(path[:depth] + close)}"?' if close else ""
      raise ConfigError(f"{where}: unknown config key {key!r}: fix get_sweep() (keys are config fields).{hint}")
    if depth < len(path) - 1:
      node = node[part]
  old = node[path[-1]]
  if isinstance(old, ml_collections.ConfigDict):
    raise ConfigError(f"{where}: {key!r} is a group of fields: override a leaf such as '{key}.{next(iter(old))}'")
  value = value.item() if isinstance(value, np.generic) else value
  mismatch = ConfigError(f"{where}: {key}={value!r} is a {type(value).__name__} but the field holds a "
                         f"{type(old).__name__} ({old!r}): give a {type(old).__name__}")
  if isinstance(value, bool) != isinstance(old, bool) and isinstance(old, (int, float)):
    raise mismatch  # ConfigDict itself would store True in an int or float field.
  try:
    node[path[-1]] = value
  except TypeError:
    raise mismatch from None
  return node[path[-1]]


def expand(config, points) -> list[Point]:
  """Validates every point against `config` and returns them named, or raises ConfigError.

  `config` is not modified (each point derives from a copy), so the same base serves
  every point, including overrides given on the sweep's command line.
  """
  if not isinstance(points, (list, tuple)):
    raise ConfigError(f"get_sweep() returned a {type(points).__name__}: return a list of override dicts "
                      "or sweep.product(...) / sweep.zip_(...)")
  if not points:
    raise ConfigError("get_sweep() returned no points: return at least one override dict")
  expanded, seen = [], {}
  for index, overrides in enumerate(points):
    where = f"sweep point {index + 1} of {len(points)}"
    if not isinstance(overrides, Mapping):
      raise ConfigError(f"{where} is {overrides!r}, not a dict of overrides like {{'outer.lr': 0.5}}")
    derived = copy.deepcopy(config)
    held = {key: _override(derived, key, value, where) for key, value in overrides.items()}
    name = point_name(held)
    try:
      experiment.validate(derived)
      if derived.runtime not in RUNTIMES:
        raise ConfigError(f"runtime={derived.runtime!r} runs as several processes, which a sweep does not start: "
                          f"sweep with one of {tuple(RUNTIMES)}")
    except ConfigError as error:
      raise ConfigError(f"{where} ({name}): {error}") from None
    if name in seen:
      raise ConfigError(f"{where} ({name}) repeats point {seen[name] + 1}: make every point's overrides differ")
    seen[name] = index
    expanded.append(Point(name, held, derived))
  return expanded


def load_sweep(config_file: str) -> list:
  """The points of a config file's get_sweep(), importing the file as config_flags does.

  Why import it again: config_flags keeps only get_config()'s result, not the module.
  """
  spec = importlib.util.spec_from_file_location("_sweep_config", config_file)
  if spec is None or not os.path.isfile(config_file):
    raise ConfigError(f"cannot load sweep config {config_file!r}: pass an existing configs/*.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_sweep"):
    raise ConfigError(f"{config_file} defines no get_sweep(): add one returning a list of override dicts "
                      "or decoupled_diloco.research.sweep.product(...)")
  return module.get_sweep()


def launch_command(config_file: str, workdir: str, overrides: Mapping[str, Any]) -> str:
  """The shell command that trains one point: what a Cloud TPU VM (or any shell) runs."""
  args = ["python", "-m", "experiments.train", f"--config={config_file}", f"--workdir={workdir}"]
  args += [f"--config.{key}={flag_value(value)}" for key, value in overrides.items()]
  return shlex.join(args)


def progress_bar(done: int, total: int, width: int = 20) -> str:
  """'[#####...............] 1/4': where a sequential sweep stands, for a log line."""
  filled = round(width * done / total) if total else width
  return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def run_point(point: Point, workdir: str) -> dict:
  """Trains one point in `workdir` as experiments.train would; returns its summary figures and its status:
  'diverged' (recorded, and the sweep goes on) or 'ok'."""
  exp = experiment.build(point.config)
  summary = RUNTIMES[point.config.runtime].run(exp, workdir)
  figures = report.summarize_run(metrics.read_metrics(storage.path(workdir) / metrics.METRICS_FILE))
  return {**figures, "status": "diverged" if summary.get("diverged") else "ok"}


def _finished_row(point: Point, workdir: str) -> dict | None:
  """The stored result of an earlier run of exactly this point's config, if it finished."""
  path = storage.path(workdir) / POINT_FILE
  if not path.exists():
    return None
  stored = json.loads(path.read_text(encoding="utf-8"))
  return stored["row"] if stored["config"] == point.config.to_json(sort_keys=True) else None


def _run_row(point: Point, workdir: str) -> dict:
  """Runs the point; a ConfigError (e.g. its workdir holds another run) fails it, not the sweep."""
  begin = time.time()
  try:
    row = {"status": "ok", **run_point(point, workdir)}
  except ConfigError as error:
    logging.error("sweep point %s failed: %s", point.name, error)
    return {"status": "failed", "error": str(error), "seconds": round(time.time() - begin, 1)}
  row["seconds"] = round(time.time() - begin, 1)
  storage.replace_text(
      storage.path(workdir) / POINT_FILE,
      json.dumps({"config": point.config.to_json(sort_keys=True), "row": row}, indent=1))
  return row


def write_results(path: str, points: list[Point], rows: dict[str, dict]) -> None:
  """results.csv: one row per point (its overrides, status and summary figures), atomically."""
  keys = list(dict.fromkeys(key for point in points for key in point.overrides))
  columns = ["name", *keys, "status", *report.SUMMARY_FIELDS, "seconds", "error"]
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, columns, extrasaction="ignore")
  writer.writeheader()
  for point in points:
    row = {"name": point.name, **{k: flag_value(v) for k, v in point.overrides.items()}, **rows[point.name]}
    writer.writerow({k: "" if v is None else v for k, v in row.items()})
  storage.replace_text(path, text.getvalue())


def run_sweep(points: list[Point], root: str) -> list[dict]:
  """Runs the points one after another in root/<name>; returns one result row per point.

  results.csv is rewritten after every point, so an interrupted sweep keeps what finished,
  and a rerun reuses every point whose workdir holds a finished run of the same config.
  """
  root = storage.makedirs(root)
  rows = {point.name: {"status": "pending"} for point in points}
  begin = time.time()
  for index, point in enumerate(points):
    elapsed = time.time() - begin
    eta = f" | eta {metrics.format_duration(elapsed / index * (len(points) - index))}" if index else ""
    logging.info("sweep %s | running %s | elapsed %s%s", progress_bar(index, len(points)), point.name,
                 metrics.format_duration(elapsed), eta)
    workdir = os.fspath(root / point.name)
    finished = _finished_row(point, workdir)
    if finished is not None:
      logging.info("sweep point %s already finished in %s: reusing its result", point.name, workdir)
    rows[point.name] = finished or _run_row(point, workdir)
    write_results(os.fspath(root / RESULTS_FILE), points, rows)
  logging.info("sweep %s | done in %s", progress_bar(len(points), len(points)),
               metrics.format_duration(time.time() - begin))
  return [rows[point.name] for point in points]

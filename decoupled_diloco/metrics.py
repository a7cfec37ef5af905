"""Run outputs: metrics.jsonl (the source of truth), TensorBoard scalars, progress lines.

A record is a dict with a 'kind' and the 'outer_step' it belongs to (the checkpoint saved at
outer step k covers every record with outer_step <= k), so a run resumed from checkpoint k
drops the crashed run's later records and its file equals an uninterrupted run's. Every
numeric field is also a TensorBoard scalar `<kind>/<field>`, one run per learner so curves
overlay; a list of one value per learner (an outer record's `delta_norms`) goes to each learner's run. Conventions in full: docs/records.md.
"""

from __future__ import annotations

import collections
import json
import math
import numbers
import os
import time
from typing import Any

import numpy as np

from decoupled_diloco import storage
import tensorboardX  # pylint: disable=wrong-import-order  # After storage, which imports it without its GCS client.

METRICS_FILE = "metrics.jsonl"
EVALUATOR_DIR = "evaluator"  # <workdir>/evaluator/: the evaluator process's records (service.evaluate_on='evaluator').
TENSORBOARD_DIR = "tensorboard"
# A gs:// metrics.jsonl is re-uploaded whole at most this often (and by sync/close): objects cannot be appended to.
UPLOAD_SECONDS = 30.0
# Fields that locate a record rather than measure something; never plotted.
_INDEX_FIELDS = ("kind", "outer_step", "inner_step", "learner")
# List fields with one value per learner (of the record's `learners`, else 0..M-1) -> the tag's name in each
# learner's TensorBoard run: lockstep's outer records carry every learner's pseudo-gradient norm in one list.
_PER_LEARNER_FIELDS = {"delta_norms": "pseudo_gradient_norm", "weights": "merge_weight"}


def _plain(value: Any) -> Any:
  """Numpy/jax scalars and arrays as Python values, so JSON holds floats and ints."""
  if isinstance(value, dict):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, (str, bool, int, float)) or value is None:
    return value
  if hasattr(value, "__array__"):
    return np.asarray(value).tolist()
  raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON-able")


def _is_scalar(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _x_axis(record: dict) -> int:
  """The TensorBoard step of a record: its 'inner_step', else its 'outer_step'."""
  return int(record["inner_step"] if "inner_step" in record else record["outer_step"])


def _scalar_tags(record: dict) -> dict[str, float]:
  """TensorBoard tag -> value for every numeric, non-index field of `record`."""
  return {
      f"{record['kind']}/{name}": float(value) for name, value in record.items()
      if name not in _INDEX_FIELDS and _is_scalar(value)}


def _per_learner_scalars(record: dict) -> list[tuple[str, str, float]]:
  """(TensorBoard run, tag, value) for each value of a per-learner list field (_PER_LEARNER_FIELDS).

  Why: a list is no scalar, so a merge's per-learner figures would reach TensorBoard nowhere;
  in each learner's run under one tag, they overlay like `train/loss`.
  """
  scalars = []
  for field, name in _PER_LEARNER_FIELDS.items():
    values = record.get(field)
    if isinstance(values, list):
      learners = record.get("learners", range(len(values)))
      scalars += [
          (f"learner_{m}", f"{record['kind']}/{name}", float(v)) for m, v in zip(learners, values) if _is_scalar(v)]
  return scalars


def _tensorboard_run(record: dict) -> str:
  """The TensorBoard run (subdirectory of tensorboard/) a record's scalars belong to."""
  return f"learner_{record['learner']}" if "learner" in record else ""


def _integer_histogram(counts: collections.Counter) -> dict:
  """add_histogram_raw's arguments for integer counts: a unit-wide bucket centred on each value in range.

  min and max are the outer bucket edges (TensorBoard draws the first and last buckets
  from them), so a single value still shows as a bar one unit wide.
  """
  low, high = min(counts), max(counts)
  return {
      "min": low - 0.5, "max": high + 0.5, "num": sum(counts.values()), "sum": sum(s * n for s, n in counts.items()),
      "sum_squares": sum(s * s * n for s, n in counts.items()),
      "bucket_limits": [s + 0.5 for s in range(low, high + 1)],
      "bucket_counts": [counts.get(s, 0) for s in range(low, high + 1)]}


def read_metrics(path) -> list[dict]:
  """All records of a metrics.jsonl file (local or gs://), in write order."""
  return _parse(storage.path(path).read_text(encoding="utf-8"), path)


def _parse(text: str, path) -> list[dict]:
  """The records of a metrics.jsonl file's text.

  Why lenient about the last line only: a crash can cut the final write short, and
  that torn record was never acknowledged; a malformed line anywhere else is corruption.
  """
  lines = text.split("\n")
  records = []
  for index, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if index == len(lines) - 1:  # Final line without a newline: a torn write.
        break
      raise ValueError(f"{path}:{index + 1} is not a JSON record: {e}") from e
  return records


def _kept_records(path, last_outer_step: int | None, keep_records: int | None, truncating: bool) -> list[dict]:
  """The records a reopened writer keeps: all, those with outer_step <= last_outer_step, or the first
  `keep_records` (a runtime whose records do not follow outer steps). A final line without its newline
  (a crash cut it) is dropped. The file is rewritten atomically when anything is dropped, so appends
  start clean."""
  text = storage.path(path).read_text(encoding="utf-8")
  whole = text[:text.rfind("\n") + 1]
  records = _parse(whole, path)
  kept = records
  if truncating:
    kept = records[:keep_records] if keep_records is not None else [
        r for r in records if r["outer_step"] <= last_outer_step]
  if len(whole) != len(text) or len(kept) != len(records):
    storage.replace_text(path, "".join(json.dumps(record, sort_keys=True) + "\n" for record in kept))
  return kept


class MetricsWriter:
  """Appends records to `workdir/metrics.jsonl` and `workdir/tensorboard/` event files.

  `resume_from_step=None` appends to whatever is there (never destroys data, e.g. for a
  separate eval job); a run restarted without any checkpoint passes -1 to drop every
  record of the crashed attempt (outer steps are >= 0, so none is kept). `keep_records=N`
  keeps the first N records instead (the virtual clock's checkpoints count records written).
  `observer(record)` sees every record written from now on (run/monitor.py: the console and the divergence watch).
  """

  def __init__(self, workdir, resume_from_step: int | None = None, keep_records: int | None = None, observer=None):
    self.observer = observer
    directory = storage.makedirs(workdir)
    self.path = os.fspath(directory / METRICS_FILE)
    kept = []
    truncating = resume_from_step is not None or keep_records is not None
    if storage.path(self.path).exists():
      kept = _kept_records(self.path, resume_from_step, keep_records, truncating)
    self.records = len(kept)  # In the file so far: kept ones and those written since.
    self._purge_step = None
    if truncating:
      self._purge_step = max((_x_axis(r) for r in kept), default=-1) + 1
    self._file = storage.open_append(self.path, interval=UPLOAD_SECONDS)
    self._tb_dir = os.fspath(directory / TENSORBOARD_DIR)
    self._tb_runs: dict[str, tensorboardX.SummaryWriter] = {}
    self._tb_run("")
    # Staleness of the pushes so far, per TensorBoard run, for the cumulative histograms.
    self._staleness = collections.defaultdict(collections.Counter)
    for record in kept:
      self._count_staleness(record)

  def _tb_run(self, run: str) -> tensorboardX.SummaryWriter:
    """The event writer of a TensorBoard run, opened on first use (a learner's on its first record)."""
    if run not in self._tb_runs:
      # tensorboardX names event files by whole seconds + hostname and opens them with 'wb':
      # a resume within the same second would overwrite the crashed run's file. A
      # nanosecond suffix keeps names unique and in write order, as TensorBoard reads them.
      self._tb_runs[run] = tensorboardX.SummaryWriter(
          logdir=f"{self._tb_dir}/{run}" if run else self._tb_dir,
          purge_step=self._purge_step,
          flush_secs=30,
          filename_suffix=f".{time.time_ns()}",
      )
    return self._tb_runs[run]

  def _count_staleness(self, record: dict) -> list[str]:
    """Counts a push's staleness in its learner's run and the overall one; returns both runs."""
    if record["kind"] != "push" or "staleness" not in record:
      return []
    runs = ["", _tensorboard_run(record)] if "learner" in record else [""]
    for run in runs:
      self._staleness[run][int(record["staleness"])] += 1
    return runs

  def write(self, record: dict) -> None:
    """Appends one record (flushed, so a crash loses at most the record being written)."""
    if not isinstance(record.get("kind"), str) or "outer_step" not in record:
      raise ValueError(f"metric record needs a str 'kind' and an 'outer_step': got {record!r}")
    record = _plain(record)
    self._file.write(json.dumps(record, sort_keys=True) + "\n")
    self._file.flush()
    self.records += 1
    step = _x_axis(record)
    writer = self._tb_run(_tensorboard_run(record))
    for tag, value in _scalar_tags(record).items():
      writer.add_scalar(tag, value, global_step=step)
    for run, tag, value in _per_learner_scalars(record):
      self._tb_run(run).add_scalar(tag, value, global_step=step)
    for run in self._count_staleness(record):
      self._tb_run(run).add_histogram_raw("push/staleness_distribution", global_step=step,
                                          **_integer_histogram(self._staleness[run]))
    if self.observer is not None:
      self.observer(record)

  def sync(self) -> None:
    """Makes every record written so far durable (fsync, or an upload of a remote file).

    Why: runtimes call it right before saving a checkpoint, so a run resumed from that
    checkpoint finds every record up to it, also on a gs:// workdir that uploads in batches.
    """
    storage.sync(self._file)

  def close(self) -> None:
    """Flushes and closes both outputs."""
    self._file.close()
    for writer in self._tb_runs.values():
      writer.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _format_count(value: float) -> str:
  """12345 -> '12.3k': rates span orders of magnitude, three digits are enough."""
  for threshold, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= threshold:
      return f"{value / threshold:.1f}{unit}"
  return f"{value:.0f}"


def format_duration(seconds: float) -> str:
  """80 -> '1m20s', 7380 -> '2h03m': the coarsest two units a human reads at a glance."""
  if not math.isfinite(seconds):
    return "?"
  total = max(0, round(seconds))
  hours, rest = divmod(total, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def format_progress(*, outer_step: int, num_outer_steps: int, step: int, loss: float | None = None,
                    eval_loss: float | None = None, optimum: float | None = None, tokens_per_sec: float | None = None,
                    eta_seconds: float | None = None) -> str:
  """One human progress line; parts whose value is unknown (None) are left out.

  e.g. 'outer 3/20 | step 60 | loss 2.310 | eval 2.402 (optimum 1.950, gap 0.452) |
  12.3k tok/s | eta 1m20s'. The optimum (e.g. the entropy rate of synthetic data) and
  the gap to it only appear next to an eval loss. Pure, so the caller picks the logger.
  """
  parts = [f"outer {outer_step}/{num_outer_steps}", f"step {step}"]
  if loss is not None:
    parts.append(f"loss {loss:.3f}")
  if eval_loss is not None:
    text = f"eval {eval_loss:.3f}"
    if optimum is not None:
      text += f" (optimum {optimum:.3f}, gap {eval_loss - optimum:.3f})"
    parts.append(text)
  if tokens_per_sec is not None:
    parts.append(f"{_format_count(tokens_per_sec)} tok/s")
  if eta_seconds is not None:
    parts.append(f"eta {format_duration(eta_seconds)}")
  return " | ".join(parts)

"""What `launch_local` prints while its processes train: the run's progress, read from the records they write.

Why read files: the syncer, the evaluator and the learners are separate processes whose
logs go to <workdir>/logs; the records they append to their metrics.jsonl are the run's
source of truth, so the launcher follows those files (as `tail -f` would) and feeds them to
the same Monitor every in-process runtime uses. The console then shows the progress line
lockstep shows, the divergence verdict as soon as an eval gives it, and at the end the final
eval loss and each learner's steps, as `train` prints them.
"""

import json
import os

from absl import logging

from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco.run import monitor as monitor_lib
from decoupled_diloco.service import shardrun


class RecordTail:
  """The records appended to one metrics.jsonl since the last read; a line still being written waits."""

  def __init__(self, path: str):
    self.path, self._offset, self._partial = path, 0, b""

  def read(self) -> list[dict]:
    """The complete records written since the previous call (none while the file does not exist)."""
    try:
      with open(self.path, "rb") as file:
        file.seek(self._offset)
        data = file.read()
    except FileNotFoundError:
      return []
    self._offset += len(data)
    lines = (self._partial + data).split(b"\n")
    self._partial = lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


def eval_file(config, workdir: str) -> str:
  """The metrics.jsonl that gets the run's eval records: the evaluator's, else the (first) syncer's."""
  if config.service.evaluate_on == "evaluator":
    return os.path.join(workdir, metrics_lib.EVALUATOR_DIR, metrics_lib.METRICS_FILE)
  syncer_dir = workdir if config.service.shards == 1 else shardrun.shard_workdir(workdir, 0)
  return os.path.join(syncer_dir, metrics_lib.METRICS_FILE)


class RunConsole:
  """Follows a service run's metrics files: progress lines as evals arrive, then the closing lines."""

  def __init__(self, config, workdir: str):
    self.monitor = monitor_lib.Monitor.for_config(config)
    self.evals = RecordTail(eval_file(config, workdir))
    self.learners = [
        RecordTail(os.path.join(workdir, f"learner_{m}", metrics_lib.METRICS_FILE))
        for m in range(len(config.learners.devices))]
    self.summaries: dict[int, dict] = {}  # Learner -> its learner_summary record.
    self.syncer_summary: dict | None = None

  def poll(self) -> None:
    """Reads what was appended: learners' train windows first (the loss shown), then evals."""
    for tail in self.learners:
      for record in tail.read():
        if record.get("kind") == "learner_summary":
          self.summaries[record["learner"]] = record
        self.monitor.observe(record)
    for record in self.evals.read():
      if record.get("kind") in ("summary", "evaluator_summary"):
        self.syncer_summary = record
      self.monitor.observe(record)

  @property
  def diverged(self) -> bool:
    """Whether the run diverged, by this console's watch or by the syncer's (or evaluator's) summary."""
    return bool(self.monitor.diverged or (self.syncer_summary or {}).get("diverged"))

  def closing_lines(self) -> list[str]:
    """The final eval loss (with its optimum and gap where known) and each learner's steps, as train prints."""
    self.poll()
    last = self.monitor.last_eval
    if last is None:
      return ["no eval record: the run ended before its first evaluation"]
    line = f"final eval loss {last['eval_loss']:.4f}"
    if self.monitor.optimal_loss is not None:
      line += f" (optimum {self.monitor.optimal_loss:.4f}, gap {last['eval_loss'] - self.monitor.optimal_loss:.4f})"
    steps = [self.summaries.get(m, {}).get("steps") for m in range(len(self.learners))]
    line += f"; steps per learner {steps}"
    if self.diverged:
      line = f"DIVERGED: {line}"
      logging.error("%s", self.monitor.diverged or "the syncer's summary says the run diverged")
    return [line]

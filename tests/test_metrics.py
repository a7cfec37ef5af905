"""metrics.jsonl round trips, resume truncation, TensorBoard scalars and histograms, progress lines."""

import glob
import json
import os
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from decoupled_diloco.metrics import MetricsWriter, format_duration, format_progress, read_metrics


def _records(num_outer_steps: int, inner_steps: int = 2):
  """What a 2-learner run writes: train per inner step and learner, eval per outer step."""
  records = []
  for outer in range(1, num_outer_steps + 1):
    for inner in range(inner_steps):
      step = (outer - 1) * inner_steps + inner + 1
      for learner in range(2):
        records.append({
            "kind": "train", "outer_step": outer, "inner_step": step, "learner": learner,
            "loss": np.float32(3.0 - 0.1 * step - 0.01 * learner)})
    records.append({
        "kind": "eval", "outer_step": outer, "inner_step": outer * inner_steps, "loss": 3.5 - 0.2 * outer,
        "tokens_per_sec": 1234})
  return records


def _read_events(logdir, run=""):
  """One TensorBoard run's scalars as (tag, step, value), histograms as (tag, step,
  {bucket limit: count}) and session starts as ("START", step, None), in the order
  TensorBoard reads them (event files sorted by name, records in file order)."""
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, run, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc.
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      if event.HasField("session_log"):
        events.append(("START", event.step, None))
      for value in event.summary.value:
        if value.HasField("histo"):
          events.append((value.tag, event.step, dict(zip(value.histo.bucket_limit, value.histo.bucket))))
        else:
          events.append((value.tag, event.step, value.simple_value))
  return events


def _runs(logdir):
  """TensorBoard's runs under logdir: every directory holding event files, relative to it ("" = logdir)."""
  runs = {
      os.path.relpath(os.path.dirname(p), logdir)
      for p in glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)}
  return sorted("" if run == "." else run for run in runs)


def _visible_scalars(logdir):
  """Scalars TensorBoard shows, per run: a session START at step s hides earlier events at >= s."""
  shown = []
  for run in _runs(logdir):
    visible = []
    for event in _read_events(logdir, run):
      if event[0] == "START":
        visible = [v for v in visible if v[1] < event[1]]
      else:
        visible.append(event)
    shown += [(run, *event) for event in visible]
  return sorted(shown)


def test_records_round_trip(tmp_path):
  records = _records(2)
  with MetricsWriter(tmp_path) as writer:
    for record in records:
      writer.write(record)
  read = read_metrics(tmp_path / "metrics.jsonl")
  assert len(read) == len(records)
  for got, want in zip(read, records):
    assert got.keys() == want.keys()
    assert got == pytest.approx({k: v.item() if isinstance(v, np.generic) else v for k, v in want.items()})
  assert type(read[0]["loss"]) is float
  first_line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
  assert list(json.loads(first_line)) == sorted(json.loads(first_line))


def test_record_without_outer_step_is_rejected(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    with pytest.raises(ValueError, match="outer_step"):
      writer.write({"kind": "train", "loss": 1.0})


def test_resume_keeps_exactly_records_up_to_the_checkpoint(tmp_path):
  crashed = _records(5)
  with MetricsWriter(tmp_path) as writer:
    for record in crashed:
      writer.write(record)
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"kind": "train", "outer_')  # The crash cut this record short.

  with MetricsWriter(tmp_path, resume_from_step=3) as writer:
    kept = read_metrics(tmp_path / "metrics.jsonl")
    assert sorted({r["outer_step"] for r in kept}) == [1, 2, 3]
    assert len(kept) == sum(1 for r in crashed if r["outer_step"] <= 3)
    for record in crashed:
      if record["outer_step"] > 3:
        writer.write(record)

  with MetricsWriter(tmp_path / "uninterrupted") as writer:
    for record in crashed:
      writer.write(record)
  assert read_metrics(tmp_path / "metrics.jsonl") == read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")
  assert not os.path.exists(tmp_path / "metrics.jsonl.tmp")

  # TensorBoard hides the crashed run's events from the first step after the checkpoint,
  # in the main run and in every learner's.
  assert _runs(tmp_path / "tensorboard") == ["", "learner_0", "learner_1"]
  for run in _runs(tmp_path / "tensorboard"):
    assert [e[1] for e in _read_events(tmp_path / "tensorboard", run) if e[0] == "START"] == [7]
    assert len(glob.glob(str(tmp_path / "tensorboard" / run / "events.*"))) == 2
  assert _visible_scalars(tmp_path / "tensorboard") == _visible_scalars(tmp_path / "uninterrupted" / "tensorboard")


def test_read_metrics_ignores_only_a_torn_final_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"kind": "eval", "outer_step": 1}\n{"kind": "ev')
  assert read_metrics(path) == [{"kind": "eval", "outer_step": 1}]
  path.write_text('{"kind": "ev\n{"kind": "eval", "outer_step": 1}\n')
  with pytest.raises(ValueError, match="metrics.jsonl:1"):
    read_metrics(path)


def test_append_after_a_torn_write_starts_on_a_fresh_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "outer_step": 1}\n{"kind": "ev')
  with MetricsWriter(tmp_path) as writer:
    writer.write({"kind": "eval", "outer_step": 2})
  assert read_metrics(tmp_path / "metrics.jsonl") == [{"kind": "eval", "outer_step": 1},
                                                      {"kind": "eval", "outer_step": 2}]


def test_tensorboard_scalars_one_run_per_learner(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    writer.write({"kind": "train", "outer_step": 3, "inner_step": 60, "learner": 0, "loss": 2.5})
    writer.write({"kind": "train", "outer_step": 3, "inner_step": 30, "learner": 1, "loss": 2.75})
    writer.write({"kind": "eval", "outer_step": 3, "loss": 2.25, "note": "text is not plotted"})
  assert _visible_scalars(tmp_path / "tensorboard") == [("", "eval/loss", 3, 2.25),
                                                        ("learner_0", "train/loss", 60, 2.5),
                                                        ("learner_1", "train/loss", 30, 2.75)]


def test_tensorboard_itself_reads_one_run_per_learner(tmp_path):
  """What `tensorboard --logdir DIR` loads, through TensorBoard's own event reader."""
  event_multiplexer = pytest.importorskip("tensorboard.backend.event_processing.event_multiplexer")
  with MetricsWriter(tmp_path) as writer:
    for record in _records(2):
      writer.write(record)
  runs = event_multiplexer.EventMultiplexer().AddRunsFromDirectory(str(tmp_path)).Reload()
  assert sorted(runs.Runs()) == ["tensorboard", "tensorboard/learner_0", "tensorboard/learner_1"]
  losses = [(e.step, round(e.value, 4)) for e in runs.Scalars("tensorboard/learner_1", "train/loss")]
  assert losses == [(1, 2.89), (2, 2.79), (3, 2.69), (4, 2.59)]
  assert [e.step for e in runs.Scalars("tensorboard", "eval/loss")] == [2, 4]


def test_tensorboard_staleness_histograms_count_every_push_so_far(tmp_path):
  pushes = [(0, 0), (1, 2), (0, 2), (1, 3)]  # (learner, staleness)
  with MetricsWriter(tmp_path) as writer:
    for step, (learner, staleness) in enumerate(pushes, 1):
      writer.write({
          "kind": "push", "outer_step": step, "inner_step": step, "learner": learner, "staleness": staleness,
          "accepted": 1})
  histograms = [e for e in _visible_scalars(tmp_path / "tensorboard") if e[1] == "push/staleness_distribution"]
  assert [(run, step) for run, _, step, _ in histograms] == [("", 1), ("", 2), ("", 3), ("", 4), ("learner_0", 1),
                                                             ("learner_0", 3), ("learner_1", 2), ("learner_1", 4)]
  assert histograms[3][3] == {0.5: 1, 1.5: 0, 2.5: 2, 3.5: 1}  # All pushes, one bucket per staleness.
  assert histograms[5][3] == {0.5: 1, 1.5: 0, 2.5: 1}
  assert histograms[7][3] == {2.5: 1, 3.5: 1}
  assert ("learner_1", "push/staleness", 4, 3.0) in _visible_scalars(tmp_path / "tensorboard")

  # Appending later (e.g. another job) continues the counts from the records on disk.
  with MetricsWriter(tmp_path) as writer:
    writer.write({"kind": "push", "outer_step": 5, "inner_step": 5, "learner": 1, "staleness": 0, "accepted": 1})
  last = [e for e in _read_events(tmp_path / "tensorboard") if e[0] == "push/staleness_distribution"][-1]
  assert last == ("push/staleness_distribution", 5, {0.5: 2, 1.5: 0, 2.5: 2, 3.5: 1})


def test_tensorboard_gets_pseudo_gradient_norms_bits_per_byte_stalls_and_bytes_sent(tmp_path):
  """The records as the runtimes write them (lockstep outer, sim outer, eval, learner_summary), read back."""
  with MetricsWriter(tmp_path) as writer:
    writer.write({"kind": "outer", "outer_step": 1, "inner_step": 3, "version": 1, "delta_norms": [0.5, 0.25]})
    writer.write({
        "kind": "outer", "outer_step": 2, "inner_step": 6, "fragment": 0, "learners": [1], "staleness": [2],
        "weights": [0.75]})
    writer.write({"kind": "eval", "outer_step": 2, "inner_step": 6, "eval_loss": 2.0, "eval_bits_per_byte": 2.885})
    for learner, stalls in ((0, 5), (1, None)):  # (null: a runtime that does not measure it)
      writer.write({
          "kind": "learner_summary", "outer_step": 2, "inner_step": 6, "learner": learner, "stalls": stalls,
          "bytes_sent": 1000 * (learner + 1), "staleness_histogram": {"2": 1}})
  scalars = {(run, tag, step): round(value, 4) for run, tag, step, value in _visible_scalars(tmp_path / "tensorboard")}
  assert {key: value for key, value in scalars.items() if key[1].startswith("outer/")} == {
      ("", "outer/version", 3): 1.0, ("", "outer/fragment", 6): 0.0,
      ("learner_0", "outer/pseudo_gradient_norm", 3): 0.5, ("learner_1", "outer/pseudo_gradient_norm", 3): 0.25,
      ("learner_1", "outer/merge_weight", 6): 0.75}
  assert scalars[("", "eval/eval_bits_per_byte", 6)] == 2.885
  assert scalars[("learner_0", "learner_summary/stalls", 6)] == 5.0
  assert ("learner_1", "learner_summary/stalls", 6) not in scalars
  assert [scalars[(f"learner_{m}", "learner_summary/bytes_sent", 6)] for m in (0, 1)] == [1000.0, 2000.0]


def test_format_progress():
  line = format_progress(outer_step=3, num_outer_steps=20, step=60, loss=2.31, eval_loss=2.402, optimum=1.95,
                         tokens_per_sec=12_300, eta_seconds=80)
  assert line == ("outer 3/20 | step 60 | loss 2.310 | eval 2.402 (optimum 1.950, gap 0.452)"
                  " | 12.3k tok/s | eta 1m20s")
  assert format_progress(outer_step=1, num_outer_steps=2, step=5, loss=3.0,
                         optimum=1.0) == "outer 1/2 | step 5 | loss 3.000"
  assert format_progress(outer_step=1, num_outer_steps=2, step=5, tokens_per_sec=950,
                         eta_seconds=7380) == "outer 1/2 | step 5 | 950 tok/s | eta 2h03m"


def test_format_duration():
  assert [format_duration(s) for s in (0, 59.4, 65, 3600, float("inf"))] == ["0s", "59s", "1m05s", "1h00m", "?"]

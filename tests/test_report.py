"""Report tables and plots from records shaped like the runtimes' (lockstep and virtual clock)."""

import collections
import json

import pytest

from decoupled_diloco.research import report
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import records as run_records


def _lockstep_records():
  """What a 2-round lockstep DiLoCo run writes: train, outer and eval records, no clock."""
  records = []
  for step in (1, 2):
    records += [{
        "kind": "train", "outer_step": step, "inner_step": 3 * step, "learner": m, "loss": 3.0 - step,
        "tokens": 30 * step, "wall_time": 2.0 * step} for m in (0, 1)]
    records.append({
        "kind": "eval", "outer_step": step, "inner_step": 3 * step, "tokens": 60 * step, "wall_time": 2.0 * step,
        "eval_loss": 2.5 - 0.5 * step, "optimal_loss": 1.0})
  return records


def _sim_records(with_pushes=True):
  """A decoupled run on the virtual clock: pushes, learner summaries and the summary."""
  records = [{
      "kind": "eval", "outer_step": v, "inner_step": 4 * v, "tokens": 80 * v, "time": 10.0 * v, "wall_time": 1.5 * v,
      "eval_loss": 2.4 - 0.4 * v, "optimal_loss": 1.0} for v in (1, 2)]
  pushes = [(0, 0), (1, 1), (0, 1), (1, 3)]  # (learner, staleness)
  if with_pushes:
    records += [{
        "kind": "push", "outer_step": i, "inner_step": 4 * i, "learner": m, "local_steps": 4, "tokens": 40,
        "staleness": s, "accepted": 1, "time": 5.0 * i, "wall_time": 1.0, "clipped": int(i == 3)}
                for i, (m, s) in enumerate(pushes)]
  clock = {"outer_step": 4, "inner_step": 8, "tokens": 120, "time": 20.0, "wall_time": 3.0}
  for m, busy, steps in ((0, 18.0, 8), (1, 16.0, 4)):  # Built as the runtimes build them: the one schema.
    records.append(
        run_records.learner_summary(
            clock, learner=m, busy_seconds=busy, idle_seconds=20 - busy, finished_early_seconds=0.0, steps=steps,
            tokens=10 * steps, pushes=2, dropped=0, rejected=0,
            staleness_histogram=dict(collections.Counter(str(s) for mm, s in pushes if mm == m))))
  records.append(run_records.summary(clock, eval_loss=1.6, virtual_seconds=20.0, goodput=0.85, dropped_pushes=0))
  return records


def test_summaries_hold_each_runs_figures():
  lockstep, decoupled = report.summarize_run(_lockstep_records()), report.summarize_run(_sim_records())
  assert lockstep == {
      "eval_loss": 1.5, "optimal_loss": 1.0, "tokens": 120, "outer_updates": 2, "wall_seconds": 4.0,
      "virtual_seconds": None, "goodput": None, "idle_fraction": None, "pushes": None, "dropped": None, "clipped": None,
      "mean_staleness": None}
  assert decoupled["virtual_seconds"] == 20.0 and decoupled["goodput"] == 0.85 and decoupled["pushes"] == 4
  assert decoupled["idle_fraction"] == pytest.approx((2 / 20 + 4 / 20) / 2)
  assert decoupled["mean_staleness"] == pytest.approx(5 / 4) and decoupled["clipped"] == 1  # Robust merges' count.
  assert report.summarize_run([]) == dict.fromkeys(report.SUMMARY_FIELDS)


def test_staleness_comes_from_pushes_or_else_the_learner_summaries():
  from_pushes = report.staleness_counts(_sim_records())
  assert from_pushes == {0: {0: 1, 1: 1}, 1: {1: 1, 3: 1}}
  assert report.staleness_counts(_sim_records(with_pushes=False)) == from_pushes
  assert report.staleness_counts(_lockstep_records()) == {}


def test_table_has_a_row_per_run_and_only_columns_some_run_has():
  rows = {"sync": report.summarize_run(_lockstep_records())}
  table = report.markdown_table(rows)
  assert table.splitlines()[0] == "| run | eval loss | gap to optimum | tokens | outer updates | wall s |"
  assert table.splitlines()[2] == "| sync | 1.5000 | 0.5000 | 120 | 2 | 4.0 |"
  rows["async"] = report.summarize_run(_sim_records())
  lines = report.markdown_table(rows).splitlines()
  assert len(lines) == 4 and "goodput" in lines[0] and "mean staleness" in lines[0]
  assert lines[2].endswith("| – | – | – | – | – | – |") and "| 0.850 |" in lines[3]


def test_runs_without_clock_or_pushes_skip_those_plots():
  assert set(report.figures({"sync": _lockstep_records()})) == {"loss_vs_tokens", "loss_vs_wall_time"}
  both = report.figures({"sync": _lockstep_records(), "async": _sim_records()})
  assert set(both) == set(report.PLOTS)
  curves = both["loss_vs_tokens"].axes[0].get_lines()
  assert [line.get_label() for line in curves] == ["sync", "async", "optimum"]
  assert [line.get_label() for line in both["loss_vs_virtual_time"].axes[0].get_lines()] == ["async", "optimum"]
  assert len(both["staleness"].subfigs) == 1  # Only the run with pushes gets histograms.
  assert report.figures({"empty": []}) == {}


def _visible(figure):
  return [axes for axes in figure.axes if axes.get_visible()]


def test_staleness_panels_show_each_learners_own_pushes_unclipped():
  panels = _visible(report.staleness_histogram({"async": _sim_records()}))
  assert [axes.get_title() for axes in panels] == ["learner 0: 2 pushes, mean 0.50", "learner 1: 2 pushes, mean 2.00"]
  # Staleness 0..3 in each panel: learner 0 pushed at 0 and 1, learner 1 at 1 and 3.
  assert [[bar.get_height() for bar in axes.patches] for axes in panels] == [[1, 1, 0, 0], [0, 1, 0, 1]]
  for axes in panels:  # Nothing touches the frame: the axes fit the data with room to spare.
    assert axes.get_ylim()[1] > max(bar.get_height() for bar in axes.patches)
    assert axes.get_xlim()[0] < -0.4 and axes.get_xlim()[1] > 3.4


def _on_the_wall_clock(record):
  """A sim record as threads would write it: no virtual seconds, blocked time measured (1 s + the learner)."""
  if record["kind"] == "summary":
    return {**record, "virtual_seconds": None}
  if record["kind"] == "learner_summary":
    return {**record, "blocked_seconds": 1.0 + record["learner"]}
  return record


def test_utilization_bars_are_each_learners_own_and_fit_the_axes():
  times, steps = report.utilization({"async": _sim_records()}).axes
  # Busy (18, 16) then idle (2, 4) seconds of learners 0 and 1; nobody finished early, so no grey segment.
  assert [bar.get_width() for bar in times.patches] == [18.0, 16.0, 2.0, 4.0]
  assert [bar.get_width() for bar in steps.patches] == [8, 4]
  assert times.get_xlabel() == "virtual seconds" and times.get_xlim()[1] > 20 and steps.get_xlim()[1] > 8
  # Threads measure blocked time on the wall clock: a fourth segment and the right unit.
  threads = [_on_the_wall_clock(record) for record in _sim_records()]
  figure = report.utilization({"threads": threads})
  assert [bar.get_width() for bar in figure.axes[0].patches][-2:] == [1.0, 2.0]
  assert figure.axes[0].get_xlabel() == "wall-clock seconds" and figure.axes[0].get_xlim()[1] > 22
  assert [text.get_text() for text in figure.legends[0].get_texts()] == ["busy", "idle", "blocked"]


def test_runs_with_the_same_learner_data_share_one_row():
  """A sweep over a knob that leaves timing alone (the staleness function on the virtual clock) draws it once."""
  same = report.figures({"a": _sim_records(), "b": _sim_records(), "sync": _lockstep_records()})
  for stem in ("utilization", "staleness"):
    assert [row.get_suptitle() for row in same[stem].subfigs] == ["2 runs, same data: a, b"]
  other = _sim_records()
  other[-2] = {**other[-2], "steps": 5}  # Learner 1's summary.
  rows = report.utilization({"a": _sim_records(), "b": other}).subfigs
  assert [row.get_suptitle() for row in rows] == ["a", "b"]


def test_write_report_saves_pngs_and_a_markdown_page(tmp_path):
  paths = report.write_report({"sync": _lockstep_records(), "async": _sim_records()}, str(tmp_path / "out"))
  assert sorted(p.split("/")[-1] for p in paths) == sorted([f"{stem}.png" for stem in report.PLOTS] + ["report.md"])
  for stem in report.PLOTS:
    assert (tmp_path / "out" / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
  page = (tmp_path / "out" / "report.md").read_text()
  assert page.startswith("# Report: 2 run(s)") and "| sync |" in page and "![staleness](staleness.png)" in page


def _write_run(workdir, records):
  workdir.mkdir(parents=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_find_runs_expands_sweeps_in_their_order_and_rejects_empty_paths(tmp_path):
  for name in ("b=10", "b=5", "a=1"):
    _write_run(tmp_path / "sweep" / name, _lockstep_records())
  (tmp_path / "sweep" / "results.csv").write_text("name,b\nb=5,5\nb=10,10\n")
  _write_run(tmp_path / "single", _sim_records())
  runs = report.find_runs([str(tmp_path / "sweep"), str(tmp_path / "single")])
  assert list(runs) == ["b=5", "b=10", "a=1", "single"]  # Not in the CSV: after the sweep's points.
  assert set(report.load_runs([str(tmp_path / "single")])) == {"single"}
  with pytest.raises(ConfigError, match="does not exist"):
    report.find_runs([str(tmp_path / "missing")])
  (tmp_path / "empty").mkdir()
  with pytest.raises(ConfigError, match="holds no metrics.jsonl: pass a run's --workdir or a sweep's"):
    report.find_runs([str(tmp_path / "empty")])

"""Reports on runs: a markdown summary table and PNG plots built from metrics.jsonl records.

Pure functions over records (lists of dicts, as metrics.read_metrics returns them), so a
notebook shows inline the same figures `python -m experiments.report` saves. Figures use
matplotlib's object API (a Figure rendered by the Agg canvas, no pyplot): no display or
global pyplot state is involved. A plot needs records some runs lack (lockstep runs write
no learner_summary or push records); runs without them are left out of it, and a plot no
run can feed is not drawn at all. Summary records have one schema (run/records.py, docs/records.md):
every field is there, null where the runtime does not measure it.
"""

import collections
import csv
import io
import os
import statistics
import textwrap

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from decoupled_diloco import metrics, storage
from decoupled_diloco.errors import ConfigError

# Summary figures of one run, in table (and results.csv) order.
SUMMARY_FIELDS = ("eval_loss", "optimal_loss", "tokens", "outer_updates", "wall_seconds", "virtual_seconds", "goodput",
                  "idle_fraction", "pushes", "dropped", "clipped", "mean_staleness")
_COLUMNS = {  # Table header of each summary field (optimal_loss shows as the gap to it).
    "eval_loss": "eval loss", "optimal_loss": "gap to optimum", "tokens": "tokens", "outer_updates": "outer updates",
    "wall_seconds": "wall s", "virtual_seconds": "virtual s", "goodput": "goodput", "idle_fraction": "idle",
    "pushes": "pushes", "dropped": "dropped", "clipped": "clipped", "mean_staleness": "mean staleness"}


def _of(records: list[dict], kind: str) -> list[dict]:
  return [r for r in records if r["kind"] == kind]


def find_runs(paths: list[str]) -> dict[str, str]:
  """Run name -> workdir for each path: a run's workdir, or a sweep's root (its point subdirectories).

  A sweep's points keep the order of its results.csv (the order they were defined in).
  """
  runs = {}
  for path in paths:
    root = storage.path(path)
    if not root.exists():
      raise ConfigError(f"{path} does not exist: pass a run's --workdir or a sweep's")
    if (root / metrics.METRICS_FILE).exists():
      found = [path]
    else:
      entries = sorted(entry.name for entry in root.iterdir()) if root.is_dir() else []
      subdirs = [d for d in entries if (root / d / metrics.METRICS_FILE).exists()]
      order = _sweep_order(path)
      found = [os.path.join(path, d) for d in sorted(subdirs, key=lambda d: order.get(d, len(order)))]
    if not found:
      raise ConfigError(f"{path} holds no {metrics.METRICS_FILE}: pass a run's --workdir or a sweep's")
    for workdir in found:
      name = os.path.basename(os.path.normpath(workdir))
      runs[workdir if name in runs else name] = workdir
  return runs


def _sweep_order(root: str) -> dict[str, int]:
  path = storage.path(root) / "results.csv"
  if not path.exists():
    return {}
  rows = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8"), newline=""))
  return {row["name"]: index for index, row in enumerate(rows)}


def load_runs(paths: list[str]) -> dict[str, list[dict]]:
  """Run name -> its records, for every run under `paths` (see find_runs)."""
  return {name: run_records(workdir) for name, workdir in find_runs(paths).items()}


def run_records(workdir: str) -> list[dict]:
  """A run's records: its metrics.jsonl, then those of its evaluator process if it had one
  (service.evaluate_on='evaluator': the run's eval records are there, tagged with Θ's version)."""
  records = metrics.read_metrics(os.path.join(workdir, metrics.METRICS_FILE))
  evaluator = storage.path(workdir) / metrics.EVALUATOR_DIR / metrics.METRICS_FILE
  return records + (metrics.read_metrics(evaluator) if evaluator.exists() else [])


def staleness_counts(records: list[dict]) -> dict[int, collections.Counter]:
  """Learner -> Counter(staleness -> pushes), from push records, else the learner summaries."""
  counts = collections.defaultdict(collections.Counter)
  for record in _of(records, "push"):
    counts[record["learner"]][int(record["staleness"])] += 1
  if not counts:
    for record in _of(records, "learner_summary"):
      counts[record["learner"]].update({int(s): n for s, n in (record["staleness_histogram"] or {}).items()})
  return {learner: c for learner, c in sorted(counts.items()) if c}


def summarize_run(records: list[dict]) -> dict:
  """The figures a table row or results.csv holds for one run (None where the run has no record)."""
  evals, learners = _of(records, "eval"), _of(records, "learner_summary")
  last = evals[-1] if evals else {}
  summary = (_of(records, "summary") or [{}])[-1]
  staleness = [(s, n) for counter in staleness_counts(records).values() for s, n in counter.items()]
  pushes = sum(n for _, n in staleness)
  idle = [r["idle_seconds"] / r["time"] for r in learners if r["idle_seconds"] is not None and r["time"]]
  verdicts = [r["clipped"] for r in _of(records, "push") if "clipped" in r]  # Robust merges (docs/syncer.md).
  return {
      "eval_loss": last.get("eval_loss"),
      "optimal_loss": last.get("optimal_loss"),
      "tokens": last.get("tokens"),
      "outer_updates": last.get("outer_step"),
      "wall_seconds": max((r["wall_time"] for r in records if "wall_time" in r), default=None),
      "virtual_seconds": last.get("time") if summary.get("virtual_seconds") is None else summary["virtual_seconds"],
      "goodput": summary.get("goodput"),
      "idle_fraction": statistics.mean(idle) if idle else None,
      "pushes": pushes or None,
      "dropped": summary.get("dropped_pushes"),
      "clipped": sum(verdicts) if verdicts else None,
      "mean_staleness": sum(s * n for s, n in staleness) / pushes if pushes else None,}


def _cell(field: str, row: dict) -> str:
  value = row[field]
  if field == "optimal_loss" and value is not None and row["eval_loss"] is not None:
    value = row["eval_loss"] - value
  if value is None:
    return "–"
  if field in ("tokens", "outer_updates", "pushes", "dropped", "clipped"):
    return f"{int(value):,}"
  if field in ("wall_seconds", "virtual_seconds"):
    return f"{value:.1f}"
  if field in ("goodput", "idle_fraction", "mean_staleness"):
    return f"{value:.3f}"
  return f"{value:.4f}"


def markdown_table(summaries: dict[str, dict]) -> str:
  """One row per run; columns no run has a value for (e.g. goodput of lockstep runs) are left out."""
  fields = [f for f in SUMMARY_FIELDS if any(row[f] is not None for row in summaries.values())]
  lines = ["| run | " + " | ".join(_COLUMNS[f] for f in fields) + " |", "|---|" + "---:|" * len(fields)]
  for name, row in summaries.items():
    lines.append(f"| {name.replace('|', '/')} | " + " | ".join(_cell(f, row) for f in fields) + " |")
  return "\n".join(lines) + "\n"


def _wrap(name: str, width: int) -> str:
  """A run name broken into lines of about `width` characters, after its commas if it has any."""
  return textwrap.fill(name.replace(",", ", "), width, break_on_hyphens=False).replace(", ", ",")


def _figure(width: float = 7.0, height: float = 4.5) -> Figure:
  figure = Figure(figsize=(width, height), layout="constrained")
  FigureCanvasAgg(figure)
  return figure


def _loss_curves(runs: dict[str, list[dict]], x_field: str, x_label: str, title: str) -> Figure | None:
  """Eval loss against one x field, a line per run that has it; the optimum dashed when known."""
  curves = {
      name: [(r[x_field], r["eval_loss"]) for r in _of(records, "eval") if x_field in r]
      for name, records in runs.items()}
  curves = {name: points for name, points in curves.items() if points}
  if not curves:
    return None
  figure = _figure()
  axes = figure.add_subplot()
  for name, points in curves.items():
    axes.plot(*zip(*points), marker="o", markersize=3, label=name)
  optima = {r["optimal_loss"] for records in runs.values() for r in _of(records, "eval") if "optimal_loss" in r}
  if len(optima) == 1:
    axes.axhline(optima.pop(), color="gray", linestyle="--", linewidth=1, label="optimum")
  axes.set(xlabel=x_label, ylabel="eval loss", title=title)
  axes.grid(alpha=0.3)
  axes.legend(fontsize="small")
  return figure


def loss_vs_tokens(runs: dict[str, list[dict]]) -> Figure | None:
  """Eval loss per token seen: how runs compare at equal data, whatever their speed."""
  return _loss_curves(runs, "tokens", "tokens", "Eval loss vs tokens")


def loss_vs_time(runs: dict[str, list[dict]], clock: str = "wall") -> Figure | None:
  """Eval loss against wall-clock seconds, or virtual seconds of the simulated hardware ('virtual').

  Virtual time is what heterogeneous and decoupled runs are about (sim runtime only); wall
  time is what this machine spent.
  """
  if clock == "virtual":
    return _loss_curves(runs, "time", "virtual seconds (simulated hardware)", "Eval loss vs virtual time")
  return _loss_curves(runs, "wall_time", "wall-clock seconds", "Eval loss vs wall-clock time")


_PANELS_PER_LINE = 4  # Staleness panels (one per learner) side by side before they wrap.
# Segments of a learner's time in the utilization plot: (learner_summary field, colour).
_TIME_PARTS = (("busy_seconds", "tab:green"), ("idle_seconds", "tab:orange"), ("blocked_seconds", "tab:red"),
               ("finished_early_seconds", "tab:gray"))


def _distinct(per_run: dict[str, object]) -> dict[str, object]:
  """Title -> data, once per distinct data: runs with equal data share one title naming them all.

  Why: a sweep over a knob that leaves timing alone (the staleness function, on the virtual
  clock) gives every point the same utilization and staleness; drawing them once says so,
  where identical rows repeated say nothing.
  """
  groups: list[tuple[list[str], object]] = []
  for name, data in per_run.items():
    same = next((names for names, seen in groups if seen == data), None)
    if same is None:
      groups.append(([name], data))
    else:
      same.append(name)
  return {
      names[0] if len(names) == 1 else f"{len(names)} runs, same data: {', '.join(names)}": data
      for names, data in groups}


def _utilization_data(records: list[dict]) -> tuple | None:
  """(clock, ((learner, steps, *seconds of each _TIME_PARTS), ...)) from a run's learner_summary records."""
  learners = tuple((r["learner"], r["steps"], *(r[field] or 0.0 for field, _ in _TIME_PARTS))
                   for r in _of(records, "learner_summary"))  # (null: a runtime that does not measure it)
  virtual = any(r["virtual_seconds"] is not None for r in _of(records, "summary"))
  return ("virtual" if virtual else "wall-clock", learners) if learners else None


def utilization(runs: dict[str, list[dict]]) -> Figure | None:
  """Per learner: busy / idle / blocked / finished-early seconds, and local steps taken.

  Shows who waited for whom: in sync DiLoCo fast learners idle; decoupled, they take more steps.
  Each bar is one learner's own learner_summary; runs with the same figures share a row.
  """
  rows = _distinct({name: _utilization_data(records) for name, records in runs.items()})
  rows = {title: data for title, data in rows.items() if data is not None}
  if not rows:
    return None
  figure = _figure(10.0, 0.6 + 2.6 * len(rows))
  legend = {}
  for row, (title, (clock, learners)) in zip(figure.subfigures(len(rows), 1, squeeze=False)[:, 0], rows.items()):
    row.suptitle(_wrap(title, 100))
    labels = [f"learner {learner[0]}" for learner in learners]
    times, steps = row.subplots(1, 2)
    left = [0.0] * len(learners)
    for index, (field, color) in enumerate(_TIME_PARTS, 2):
      values = [learner[index] for learner in learners]
      if any(values):
        label = field[:-len("_seconds")].replace("_", " ")
        legend[label] = times.barh(labels, values, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, values)]
    steps.barh(labels, [learner[1] for learner in learners], color="tab:blue")
    times.set(xlabel=f"{clock} seconds", xlim=(0, 1.05 * max(left) or 1))
    steps.set(xlabel="local steps", xlim=(0, 1.05 * max(learner[1] for learner in learners) or 1))
    for axes in (times, steps):
      axes.invert_yaxis()
  figure.legend(legend.values(), legend.keys(), loc="outside lower center", ncol=len(legend), fontsize="small")
  return figure


def staleness_histogram(runs: dict[str, list[dict]]) -> Figure | None:
  """Pushes per staleness (merges between a push's base version and its arrival): a panel per learner.

  Each panel is one learner's own pushes (its push records, else its learner_summary); a row's
  panels share their axes, which fit the tallest bar, so learners compare at a glance.
  """
  rows = _distinct({name: staleness_counts(records) for name, records in runs.items()})
  rows = {title: per_learner for title, per_learner in rows.items() if per_learner}
  if not rows:
    return None
  columns = min(_PANELS_PER_LINE, max(len(per_learner) for per_learner in rows.values()))
  lines = [-(-len(per_learner) // columns) for per_learner in rows.values()]
  figure = _figure(0.4 + 2.8 * columns, 0.4 + sum(0.4 + 2.3 * n for n in lines))
  subfigures = figure.subfigures(len(rows), 1, squeeze=False, height_ratios=[0.4 + 2.3 * n for n in lines])[:, 0]
  for row, line_count, (title, per_learner) in zip(subfigures, lines, rows.items()):
    row.suptitle(_wrap(title, 35 * columns))
    values = list(range(max(max(counter) for counter in per_learner.values()) + 1))
    tallest = max(n for counter in per_learner.values() for n in counter.values())
    panels = row.subplots(line_count, columns, squeeze=False).ravel()
    for axes, (learner, counter) in zip(panels, per_learner.items()):
      heights = [counter.get(s, 0) for s in values]
      bars = axes.bar(values, heights, color=f"C{learner % 10}")
      axes.bar_label(bars, [str(n) if n else "" for n in heights], fontsize="x-small")
      mean = sum(s * n for s, n in counter.items()) / sum(heights)
      axes.set(title=f"learner {learner}: {sum(heights)} pushes, mean {mean:.2f}", xlabel="staleness (merges)",
               xlim=(-0.6, values[-1] + 0.6), ylim=(0, 1.15 * tallest))
      axes.xaxis.set_major_locator(MaxNLocator(integer=True))
      axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    for axes in panels[::columns]:
      axes.set_ylabel("pushes")
    for axes in panels[len(per_learner):]:
      axes.set_visible(False)
  figure.suptitle("Staleness of each learner's pushes")
  return figure


# File stem -> (section title in report.md, plot function).
PLOTS = {
    "loss_vs_tokens": ("Eval loss vs tokens", loss_vs_tokens),
    "loss_vs_wall_time": ("Eval loss vs wall-clock time", lambda runs: loss_vs_time(runs, "wall")),
    "loss_vs_virtual_time": ("Eval loss vs virtual time", lambda runs: loss_vs_time(runs, "virtual")),
    "utilization": ("Per-learner utilization and local steps", utilization),
    "staleness": ("Staleness of pushes", staleness_histogram),}


def figures(runs: dict[str, list[dict]]) -> dict[str, Figure]:
  """File stem -> figure, for every plot the runs can feed."""
  made = {stem: plot(runs) for stem, (_, plot) in PLOTS.items()}
  return {stem: figure for stem, figure in made.items() if figure is not None}


def write_report(runs: dict[str, list[dict]], out_dir: str) -> list[str]:
  """Saves every plot as PNG and report.md (the table, then the plots); returns the paths written."""
  storage.makedirs(out_dir)
  paths, sections = [], []
  for stem, figure in figures(runs).items():
    paths.append(os.path.join(out_dir, f"{stem}.png"))
    with storage.path(paths[-1]).open("wb") as f:  # A file object: matplotlib itself only writes local paths.
      figure.savefig(f, format="png", dpi=110)
    sections.append(f"## {PLOTS[stem][0]}\n\n![{stem}]({stem}.png)\n")
  table = markdown_table({name: summarize_run(records) for name, records in runs.items()})
  paths.append(os.path.join(out_dir, "report.md"))
  storage.path(paths[-1]).write_text(f"# Report: {len(runs)} run(s)\n\n{table}\n" + "\n".join(sections))
  return paths

"""Research tooling around runs: hyperparameter sweeps and reports of their metrics.

  sweep.py   get_sweep() grids over any config field, one CSV row per point
  report.py  plots and markdown tables from metrics.jsonl files (experiments.report, notebooks)
"""

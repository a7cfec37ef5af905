"""One record schema for every runtime: the same tiny config on sim, threads and the service.

Each runtime keeps only *when* things happen; what it reports goes through the shared run
shell (decoupled_diloco/run/): learner_summary and summary records must have the same keys
whichever runtime wrote them (a field a runtime does not measure is null, never missing).
"""

import os

import pytest

from decoupled_diloco import experiment, metrics as metrics_lib
from decoupled_diloco.run import records as run_records
from decoupled_diloco.runtime import sim, threads
from experiments.launch_local import LocalCluster
from tests import service_config

SETTINGS = {"outer_steps": 2, "inner_steps": 2, "eval_every": 1, "syncer.quorum": 1}


def _of(path, kind: str) -> list[dict]:
  return [r for r in metrics_lib.read_metrics(os.path.join(path, metrics_lib.METRICS_FILE)) if r["kind"] == kind]


def _in_process(runtime: str, workdir: str) -> None:
  config = service_config.get_config()
  config.update_from_flattened_dict(dict(SETTINGS, runtime=runtime))
  exp = experiment.build(config)
  try:
    {"sim": sim, "threads": threads}[runtime].run(exp, workdir)
  finally:
    for learner in exp.learners:
      learner.batches.close()


@pytest.mark.slow
def test_sim_threads_and_service_write_learner_summaries_and_summaries_with_the_same_keys(tmp_path):
  for runtime in ("sim", "threads"):
    _in_process(runtime, str(tmp_path / runtime))
  overrides = [f"--config.{key}={value}" for key, value in SETTINGS.items()]
  run = LocalCluster("tests/service_config.py", str(tmp_path / "service"), overrides, 2,
                     env=dict(os.environ, DD_SYNCER_TOKEN="t" * 32))
  try:
    run.start()
    assert run.wait(300.0) == {"syncer": 0, "learner_0": 0, "learner_1": 0}
  finally:
    run.stop()

  service = tmp_path / "service"
  learner_summaries = {
      "sim": _of(tmp_path / "sim", "learner_summary"), "threads": _of(tmp_path / "threads", "learner_summary"),
      "service": [r for m in range(2) for r in _of(service / f"learner_{m}", "learner_summary")]}
  summaries = {
      "sim": _of(tmp_path / "sim", "summary"), "threads": _of(tmp_path / "threads", "summary"),
      "service": _of(service, "summary")}
  learner_keys = {"kind", "outer_step", "inner_step", "time", "wall_time", *run_records.LEARNER_SUMMARY_FIELDS}
  summary_keys = {"kind", *run_records.CLOCK_FIELDS, *run_records.SUMMARY_FIELDS}
  for runtime in ("sim", "threads", "service"):
    assert [r["learner"] for r in learner_summaries[runtime]] == [0, 1], runtime
    assert all(r.keys() == learner_keys for r in learner_summaries[runtime]), runtime
    summary, = summaries[runtime]
    assert summary.keys() == summary_keys, runtime
    # The fields every runtime measures are filled in, by each of them.
    assert summary["done"] and summary["eval_loss"] > 0 and summary["outer_updates"] >= 1, runtime
    assert all(r["steps"] > 0 and r["busy_seconds"] > 0 and r["pushes"] >= 1 for r in learner_summaries[runtime])

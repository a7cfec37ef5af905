"""Lockstep runtime: synchronous DiLoCo rounds (and the ddp baseline) in one process.

Each round every group pulls Θ, takes H inner steps, and pushes its pseudo-gradient; the
syncer merges and steps. Inner steps of all groups are dispatched interleaved, step by
step, so groups on disjoint meshes compute concurrently; the only host syncs are at
round ends. Under ddp there is one group and no syncer: a round is just H steps.
"""

import time

from absl import logging

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import metrics as metrics_lib
from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.experiment import Experiment
from decoupled_diloco.run import evaluator, records, schedule, state
from decoupled_diloco.run import monitor as monitor_lib


def _round(exp: Experiment) -> dict:
  """One outer round; returns the outer record's payload."""
  syncer = exp.syncer
  if syncer is not None:
    for learner in exp.learners:
      learner.start_from(syncer.params, syncer.version)
  for _ in range(exp.config.inner_steps):
    for learner in exp.learners:
      learner.step()
  if syncer is None:
    return {}
  norms, reports = [], []
  for learner in exp.learners:  # One push at a time: the syncer buffers it, nothing else holds it.
    push = learner.push()
    norms.append(push.delta_norm)
    reports.append(syncer.receive(push, now=0.0)[1])
  assert reports[-1] is not None and not any(reports[:-1]), "the lockstep syncer merges once per round"
  return {"version": syncer.version, "delta_norms": norms}


def run(exp: Experiment, workdir: str, stop_after: int | None = None) -> dict:
  """Trains `exp` in `workdir`, resuming if asked; returns the final figures.

  `stop_after` ends this invocation after that outer step (a preemptible job's share of
  the run); checkpoint there and a later `resume` continues as if never stopped.
  """
  config = exp.config
  schedule.require_supported(config.mode, "lockstep")
  checkpointer = checkpoint_lib.Checkpointer(storage.makedirs(workdir) / "checkpoints")
  start = checkpointer.latest_step() or 0
  if start and not config.resume:
    checkpointer.close()
    raise ConfigError(f"workdir {workdir} already holds a run (checkpoint at outer step {start}): "
                      "pass --config.resume=True to continue it, or pick a new --workdir")
  if start:
    state.restore(exp, checkpointer, start)
    logging.info("resumed from checkpoint at outer step %d", start)
  elif config.resume:
    logging.warning("resume=True, but %s holds no checkpoint: starting a fresh run", workdir)
  # Records an interrupted run wrote after its last checkpoint (or before its first) are dropped.
  monitor = monitor_lib.Monitor.for_config(config, exp.corpus.optimal_loss)
  writer = metrics_lib.MetricsWriter(workdir, resume_from_step=start, observer=monitor.observe)
  begin, eval_loss, outer_step = time.time(), None, start
  try:
    last = config.outer_steps if stop_after is None else min(stop_after, config.outer_steps)
    for outer_step in range(start + 1, last + 1):
      outer_record = _round(exp)
      wall = time.time() - begin
      for learner in exp.learners:
        for record in records.train_records(learner, outer_step, config.log_every, {"wall_time": wall}):
          writer.write(record)
      clock = {
          "outer_step": outer_step, "inner_step": outer_step * config.inner_steps,
          "tokens": outer_step * exp.plan.tokens_per_round, "wall_time": wall}
      if outer_record:
        writer.write({"kind": "outer", **clock, **outer_record})
      if outer_step % config.eval_every == 0 or outer_step == config.outer_steps:
        record = evaluator.evaluate(exp, clock)
        eval_loss = record["eval_loss"]
        writer.write(record)  # The monitor prints the progress line and judges the loss.
      if outer_step % config.checkpoint_every == 0 or outer_step == last or monitor.diverged:
        writer.sync()  # Every record up to this checkpoint is durable before it is.
        state.save(checkpointer, exp, outer_step, state.metadata(exp, outer_step))
      if monitor.diverged:
        break
    if outer_step > start and (outer_step == config.outer_steps or monitor.diverged):
      # Only what a resumed run restores: its summary equals an uninterrupted run's (wall_time aside).
      writer.write(
          records.summary(clock, eval_loss=eval_loss, optimal_loss=exp.corpus.optimal_loss,
                          outer_updates=exp.syncer.version if exp.syncer else outer_step,
                          steps=[l.steps for l in exp.learners], steps_done=sum(l.steps for l in exp.learners),
                          done=not monitor.diverged, diverged=bool(monitor.diverged)))
  finally:
    writer.close()
    checkpointer.close()
  return {"eval_loss": eval_loss, "optimal_loss": exp.corpus.optimal_loss, "diverged": monitor.diverged}

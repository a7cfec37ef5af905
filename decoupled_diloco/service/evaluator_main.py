"""The evaluator process (`experiments.train --role=evaluator --syncer=HOST:PORT`): evaluation off the syncer.

Why a process of its own (service.evaluate_on='evaluator', issue 16): at 1B one eval is ~4e15
FLOPs and 150 GB of XLA temporaries, which the syncer's host CPU must never run (every
learner waits on the syncer). This process runs the model on its own devices and reads Θ
like a learner, with a read-only credential, one fragment at a time until a pass in which
none moved, so the Θ it evaluates is exactly the syncer's at one version. How it reads,
records and ends: docs/evaluation.md.
"""

import os
import signal
import threading

from absl import logging
import jax
import optax

from decoupled_diloco import experiment, fragments, inner, mesh, metrics as metrics_lib, model as model_lib, shards
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import evaluator as evaluator_lib
from decoupled_diloco.run import monitor as monitor_lib
from decoupled_diloco.run import schedule
from decoupled_diloco.service import runconfig, security, shardclient

POLL_SECONDS = 0.5  # How often the run's status is asked for (a header only, no Θ).
MAX_PASSES = 8  # Read passes over the fragments before giving up on a Θ that keeps moving (read again next poll).


def build_evaluate(config, devices) -> tuple:
  """(evaluate(params) -> mean held-out loss, EvalSet): the model's loss jitted on the evaluator's layout."""
  layout = runconfig.evaluator_layout(config)
  if len(devices) < layout.devices:
    raise ConfigError(f"the evaluator's layout {layout} needs {layout.devices} devices but this process has "
                      f"{len(devices)}: start it where it has them, or set --config.service.evaluator_devices")
  tokenizer_lib.resolve_model_vocab(config)
  corpus = sources.load_corpus(config.data, config.model.seq_len, train=False)  # Eval text only.
  evals = evaluator_lib.EvalSet.from_corpus(config, corpus)
  model, shapes, param_axes = model_lib.abstract_params(config.model)  # Θ comes from the syncer: no init here.
  loop = inner.build_inner_loop(model, optax.identity(), mesh.group_mesh(devices[:layout.devices], layout), shapes,
                                param_axes)
  return (lambda params: evals.mean_loss(lambda p, batch: loop.loss(p, loop.put_batch(batch)), loop.put_params(params))
         ), evals


class EvaluatorProcess:
  """Reads Θ from the syncer as it moves and evaluates it, until the syncer says Θ is final."""

  def __init__(self, config, workdir: str, target: str):
    service = runconfig.validate(config)
    if service.evaluate_on != "evaluator":
      raise ConfigError(f"--role=evaluator needs --config.service.evaluate_on=evaluator (it is "
                        f"{service.evaluate_on!r}: the syncer would not wait for the evaluator's final read)")
    _, shapes, _ = model_lib.abstract_params(config.model)
    self.assignment = experiment.fragment_assignment(config, shapes)
    self.client = shardclient.connect(target, service, security.EVALUATOR,
                                      shards.ShardMap.of(shapes, self.assignment, service.shards), self.assignment)
    evaluate, evals = build_evaluate(config, jax.devices())
    self.monitor = monitor_lib.Monitor.for_config(config, evals.optimal_loss)  # Progress lines, divergence.
    self.writer = metrics_lib.MetricsWriter(os.path.join(workdir, metrics_lib.EVALUATOR_DIR),
                                            observer=self.monitor.observe)
    self.evaluator = evaluator_lib.Evaluator(evaluate, evals, self.writer.write, max_waiting=1)
    self.num_fragments = max(self.assignment) + 1
    self.eval_due = schedule.Every(schedule.RunPlan.from_config(config).tokens_per_eval)
    self.held: list = [None] * self.num_fragments  # Θ_p as last read...
    self.versions = [-1] * self.num_fragments  # ...and its version (-1: not read yet).
    self.stop = threading.Event()

  def read(self) -> dict | None:
    """Brings the held Θ to one version of the syncer's (see the module doc); returns the status of the
    last pull (its `version` is the held Θ's), or None if Θ moved in every one of MAX_PASSES passes."""
    for _ in range(MAX_PASSES):
      for fragment in range(self.num_fragments):
        status, theta = self.client.pull(self.versions[fragment], fragment)
        if theta is not None:
          self.held[fragment], self.versions[fragment] = theta, status["versions"][fragment]
      if status["versions"] == self.versions:
        return status
    logging.warning("Θ moved during %d read passes: reading it again at the next poll", MAX_PASSES)
    return None

  def run(self) -> dict:
    """Evaluates Θ whenever the tokens cross the eval cadence, and the final Θ; returns the summary record."""
    evaluated = None  # Version of the newest Θ submitted.
    while True:
      status = self.client.heartbeat()
      if status["final"] or self.eval_due.due(status["tokens"]):
        status = self.read()
        if status is not None and status["version"] != evaluated:
          self.evaluator.submit(fragments.combine(self.held, self.assignment), _clock(status))
          evaluated = status["version"]
        if status is not None and status["final"]:
          break
      if self.stop.wait(POLL_SECONDS):
        raise SystemExit("evaluator stopped (SIGTERM) before the run's end: start it again to go on")
    self.evaluator.close()
    last = self.evaluator.last or {}
    summary = {
        "kind": "evaluator_summary", **_clock(status), "eval_loss": last.get("eval_loss"),
        "evaluated_version": last.get("outer_step"), "evals_skipped": self.evaluator.skipped,
        "pulled_bytes": self.client.pulled_bytes, "diverged": bool(self.monitor.diverged)}
    self.writer.write(summary)
    return summary

  def close(self) -> None:
    """Finishes the evals under way, then releases the channel and the metrics file."""
    try:
      self.evaluator.close()
    finally:
      self.client.close()
      self.writer.close()


def _clock(status: dict) -> dict:
  """The syncer's clock at a read: Θ's version (the sum of its fragments' `versions`, each fragment's own),
  mean inner steps per learner, tokens, run seconds."""
  return {
      "outer_step": status["version"], "versions": list(status["versions"]), "inner_step": status["inner_step"],
      "tokens": status["tokens"], "time": status["wall_time"], "wall_time": status["wall_time"]}


def run(config, workdir: str, target: str) -> dict:
  """Evaluates the run served at `target` until its Θ is final; returns the evaluator's summary."""
  process = EvaluatorProcess(config, workdir, target)
  signal.signal(signal.SIGTERM, lambda *_: process.stop.set())
  try:
    return process.run()
  finally:
    process.close()

"""Virtual-clock checkpoints: a simulation stopped anywhere continues as if it never stopped.

Why a blob besides the trees: rounds do not exist on the virtual clock (pushes are on the
wire, merges wait, every learner is somewhere in its period), so a checkpoint holds the
whole simulation between two events: the device trees as every in-process runtime saves
them (run/state.py), and everything else pickled into one host byte array in the same orbax
step, so both are written or neither (what it holds: docs/runtimes.md).
"""

import io
import itertools
import json
import pickle
import time

from absl import logging
import jax
import numpy as np

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import schedule
from decoupled_diloco.run import state as state_lib

BLOB = "simulation"  # The orbax item holding the pickled host state.
# A learner's host state besides its trees (its error-feedback residuals are one of those: run/state.py).
_LEARNER_FIELDS = ("anchors", "base_versions", "tokens_since_push", "steps_since_push", "pushed")
_FRAGMENT_FIELDS = ("pending", "deadline", "window_start", "accumulator", "norms", "held")
_SIMULATION_FIELDS = ("now", "clocks", "rngs", "speeds", "steps_left", "eval_due", "waiting", "last_eval")


class _HostPickler(pickle.Pickler):
  """Pickles jax.Arrays as numpy arrays (a device buffer cannot be pickled by reference)."""

  def reducer_override(self, obj):
    if isinstance(obj, jax.Array):
      return np.asarray, (np.asarray(obj),)
    return NotImplemented


def _host_state(simulation) -> dict:
  """Everything but the orbax trees, as plain picklable values."""
  exp, syncer = simulation.exp, simulation.syncer
  learners = []
  for learner in exp.learners:
    pending = learner._pending_metrics  # pylint: disable=protected-access
    metrics = jax.device_get([values for _, values in pending])
    learners.append({
        **{f: getattr(learner, f) for f in _LEARNER_FIELDS}, "pending_losses": [
            (step, jax.tree.map(np.asarray, v)) for (step, _), v in zip(pending, metrics)]})
  sequence = next(simulation._sequence)  # pylint: disable=protected-access
  return {
      "learners": learners,
      "events": [
          (at, priority, seq, handler.__name__, payload) for at, priority, seq, handler, payload in simulation._events],  # pylint: disable=protected-access
      "sequence": sequence,
      "wall_seconds": time.time() - simulation._begin,  # pylint: disable=protected-access
      **{f: getattr(simulation, f) for f in _SIMULATION_FIELDS},
      "syncer": None if syncer is None else {
          "fragments": [{f: getattr(fragment, f) for f in _FRAGMENT_FIELDS} for fragment in syncer.fragments],
          "counts": syncer.counts, "estimates": syncer.estimates}}


class Cadence:
  """Calls `save` between events once per checkpoint_every rounds' worth of tokens (a round: H steps of
  every learner), while budget is left; the final checkpoint is the runtime's. Its only state, the
  marks passed, follows from the tokens, so a resumed run checkpoints where the first would have."""

  def __init__(self, checkpointer: checkpoint_lib.Checkpointer, simulation):
    self.checkpointer, self.simulation = checkpointer, simulation
    self.every = schedule.Every(simulation.plan.tokens_per_checkpoint)
    self.every.due(simulation.tokens)  # Marks a resumed run has passed already.

  def __call__(self) -> None:
    if self.every.due(self.simulation.tokens) and self.simulation.steps_left > 0:
      save(self.checkpointer, self.simulation)


def save(checkpointer: checkpoint_lib.Checkpointer, simulation, done: bool = False,
         summary: dict | None = None) -> None:
  """Checkpoints `simulation` between two events (or at its end: `done`), with its records count."""
  exp = simulation.exp
  buffer = io.BytesIO()
  _HostPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(_host_state(simulation))
  blob = np.frombuffer(buffer.getvalue(), np.uint8)
  meta = state_lib.metadata(exp, exp.syncer.version if exp.syncer is not None else 0,
                            records=simulation.writer.records, blob_bytes=int(blob.size), done=done,
                            **({"summary": summary} if summary is not None else {}))
  simulation.writer.sync()  # The records the metadata counts are durable before the checkpoint is.
  state_lib.save(checkpointer, exp, sum(l.steps for l in exp.learners), meta, **{BLOB: {"bytes": blob}})


def _comparable(config_dict: dict) -> str:
  return json.dumps({k: v for k, v in config_dict.items() if k != "resume"}, sort_keys=True, default=str)


def latest(checkpointer: checkpoint_lib.Checkpointer, exp, workdir: str) -> dict | None:
  """The metadata of the checkpoint to resume from (None: start afresh), after refusing a workdir
  that holds another run, a finished one, or a run of a different config."""
  step = checkpointer.latest_step()
  if step is None:
    if exp.config.resume:
      logging.warning("resume=True, but %s holds no checkpoint: starting a fresh run", workdir)
    return None
  metadata = checkpointer.restore_metadata(step)
  if not exp.config.resume:
    raise ConfigError(f"workdir {workdir} already holds a run (checkpoint at {step} inner steps): pass "
                      "--config.resume=True to continue it, or pick a new --workdir")
  if metadata.get("done"):
    raise ConfigError(f"workdir {workdir} holds a finished run: its budget is spent; pick a new --workdir")
  if _comparable(metadata["config"]) != _comparable(json.loads(json.dumps(exp.config.to_dict(), default=str))):
    raise ConfigError(f"workdir {workdir} holds a run of another config: resume it with the same flags, "
                      "only --config.resume=True added")
  return {**metadata, "step": step}


def restore(checkpointer: checkpoint_lib.Checkpointer, simulation, metadata: dict) -> None:
  """Puts `simulation` back where checkpoint `metadata['step']` left it."""
  exp, syncer, step = simulation.exp, simulation.syncer, metadata["step"]
  state_lib.restore(exp, checkpointer, step)
  logging.info("resumed from checkpoint at %d inner steps", step)
  blob, _ = checkpointer.restore(step, {BLOB: {"bytes": np.zeros(metadata["blob_bytes"], np.uint8)}})
  state = pickle.loads(blob[BLOB]["bytes"].tobytes())
  for learner, saved in zip(exp.learners, state["learners"]):
    saved.setdefault("pushed", {})  # Written before Learner.take kept θ_p as pushed: nothing kept.
    for field in _LEARNER_FIELDS:
      setattr(learner, field, saved[field])
    # Written before steps kept their router metrics: a loss alone.
    learner._pending_metrics = [  # pylint: disable=protected-access
        (step, v if isinstance(v, dict) else {"loss": v}) for step, v in saved["pending_losses"]]
  for field in _SIMULATION_FIELDS:
    setattr(simulation, field, state[field])
  simulation._events = [
      (at, priority, seq, getattr(simulation, name), payload)  # pylint: disable=protected-access
      for at, priority, seq, name, payload in state["events"]]
  simulation._sequence = itertools.count(state["sequence"])  # pylint: disable=protected-access
  simulation._begin = time.time() - state["wall_seconds"]  # pylint: disable=protected-access
  if syncer is not None:
    for fragment, saved in zip(syncer.fragments, state["syncer"]["fragments"]):
      saved.setdefault("norms", [])  # Written before robust merges: no norms, nothing held.
      saved.setdefault("held", [])
      for field in _FRAGMENT_FIELDS:
        setattr(fragment, field, saved[field])
      fragment.accumulator = syncer.adopt(fragment.accumulator)
    syncer.counts = state["syncer"]["counts"]
    syncer.restore_estimates(state["syncer"]["estimates"])

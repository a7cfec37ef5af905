"""The run's checkpointed state, one layout for every in-process runtime (lockstep, sim, threads)."""

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco.syncer import SyncerState


def run_state(exp) -> dict:
  """The pytrees a checkpoint holds: the syncer's (host) and every learner's (device, as block_i's
  whatever scan_layers says, so a run may switch it between resumes), with its error-feedback residuals
  (host) when the codec keeps them."""
  state = {f"learner_{l.index}": l.loop.from_step(l.state) for l in exp.learners}
  state.update({f"learner_{l.index}_residuals": l.feedback_state() for l in exp.learners if l.codec.error_feedback})
  if exp.syncer is not None:
    state["syncer_params"] = exp.syncer.params
    state["syncer_opt_state"] = exp.syncer.state.opt_state
  return state


def metadata(exp, outer_step: int, **extra) -> dict:
  """What a checkpoint says about itself: the step, the config, Θ's versions, the data positions, `extra`."""
  return {
      "outer_step": outer_step, "config": exp.config.to_dict(),
      "syncer_versions": exp.syncer.versions if exp.syncer is not None else None,
      "data": [learner.batches.state() for learner in exp.learners], **extra}


def save(checkpointer: checkpoint_lib.Checkpointer, exp, step: int, meta: dict, **items) -> None:
  """Saves the run's state (plus runtime-specific `items`) as checkpoint `step`: every runtime's
  periodic and final checkpoints."""
  checkpointer.save(step, {**run_state(exp), **items}, meta)


def restore(exp, checkpointer: checkpoint_lib.Checkpointer, step: int) -> dict:
  """Loads checkpoint `step` into the experiment, each tree back onto its own devices; returns its metadata."""
  abstract = checkpoint_lib.abstract_like(run_state(exp))
  state, meta = checkpointer.restore(step, abstract)
  for learner, data_state in zip(exp.learners, meta.get("data") or [None] * len(exp.learners)):
    learner.restore(state[f"learner_{learner.index}"], data_state)
    learner.residuals = state.get(f"learner_{learner.index}_residuals", learner.residuals)
  if exp.syncer is not None:
    exp.syncer.restore(SyncerState(state["syncer_params"], state["syncer_opt_state"], tuple(meta["syncer_versions"])))
  return meta

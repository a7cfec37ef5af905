"""Run-state checkpoints at outer-step boundaries, built on an orbax CheckpointManager.

A run's state is a dict of named pytrees that live in two places at once (the syncer's host
numpy arrays, every learner's jax.Arrays sharded over its own mesh), plus a JSON metadata
dict. Why an abstract tree on restore: it fixes each leaf's placement (a sharded
ShapeDtypeStruct or jax.Array: that sharding; a numpy array: the host), so one learner's
state never lands on another's devices. Digests of every array checked on restore turn
flipped bytes into `CorruptCheckpoint`, and saves are synchronous and atomic (orbax's tmp
directory and rename). The conventions in full: docs/storage.md.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from decoupled_diloco import storage

PyTree = Any

# The composite item that holds the JSON metadata; no state entry may use this name.
METADATA_ITEM = "metadata"
# The metadata key that holds the arrays' digests (callers never see it).
CHECKSUMS_KEY = "_checksums"

_ORBAX_DIR = os.path.dirname(ocp.__file__)


def _from_orbax(traceback) -> bool:
  """Whether a traceback passes through orbax's code."""
  while traceback is not None:
    if traceback.tb_frame.f_code.co_filename.startswith(_ORBAX_DIR):
      return True
    traceback = traceback.tb_next
  return False


class _SaveFailureTracebacks(logging.Filter):
  """Drops the tracebacks orbax's writer threads log when a save fails (one each, some after the save raised), and
  asyncio's 'Future exception was never retrieved' of that save's other writes: the save raises the error, and its
  caller reports it in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or not record.exc_info:
      return True
    return not (os.path.dirname(record.pathname).startswith(_ORBAX_DIR) or _from_orbax(record.exc_info[2]))


def _ignore_closed_loop_callbacks(previous):
  """An unraisable-error hook that drops tensorstore's late callbacks onto the event loop of a save that failed
  (RuntimeError 'Event loop is closed', one traceback per array written) and passes anything else on."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)

  hook.quiets_closed_loops = True
  return hook


def _one_line_per_failed_save() -> None:
  """Installs (once) what keeps a failed save (a full disk) to its caller's one line. Why: each of orbax's writer
  threads logged its traceback, then TensorStore's writes still in flight printed theirs as they finished, after
  the save had raised: 30 tracebacks per failed save, and a save is retried."""
  if getattr(sys.unraisablehook, "quiets_closed_loops", False):
    return
  sys.unraisablehook = _ignore_closed_loop_callbacks(sys.unraisablehook)
  for name in ("absl", "asyncio"):
    logging.getLogger(name).addFilter(_SaveFailureTracebacks())


def first_line(error: BaseException) -> str:
  """An error's first line (its type's name if it has no text): what a one-line log of a failed save or restore
  quotes, as orbax's and tensorstore's errors run over many lines."""
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


class CorruptCheckpoint(ValueError):
  """A checkpoint's arrays do not match the digests written with them."""


def digests(state: dict[str, PyTree]) -> dict[str, dict[str, str]]:
  """{item: {leaf path: blake2b of its bytes, dtype and shape}} for every leaf this process holds whole.

  Why not all leaves: a learner group's state is sharded over several processes, none of
  which can read every shard; orbax's own per-chunk checks are all there is for those.
  """
  out = {}
  for name, tree in state.items():
    out[name] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        continue
      array = np.ascontiguousarray(jax.device_get(leaf))
      digest = hashlib.blake2b(f"{array.dtype}{array.shape}".encode(), digest_size=16)
      digest.update(array.data if array.size else b"")
      out[name][jax.tree_util.keystr(path)] = digest.hexdigest()
  return out


def abstract_like(tree: PyTree) -> PyTree:
  """Abstract restore target with `tree`'s structure, shapes, dtypes and placement.

  Why: a resumed run builds a fresh state (same structure, same meshes) and restores
  the checkpoint into that layout; jax.Arrays become sharded ShapeDtypeStructs and
  numpy leaves stay numpy (they only mark "restore this on the host").
  """

  def leaf(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x

  return jax.tree.map(leaf, tree)


def _check_abstract_leaf(name: str, path, leaf) -> None:
  """Rejects restore targets whose placement would be ambiguous."""
  where = f"{name}{jax.tree_util.keystr(path)}"
  if isinstance(leaf, jax.ShapeDtypeStruct):
    if leaf.sharding is None:
      raise ValueError(f"abstract leaf {where} is a ShapeDtypeStruct without a sharding: attach the "
                       "learner's NamedSharding, or pass a numpy array to restore it on the host")
  elif not isinstance(leaf, (jax.Array, np.ndarray)):
    raise ValueError(f"abstract leaf {where} has type {type(leaf).__name__}: use a sharded "
                     "jax.ShapeDtypeStruct (device) or a numpy array (host)")


def _check_names(names) -> None:
  """The metadata item shares the step directory with the state items."""
  if METADATA_ITEM in names:
    raise ValueError(f"state key {METADATA_ITEM!r} is reserved for the metadata dict: rename it")


def _registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """Every state item is written uncompressed, the metadata as JSON.

  Why no compression: orbax's default zstd keeps encoder buffers of about twice the saved bytes, so a
  save of the syncer's Θ and momentum (8 B/param) peaked at +17 B/param and left +14 B/param behind
  (docs/syncer-memory.md); uncompressed, a save holds a few tensors in flight and keeps nothing.
  Float parameters barely compress anyway. Reading is unchanged: older compressed checkpoints restore.
  """
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  arrays = ocp.PyTreeCheckpointHandler(use_compression=False)
  for args in (ocp.args.PyTreeSave, ocp.args.PyTreeRestore):
    registry.add(None, args, arrays)
  json = ocp.JsonCheckpointHandler()
  for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
    registry.add(None, args, json)
  return registry


class Checkpointer:
  """Saves and restores the run state (dict of pytrees + JSON metadata) by step.

  Steps are the trainer's outer steps. `save_interval_steps` follows orbax: a step is
  saved when it is a multiple of the interval (the first save of a Checkpointer is
  always kept); other steps are skipped silently. `max_to_keep` newest steps are kept.
  """

  def __init__(self, directory, max_to_keep: int = 3, save_interval_steps: int = 1, reader: bool = False):
    """`reader`: only to read a directory another process may be saving into (a syncer checking what run a workdir
    holds before it takes the workdir's lock): it neither creates the directory nor removes the tmp directory of a
    save in progress, as a Checkpointer that will save does at start."""
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps,
        preservation_policy=ocp.checkpoint_managers.LatestN(n=max_to_keep),
        cleanup_tmp_directories=not reader,
        # Synchronous: the host numpy leaves may be updated in place by the syncer
        # right after `save` returns, and the caller can trust a returned save.
        enable_async_checkpointing=False,
        create=not reader,
    )
    # storage.path: an absolute local path or gs://...; any other scheme is refused, never made local.
    self._manager = ocp.CheckpointManager(storage.path(directory), options=options, handler_registry=_registry())

  @property
  def directory(self) -> str:
    """Where the step directories live (absolute, or a gs:// URL)."""
    return os.fspath(self._manager.directory)

  def save(self, step: int, state: dict[str, PyTree], metadata: dict) -> None:
    """Writes `state` and `metadata` as step `step`; returns once the step is final.

    Why synchronous: a checkpoint the trainer believes it has must already be
    restorable, and a crash mid-save must leave only a tmp dir that is ignored.
    """
    _check_names(state)
    items = {name: ocp.args.PyTreeSave(tree) for name, tree in state.items()}
    items[METADATA_ITEM] = ocp.args.JsonSave({**metadata, CHECKSUMS_KEY: digests(state)})
    _one_line_per_failed_save()
    try:
      self._manager.save(step, args=ocp.args.Composite(**items))
      self._manager.wait_until_finished()
    except Exception:
      # A failed save (e.g. a full disk) leaves its tmp dir behind: free that space now, not at the next start.
      tmp = self._manager.directory / f"{step}.orbax-checkpoint-tmp"
      try:
        tmp.rmtree(missing_ok=True)
      except OSError:
        pass  # The save's own error is the one to report; orbax removes the rest at the next start.
      raise

  def all_steps(self) -> list[int]:
    """Finished steps on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Newest finished step, or None; half-written (tmp) steps are never returned."""
    return self._manager.latest_step()

  def restore(self, step: int, abstract_state: dict[str, PyTree]) -> tuple[dict, dict]:
    """Restores `(state, metadata)` of `step` into the layout of `abstract_state`.

    Why an abstract tree: it fixes each leaf's placement (learner mesh or host) and the
    exact container types (optax namedtuples included), independent of the writer.
    """
    self._check_step(step)
    _check_names(abstract_state)
    for name, tree in abstract_state.items():
      jax.tree_util.tree_map_with_path(lambda p, x, n=name: _check_abstract_leaf(n, p, x), tree)
    items = {
        name: ocp.args.PyTreeRestore(tree, restore_args=ocp.checkpoint_utils.construct_restore_args(tree))
        for name, tree in abstract_state.items()}
    items[METADATA_ITEM] = ocp.args.JsonRestore()
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    state = {name: restored[name] for name in abstract_state}
    metadata = dict(restored[METADATA_ITEM])
    expected = metadata.pop(CHECKSUMS_KEY, None)  # None: written before checkpoints carried digests.
    if expected is not None:
      got = digests(state)
      for name, leaves in got.items():
        for path, digest in leaves.items():
          if expected.get(name, {}).get(path, digest) != digest:
            raise CorruptCheckpoint(f"checkpoint step {step} in {self.directory} is corrupt: {name}{path} does "
                                    "not match the digest written with it")
    return state, metadata

  def restore_metadata(self, step: int) -> dict:
    """Only the metadata of `step`, e.g. to read the config before building state."""
    self._check_step(step)
    restored = self._manager.restore(step, args=ocp.args.Composite(**{METADATA_ITEM: ocp.args.JsonRestore()}))
    return {k: v for k, v in restored[METADATA_ITEM].items() if k != CHECKSUMS_KEY}

  def quarantine(self, step: int) -> str:
    """Moves an unusable step aside (kept for inspection, no longer a step); returns where it went.

    Why not delete: an operator may want the bytes; why not leave it: a later save of the
    same step, and `latest_step`, must not meet it.
    """
    self._check_step(step)
    source = self._manager.directory / str(step)
    target = source.rename(f"{source}.corrupt")
    self._manager.reload()
    return os.fspath(target)

  def _check_step(self, step: int) -> None:
    """Names the available steps instead of surfacing a deep orbax path error."""
    if step not in self._manager.all_steps():
      raise ValueError(f"no finished checkpoint for step {step} in {self.directory}: "
                       f"available steps are {self.all_steps()}")

  def close(self) -> None:
    """Waits for pending orbax work (e.g. pruning) and releases its threads."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

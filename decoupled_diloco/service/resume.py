"""Whether a syncer may start in a workdir: a fresh run, or a resume of the same run, and nothing else.

Why before anything is written: a syncer that resumed the wrong state, or silently started a
fresh run beside it, cost the run. Before these checks a changed `service.shards` (its state
lives in <workdir>/checkpoints with one syncer, <workdir>/shards/<s>/ with several) started
version 0 beside the old state, `resume=True` on a workdir holding no run started afresh
without a word, and a resumed syncer took a changed compression format. So `check` reads the
config the run was checkpointed with (any shard layout's), and refuses (ConfigError, one line,
exit 2 in experiments.train) a config whose LAYOUT differs, a fresh start over a run, and a
resume with nothing to resume in a workdir that holds files; `resume=True` on an empty workdir
says in one line that it starts a fresh run.
"""

import os

from absl import logging

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import storage
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import fingerprint, shardrun

# Config fields that fix the layout of the run's checkpointed state and of the pushes its log holds.
# service.shards first: a changed one changes fragments or the evaluator too, and is the one to name.
LAYOUT = ("service.shards", "model", "streaming.num_fragments", "streaming.strategy", "outer.optimizer",
          "learners.devices", "compression.format", "compression.block_size", "compression.topk_fraction",
          "compression.error_feedback")
LAUNCHER_FILES = ("logs",)  # What launchers put in a workdir before its syncer starts (launch_local's logs).


def check(config, workdir: str, shard_workdir: str) -> None:
  """Raises ConfigError unless the syncer of `config` may start in `shard_workdir` (`workdir` for one syncer).

  `workdir`: the run's; a shard's state is in a folder of it (service/shardrun.py), and every other place a
  syncer keeps checkpoints is read too, so that another `service.shards` is refused rather than started beside
  the old state (the sibling shards of a fresh sharded run, starting at once, are no obstacle).
  """
  own = os.path.join(shard_workdir, "checkpoints")
  saved = saved_config(own)
  if saved is not None:
    if not config.resume:
      raise ConfigError(f"workdir {workdir} already holds a syncer run: pass --config.resume=True to continue it "
                        "(launch_local does on restarts), or pick a new --workdir")
    _check_same_layout(config, saved, workdir)
    return
  other = next((found for found in map(saved_config, _checkpoint_dirs(workdir, own)) if found is not None), None)
  if other is not None and (config.resume or other.get("service", {}).get("shards", 1) != config.service.shards):
    _check_same_layout(config, other, workdir)  # Refuses another service.shards, or any other layout field.
  if config.resume and _holds_files(workdir):
    raise ConfigError(f"--config.resume=True but workdir {workdir} holds no syncer checkpoint of this "
                      f"{'shard' if other is not None else 'run'} to resume from: pick a new --workdir, or empty it "
                      "to start afresh")
  if config.resume:
    logging.warning("--config.resume=True: workdir %s holds no run yet, so this syncer starts a fresh one", workdir)


def saved_config(checkpoints: str) -> dict | None:
  """The config the newest readable checkpoint in `checkpoints` was saved with; None when there is none."""
  if not _has_checkpoints(checkpoints):
    return None
  with checkpoint_lib.Checkpointer(checkpoints, reader=True) as checkpointer:  # Another shard may be saving.
    for step in reversed(checkpointer.all_steps()):
      try:
        saved = checkpointer.restore_metadata(step).get("config")
      except Exception:  # pylint: disable=broad-except  # A damaged one: the core's fallback reports it.
        continue
      if saved is not None:
        return saved
  return None


def _has_checkpoints(checkpoints: str) -> bool:
  """Whether `checkpoints` exists and holds anything (opened only then: a Checkpointer creates its folder)."""
  directory = storage.path(checkpoints)
  return directory.is_dir() and any(directory.iterdir())


def _checkpoint_dirs(workdir: str, own: str) -> list[str]:
  """Every other place (than `own`) a syncer of `workdir` keeps checkpoints, in either layout: one syncer's and
  each shard's."""
  shards = storage.path(workdir) / "shards"
  found = sorted(int(p.name) for p in shards.iterdir() if p.name.isdigit()) if shards.is_dir() else []
  places = [os.path.join(workdir, "checkpoints")] + [
      os.path.join(shardrun.shard_workdir(workdir, s), "checkpoints") for s in found]
  return [place for place in places if place != own]


def _holds_files(workdir: str) -> bool:
  """Whether `workdir` holds anything but what a launcher puts there before the syncer starts."""
  directory = storage.path(workdir)
  return directory.is_dir() and any(p.name not in LAUNCHER_FILES for p in directory.iterdir())


def _check_same_layout(config, saved: dict, workdir: str) -> None:
  """Refuses (ConfigError naming the first field) a config whose LAYOUT differs from the run's `saved` one.

  Why before restoring: orbax would fail deep inside with advice (partial restore) that is
  wrong here, or worse, restore fine and mix formats; the field that changed is what the operator needs to know.
  """
  now = config.to_dict()
  for field in LAYOUT:
    old, new = fingerprint.field_value(saved, field), fingerprint.field_value(now, field)
    for name, old_value, new_value in _differences(field, old, new):
      raise ConfigError(f"{name} is {new_value!r} but the run in {workdir} was checkpointed with {old_value!r}: "
                        f"resume with the same {name}, or start a new --workdir")


def _differences(name: str, old, new):
  """(dotted name, old, new) of every leaf that differs between two config values (JSON round trip aside)."""
  if isinstance(old, dict) and isinstance(new, dict):
    for key in sorted(set(old) | set(new)):
      yield from _differences(f"{name}.{key}", old.get(key), new.get(key))
  elif (list(old) if isinstance(old, (list, tuple)) else old) != (list(new) if isinstance(new, (list, tuple)) else new):
    yield name, old, new

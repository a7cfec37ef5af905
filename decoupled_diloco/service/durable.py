"""Where the syncer's state lives on disk: its write-ahead log and verified checkpoints, fail-stop.

`Store` owns both and nothing of the state machine: `SyncerCore` decides what to log and
what a checkpoint holds, the store makes it durable. Why fail-stop: the syncer must not run
ahead of what it can make durable, so a failed append stops the store for good (`Stopped`)
and a restart from the log holds every acknowledged push. Checkpoints rotate the log
segment first (a crash between the two leaves a replayable pair), and each start takes the
next syncer incarnation (docs/service-durability.md).
"""

import os

from absl import logging

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import storage
from decoupled_diloco.service import wal

CHECKPOINT_RETRY_SECONDS = 10.0  # Between attempts after a checkpoint save failed (e.g. a full disk).
INCARNATION_FILE = "syncer.incarnation"


class Stopped(RuntimeError):
  """The syncer can no longer make new state durable (its log failed): it serves nothing more."""


class Store:
  """The log and checkpoints of one syncer workdir; callers hold the core's lock."""

  def __init__(self, directory: str, truncate_corrupt_log: bool = False, local_dir: str | None = None):
    self.directory = directory  # Checkpoints: local or gs:// (storage.py).
    self.local_dir = local_dir or directory  # What needs fsync: the log and the incarnation (service.local_dir).
    self.checkpointer = checkpoint_lib.Checkpointer(storage.path(directory) / "checkpoints", max_to_keep=2)
    self.wal_dir = os.path.join(self.local_dir, "wal")
    self.log: wal.Log | None = None
    self.truncate_corrupt_log = truncate_corrupt_log  # The operator gives up records after a corrupt one.
    self.failed: Stopped | None = None  # Set once the log failed: fail-stop, the process must exit.
    self.retry_at = 0.0  # After a failed checkpoint save, the next one not before this time.
    self.log_lost = False  # Restored without any log: the local dir was lost (restore_usable).

  def next_incarnation(self, checkpointed: int) -> int:
    """The workdir's syncer incarnation, one more than the last start's (1 for the first), durable before use.

    Why files of their own, not a log record: it must never repeat, even after the operator truncated a corrupt
    log or restored an older checkpoint. One is in the local dir (fsync), one on the workdir, which outlives a lost
    local dir (a new VM); `checkpointed`: the incarnation the restored checkpoint was saved by (0: none).
    """
    places = dict.fromkeys(os.path.join(where, INCARNATION_FILE) for where in (self.local_dir, self.directory))
    last = max([checkpointed, *map(_read_incarnation, places)])
    os.makedirs(self.local_dir, exist_ok=True)
    for place in places:
      storage.replace_text(place, f"{last + 1}\n")
    wal.fsync_directory(self.local_dir)
    return last + 1

  def open_fresh(self) -> None:
    """A new run's log, segment 0."""
    self.log = wal.Log(self.wal_dir, 0)

  def open_after_replay(self, segment: int) -> None:
    """Appends go on after the newest segment's intact records (`segment` if the log has none)."""
    self.log = wal.Log(self.wal_dir, max(wal.segments(self.wal_dir), default=segment))

  def append(self, record: dict, payload=b"") -> wal.Location:
    """Logs one record durably (returns where its payload lies), or stops the store (fail-stop) and raises
    Stopped."""
    return self._durably(self.log.append, record, payload)

  def spool(self, nbytes: int, read) -> wal.Spool:
    """A payload of `nbytes` streamed by `read` into a spool file beside the log (`wal.Spool`). A disk that
    fails it stops the store (Stopped) as a failed append would: the log could not take the push either.
    Called without the core's lock (it waits on the sender)."""
    spool = wal.Spool(self.wal_dir, nbytes)
    try:
      return self._durably(spool.fill, read)
    except BaseException:
      spool.close()
      raise

  def _durably(self, write, *args):
    """Runs a log write; if it fails, the syncer stops serving (fail-stop) rather than run ahead of its log.

    Nothing the failed write was about has been applied or acknowledged (validate → log →
    apply → ack), so a restart from the log holds every acknowledged push.
    """
    try:
      return write(*args)
    except wal.LogWriteError as error:
      self.failed = Stopped(f"the syncer stopped serving: {error}; free the disk, then restart it with "
                            "--config.resume=True (nothing acknowledged is lost)")
      logging.error("%s", self.failed)
      raise self.failed from error

  def serving(self) -> None:
    """Raises Stopped once the log has failed: no call may see state the log does not hold."""
    if self.failed is not None:
      raise self.failed

  def latest_step(self) -> int | None:
    """The newest checkpoint's version (None: a fresh workdir)."""
    return self.checkpointer.latest_step()

  def rotate(self, version: int, carried: list[tuple[dict, bytes | wal.Location]]) -> list[wal.Location]:
    """Starts log segment `version` with `carried` (what checkpoint `version` will not hold); returns where
    their payloads now lie. Run before `save`; a failed rotation is fail-stop."""
    return self._durably(self.log.rotate, version, carried)

  def save(self, version: int, trees: dict, meta: dict, now: float) -> bool:
    """Saves checkpoint `version` (after `rotate` started its log segment); returns whether it was saved.

    A failed save (a full disk: orbax reports tensorstore's I/O errors as ValueError) is
    logged and retried after CHECKPOINT_RETRY_SECONDS: the log holds everything, so the
    syncer serves on.
    """
    try:
      self.checkpointer.save(version, trees, meta)
    except (OSError, ValueError) as error:
      self.retry_at = now + CHECKPOINT_RETRY_SECONDS
      logging.error("syncer checkpoint at version %d failed (%s): serving on from the log, retrying in %.0fs", version,
                    checkpoint_lib.first_line(error), CHECKPOINT_RETRY_SECONDS)
      return False
    self.log.drop_before(min(self.checkpointer.all_steps()))  # Each kept checkpoint can be replayed from.
    return True

  def restore_usable(self, abstract: dict) -> tuple[int, dict, dict]:
    """(step, state, metadata) of the newest checkpoint that restores, matches its digests and has its log.

    An unusable newer one is moved aside (`<step>.corrupt`): the one before it plus the log
    (kept back to the oldest checkpoint) reach the same state. None usable: CorruptCheckpoint.
    `abstract`: the state's structure, shapes, dtypes and placement (`checkpoint.abstract_like`).
    """
    problems = {}
    # No segment at all: the local dir was lost (a new VM), not a segment; the newest checkpoint is resumed from.
    self.log_lost = not wal.segments(self.wal_dir)
    for step in reversed(self.checkpointer.all_steps()):
      try:
        state, meta = self.checkpointer.restore(step, abstract)
        if not self.log_lost and meta["segment"] not in wal.segments(self.wal_dir):
          raise checkpoint_lib.CorruptCheckpoint(f"its log segment {meta['segment']} is missing from {self.wal_dir}")
      except Exception as error:  # pylint: disable=broad-except  # Damaged files fail orbax in many ways.
        problems[step] = checkpoint_lib.first_line(error)
        logging.error("syncer checkpoint %d is not usable (%s); trying the one before it plus the log", step,
                      problems[step])
        continue
      for bad in problems:  # Moved only now: an older one restored, so the layout is not what failed.
        logging.error("syncer checkpoint %d moved to %s", bad, self.checkpointer.quarantine(bad))
      return step, state, meta
    raise checkpoint_lib.CorruptCheckpoint("no usable syncer checkpoint (" +
                                           "; ".join(f"step {step}: {problem}" for step, problem in problems.items()) +
                                           f"): restore {self.checkpointer.directory} "
                                           "from a backup, or start a new --workdir")

  def records_from(self, first_segment: int):
    """Yields (record, payload, its wal.Location) of every logged record from segment `first_segment` on.

    A corrupt record in the middle of a segment stops start-up (wal.CorruptLog) unless the
    operator asked to truncate there; a torn last record is dropped.
    """
    wal.recover(self.wal_dir, self.truncate_corrupt_log)
    for segment in wal.segments(self.wal_dir):
      if segment >= first_segment:
        yield from wal.records(wal.segment_path(self.wal_dir, segment), segment)

  def close(self) -> None:
    """Closes the log and the checkpointer."""
    if self.log is not None:
      self.log.close()
    self.checkpointer.close()


def _read_incarnation(place: str) -> int:
  """The incarnation an INCARNATION_FILE holds (0 if there is none)."""
  path = storage.path(place)
  if not path.exists():
    return 0
  text = path.read_text().strip()
  if not text.isdigit():
    raise checkpoint_lib.CorruptCheckpoint(f"{place} holds {text[:40]!r}, not a number: write the highest "
                                           "syncer_incarnation learners have seen (or a larger one) into it")
  return int(text)

"""Exclusive ownership of a run directory: one live process per syncer workdir or learner folder.

Two syncers on one workdir delete each other's log and interleave their histories; a
replacement learner would delete the checkpoint its frozen predecessor is still writing.
So every such process first takes an `fcntl.flock` on a lock file in its directory and
keeps it for its lifetime (the kernel releases it when the process dies, SIGKILL
included, so a restart after a crash never finds a stale lock). The holder's host and pid
are written into the file, so a refused process can name who holds the directory.
"""

import fcntl
import os
import socket

from decoupled_diloco.errors import ConfigError


class DirectoryLock:
  """A held lock on `<directory>/<name>`; `release` (or process exit) gives it back."""

  def __init__(self, directory: str, name: str, what: str):
    """Takes the lock or raises ConfigError naming the holder (nothing else is written)."""
    os.makedirs(directory, exist_ok=True)
    self.path = os.path.join(directory, name)
    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(self._fd, 256, 0).decode(errors="replace").strip() or "another process"
      os.close(self._fd)
      raise ConfigError(f"{directory} is in use by {holder} ({what}): stop that process first, or pick another "
                        "directory") from None
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, f"{what} pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    os.fsync(self._fd)

  def release(self) -> None:
    """Gives the directory back (the file stays: removing it would race a waiting process)."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

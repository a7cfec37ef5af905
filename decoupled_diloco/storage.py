"""One file-system layer for every path a run writes or reads: local directories and gs:// buckets.

Why etils.epath: orbax, flax and TFDS already bring it and orbax routes its own step directories
through it, so metrics, TensorBoard, checkpoints, sweeps and reports all see one notion of a path.
For gs:// epath uses fsspec + gcsfs (installed with this package); it would switch to TensorFlow's
gfile whenever TensorFlow is importable, so this module pins it to fsspec (EPATH_USE_TF=false unless
the environment says otherwise): one backend, the one the tests run against a GCS emulator.

Any other scheme (`memory://`, `s3://`, a typo such as `gs:/BUCKET`) is refused with a ConfigError
naming the fix: a path the layer cannot open must never become a local directory such as
`./gs:/BUCKET`.

Object stores cannot append to an object, so `open_append` on a remote path keeps the object's bytes
in memory and rewrites the whole object (one atomic PUT) when it is flushed; files that need fsync or
flock (the syncer's write-ahead log, directory locks) must live on local disk: `local_dir`.
"""

import os
import re
import sys
import time
from typing import IO

os.environ.setdefault("EPATH_USE_TF", "false")  # Before epath picks (and caches) its gs:// backend.

from etils import epath  # pylint: disable=g-import-not-at-top,wrong-import-position
import fsspec  # pylint: disable=g-import-not-at-top,wrong-import-position

# tensorboardX imports google-cloud-storage (with requests, google-auth, cryptography: ~320 modules) for a gs://
# writer that _TensorBoardFactory replaces: hidden from that import only, so every process starts sooner (a
# restarted syncer's recovery is mostly imports); anything else may still import it.
_HIDE_GCS = "google.cloud.storage" not in sys.modules
if _HIDE_GCS:
  sys.modules["google.cloud.storage"] = None  # type: ignore[assignment]  # Makes its optional import fail.
import tensorboardX.record_writer  # pylint: disable=g-import-not-at-top,wrong-import-position

if _HIDE_GCS:
  del sys.modules["google.cloud.storage"]

from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top,wrong-import-position

REMOTE_SCHEMES = ("gs",)
# gcsfs caches directory listings by default, but other processes and TensorStore (orbax's arrays)
# write to the bucket behind its back: a cached listing would hide their objects.
fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)
# 'scheme:/' at the start of a path: a URL, or a mangled one ('gs:/BUCKET' after os.path.normpath).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


def is_remote(path) -> bool:
  """Whether `path` is a URL (gs://...) rather than a local path; says nothing about its validity."""
  return _URL.match(os.fspath(path)) is not None


def path(location) -> epath.Path:
  """`location` as a path the layer opens: a local path made absolute, or gs://BUCKET/...; else ConfigError.

  Why refuse instead of passing through: os and pathlib turn 'gs://b/x' into the local directory
  './gs:/b/x', so a run would write its checkpoints to a disk that vanishes with the VM.
  """
  text = os.fspath(location)
  match = _URL.match(text)
  if match is None:
    return epath.Path(os.path.abspath(text))
  scheme = match.group(1)
  if scheme not in REMOTE_SCHEMES or not text.startswith(f"{scheme}://"):
    raise ConfigError(f"cannot open {text!r}: only local paths and gs://BUCKET/PATH are supported")
  if not text[len(scheme) + 3:].split("/")[0]:
    raise ConfigError(f"{text!r} names no bucket: write gs://BUCKET/PATH")
  _require_backend(text)
  return epath.Path(text)


def _require_backend(text: str) -> None:
  """Refuses a gs:// path when neither gcsfs (fsspec's GCS) nor, if allowed, TensorFlow's gfile is importable."""
  try:
    import gcsfs  # pylint: disable=g-import-not-at-top,unused-import,import-outside-toplevel
    return
  except ImportError:
    pass
  if os.environ.get("EPATH_USE_TF", "").lower() in ("1", "true", "yes", "t"):
    try:
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import,import-outside-toplevel
      return
    except ImportError:
      pass
  raise ConfigError(f"cannot open {text!r}: gs:// paths need gcsfs (pip install gcsfs)")


def makedirs(location) -> epath.Path:
  """`path(location)`, created if local; an object store has no directories (and gcsfs would create a
  missing bucket instead of failing), so a remote one is only validated."""
  target = path(location)
  if not is_remote(target):
    os.makedirs(target, exist_ok=True)
  return target


def local_dir(workdir, setting: str, what: str) -> str:
  """The local directory for files that need fsync/flock: `setting` if given, else the workdir itself.

  Why: a write-ahead log is only durable once fsync returns, and a lock only exists on a local
  file system; gs:// offers neither, so a remote workdir needs a local directory beside it.
  """
  if setting:
    if is_remote(setting):
      raise ConfigError(f"{what} must be on local disk (it needs fsync and flock), not {setting!r}: "
                        "give a local directory")
    return os.path.abspath(setting)
  if is_remote(workdir):
    raise ConfigError(f"--workdir {os.fspath(workdir)} is remote but {what} needs local disk: set "
                      "--config.service.local_dir to a local directory")
  return os.path.abspath(os.fspath(workdir))


def replace_text(location, text: str) -> None:
  """Writes `location` whole, atomically: local via a temp file, fsync and rename; remote in one PUT."""
  target = path(location)
  if is_remote(target):
    target.write_text(text)
    return
  tmp = f"{target}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, target)


class ObjectAppender:
  """An appendable file on an object store: the bytes stay in memory and each upload rewrites the object.

  `flush()` uploads when `interval` seconds passed since the last upload (metrics write a record at a
  time; an upload per record would be quadratic), `flush(force=True)` and `close()` always do. A crash
  loses what was written since the last upload, never what an upload returned for.
  """

  def __init__(self, location: epath.Path, binary: bool, interval: float):
    self._path, self._binary, self._interval = location, binary, interval
    if not location.exists():
      location.write_bytes(b"")  # Exists once opened, as a local file does (readers may look for it).
    self._data = bytearray(location.read_bytes())
    self._uploaded, self._dirty = time.monotonic(), False

  def write(self, data) -> int:
    """Appends `data` (bytes in binary mode, str otherwise) to the in-memory object."""
    self._data += data if self._binary else data.encode("utf-8")
    self._dirty = True
    return len(data)

  def flush(self, force: bool = False) -> None:
    """Uploads the whole object if anything changed and `interval` passed (or `force`)."""
    if self._dirty and (force or time.monotonic() - self._uploaded >= self._interval):
      self._path.write_bytes(bytes(self._data))
      self._uploaded, self._dirty = time.monotonic(), False

  def close(self) -> None:
    """Uploads what is left."""
    self.flush(force=True)


def open_append(location, interval: float) -> IO:
  """A text file appended to: the local file itself, or an ObjectAppender rewriting a remote object."""
  target = path(location)
  if is_remote(target):
    return ObjectAppender(target, binary=False, interval=interval)
  return open(target, "a", encoding="utf-8")  # pylint: disable=consider-using-with


def sync(file: IO) -> None:
  """Makes what was written to an `open_append` file durable now: fsync, or an upload of the object."""
  if isinstance(file, ObjectAppender):
    file.flush(force=True)
  else:
    file.flush()
    os.fsync(file.fileno())


class _TensorBoardFactory:
  """tensorboardX's writer factory for gs://: event files through this layer (its own one needs
  google-cloud-storage and a second set of credentials). tensorboardX flushes every flush_secs."""

  def open(self, location: str) -> ObjectAppender:
    return ObjectAppender(path(location), binary=True, interval=0.0)

  def directory_check(self, location: str) -> None:
    del location  # Object stores have no directories to create.


for _scheme in REMOTE_SCHEMES:
  tensorboardX.record_writer.register_writer_factory(_scheme, _TensorBoardFactory())

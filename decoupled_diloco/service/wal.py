"""Write-ahead log of the syncer service: an acknowledged push is on disk before its ack.

Why: between two checkpoints the log holds every push the syncer applied (and every merge
it took outside a push), so a syncer restarted after SIGKILL restores the checkpoint,
replays the log and is exactly where it was: no acknowledged update lost, none applied
twice, versions never going back. Each record's frame carries its own checksum, which
tells a torn tail (truncated by `Log`) from corruption (`CorruptLog`, start-up stops unless
`truncate_corrupt=True`); a failed append truncates back to the last good record and raises
`LogWriteError`. Layout and damage table: docs/service-durability.md.
"""

import contextlib
import functools
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from absl import logging
import msgpack
from zlib_ng import zlib_ng  # zlib's CRC-32, the same values, 5-7x faster: a push is checksummed at memory speed.

from decoupled_diloco.service import wire

_MAGIC = 0xD1C0_0002  # 2: the body crc covers the payload, then the meta (1: meta first).
_FRAME = struct.Struct("<IQQII")  # magic, meta length, payload length, body crc, frame crc.
SPOOL_CHUNK_BYTES = 4 << 20  # What a streamed payload holds in memory on its way to its spool file.
_SCAN_CHUNK_BYTES = 4 << 20  # What a scan of a mapped segment holds in memory: the pages of one checksummed chunk.
_SUFFIX = ".log"


class CorruptLog(RuntimeError):
  """A damaged record that is not a torn tail: acknowledged records may sit behind it."""


class LogWriteError(OSError):
  """An append failed (and was rolled back): the log can no longer make new state durable."""


def segment_path(directory: str, segment: int) -> str:
  """Where segment `segment` lives."""
  return os.path.join(directory, f"{segment:012d}{_SUFFIX}")


def segments(directory: str) -> list[int]:
  """Segment ids on disk, oldest first."""
  if not os.path.isdir(directory):
    return []
  return sorted(
      int(name[:-len(_SUFFIX)]) for name in os.listdir(directory)
      if name.endswith(_SUFFIX) and name[:-len(_SUFFIX)].isdigit())


def _frame(meta: bytes, payload_bytes: int, payload_crc: int) -> bytes:
  """The frame of one record, its own checksum last. The body's covers the payload first, so that a payload
  streamed to a `Spool` (crc known, the record's meta not yet) needs no second pass."""
  head = struct.pack("<IQQI", _MAGIC, len(meta), payload_bytes, zlib_ng.crc32(meta, payload_crc))
  return head + struct.pack("<I", zlib_ng.crc32(head))


def _meta(record: dict, offset: int) -> bytes:
  """The record's msgpack for an append at `offset`, zero-padded so that its payload starts at a multiple of
  wire.ALIGNMENT in the segment: a payload's arrays, mapped, are then aligned as XLA needs to take them without a
  copy (`push.host_view`), so a replay never holds a push whole. Logs written before the padding still read."""
  meta = msgpack.packb(record, use_bin_type=True)
  return meta + bytes(-(offset + _FRAME.size + len(meta)) % wire.ALIGNMENT)


def _unpack(meta: memoryview) -> dict:
  try:
    return msgpack.unpackb(meta, raw=False)
  except msgpack.ExtraData as extra:  # `_meta`'s padding.
    if any(extra.extra):
      raise ValueError(f"{len(extra.extra)} bytes after the record are not zero padding") from None
    return extra.unpacked


def _map(path: str) -> memoryview:
  """The file at `path` mapped read-only: what is read of it comes from the page cache, page by page, and
  `page_dropper` lets go of it; nothing is read into the process's memory whole (a segment holds whole pushes)."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    return memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else b"")


def page_dropper(data) -> Callable[[], None] | None:
  """How a reader lets go of the pages of `data` read so far, where `data` is mapped from disk (a spooled
  push's `Spool.map`, a view of a log segment): a fold calls it after each tensor, so that no push is ever
  whole in the process's memory (the page cache keeps the pages: read again, they come back). None for
  data in memory, which has no pages to let go of."""
  mapping = data.obj if isinstance(data, memoryview) else data
  return functools.partial(mapping.madvise, mmap.MADV_DONTNEED) if isinstance(mapping, mmap.mmap) else None


def _chunks(data: memoryview, start: int, end: int) -> Iterator[memoryview]:
  """data[start:end] _SCAN_CHUNK_BYTES at a time, the pages of each dropped once the next is asked for."""
  drop_pages = page_dropper(data) or (lambda: None)
  for at in range(start, end, _SCAN_CHUNK_BYTES):
    yield data[at:min(end, at + _SCAN_CHUNK_BYTES)]
    drop_pages()


def _scan(data: memoryview, path: str) -> Iterator[tuple[int, dict, memoryview, int]]:
  """(end offset, record, payload, payload crc) of every intact record of the mapped segment `data`, then raises
  CorruptLog or returns at a torn tail. Payloads are checksummed a chunk at a time (`_chunks`)."""
  position = 0
  while position < len(data):
    if len(data) - position < _FRAME.size:
      return  # Torn: not even a whole frame.
    magic, meta_length, payload_length, crc, frame_crc = _FRAME.unpack_from(data, position)
    if magic == _MAGIC - 1:
      raise CorruptLog(f"{path}: written by an older decoupled_diloco (log format 1, before streamed pushes): "
                       "resume this run with that version, or start a new workdir")
    if magic != _MAGIC or zlib_ng.crc32(data[position:position + _FRAME.size - 4]) != frame_crc or not meta_length:
      if not any(chunk.tobytes().strip(b"\0") for chunk in _chunks(data, position, len(data))):
        return  # Zeros after a power loss extended the file: nothing of that record reached the disk.
      raise CorruptLog(f"{path}: record frame at offset {position} is damaged")
    start = position + _FRAME.size
    end = start + meta_length + payload_length
    if end > len(data):
      return  # Torn: the last record is incomplete.
    payload_crc = 0
    for chunk in _chunks(data, start + meta_length, end):
      payload_crc = zlib_ng.crc32(chunk, payload_crc)
    if zlib_ng.crc32(data[start:start + meta_length], payload_crc) != crc:
      raise CorruptLog(f"{path}: record at offset {position} fails its checksum")
    try:
      record = _unpack(data[start:start + meta_length])
    except ValueError as error:
      raise CorruptLog(f"{path}: record at offset {position} does not decode ({error})") from error
    position = end
    yield position, record, data[start + meta_length:end], payload_crc


class Location(NamedTuple):
  """Where a logged payload lies: the syncer keeps this, not the bytes, of pushes it must carry over."""
  segment: int
  offset: int
  nbytes: int
  crc: int  # Its crc32: a rotation carries it into a new segment without reading it.


def read_segment(path: str) -> list[tuple[dict, memoryview]]:
  """(record, payload) of every intact record of one segment, in append order.

  Raises CorruptLog on damage other than a torn tail (`Log` has truncated that already).
  """
  return [(record, payload) for record, payload, _ in records(path, -1)]


def records(path: str, segment: int) -> Iterator[tuple[dict, memoryview, Location]]:
  """(record, payload, where the payload lies) of every intact record of segment `segment` at `path`; payloads
  are views of the mapped segment (`_map`; `drop_pages` lets go of what was read of them)."""
  for end, record, payload, crc in _scan(_map(path), path):
    yield record, payload, Location(segment, end - payload.nbytes, payload.nbytes, crc)


def recover(directory: str, truncate_corrupt: bool) -> None:
  """Cuts every segment back to its intact records (see `intact_length`) before a replay reads them."""
  for segment in segments(directory):
    path = segment_path(directory, segment)
    valid = intact_length(path, truncate_corrupt)
    if valid < os.path.getsize(path):
      os.truncate(path, valid)


def intact_length(path: str, truncate_corrupt: bool = False) -> int:
  """Bytes of `path` that hold intact records: where the next append goes.

  A torn tail is logged and left out; corruption raises CorruptLog, unless `truncate_corrupt`
  (the operator's explicit choice to give up every record from the damage on).
  """
  data = _map(path)
  valid = 0
  try:
    for valid, _, _, _ in _scan(data, path):
      pass
  except CorruptLog as error:
    if not truncate_corrupt:
      raise CorruptLog(f"{error}; records after it would be lost: refusing to start. Restore the file, or pass "
                       "--config.service.truncate_corrupt_log=True to drop every record from there on") from None
    logging.error("%s: truncating at offset %d as asked (truncate_corrupt_log), %d bytes dropped", error, valid,
                  len(data) - valid)
    return valid
  if valid < len(data):
    logging.warning("%s: dropping a torn last record at offset %d (%d bytes, never acknowledged)", path, valid,
                    len(data) - valid)
  return valid


class Log:
  """Appends records to one segment; each `append` returns once the record is durable."""

  def __init__(self, directory: str, segment: int):
    os.makedirs(directory, exist_ok=True)
    self.directory = directory
    self._open(segment, keep=True)

  def _open(self, segment: int, keep: bool) -> None:
    """Opens `segment` for appending after its intact records (`keep`) or empty."""
    path = segment_path(self.directory, segment)
    self._offset = intact_length(path) if keep and os.path.exists(path) else 0
    self._file = open(path, "r+b" if os.path.exists(path) else "w+b")
    self._file.truncate(self._offset)  # Drop a torn tail so new records follow the last intact one.
    self._file.seek(self._offset)
    self.segment, self._path = segment, path  # _path: the file's name now (a rotation writes it aside first).

  def append(self, record: dict, payload=b"") -> Location:
    """Writes and fsyncs one record (a dict of msgpack-able values) and its payload (bytes, or a `Spool`,
    copied by the kernel); returns where the payload lies.

    On failure the segment is cut back to its last good record and LogWriteError raised:
    the record is not in the log, and the caller must not act on it.
    """
    meta = _meta(record, self._offset)
    spool = payload if isinstance(payload, (Spool, _Logged)) else None
    payload = memoryview(b"" if spool else payload).cast("B")
    nbytes, crc = (spool.nbytes, spool.crc) if spool else (payload.nbytes, zlib_ng.crc32(payload))
    start = self._offset + _FRAME.size + len(meta)
    try:
      self._file.write(_frame(meta, nbytes, crc))
      self._file.write(meta)
      self._file.write(payload)
      self._file.flush()
      if spool:
        spool.copy_to(self._file.fileno(), start)
        self._file.seek(start + nbytes)
      os.fsync(self._file.fileno())
    except OSError as error:
      self._roll_back()
      raise LogWriteError(error.errno, f"write-ahead log append to {self._path} failed ({error})") from error
    location = Location(self.segment, start, nbytes, crc)
    self._offset = location.offset + nbytes
    return location

  def _roll_back(self) -> None:
    """Cuts a failed append off (best effort: a torn tail is recovered at the next start anyway)."""
    try:
      self._file.seek(self._offset)
      self._file.truncate(self._offset)
      self._file.flush()
      os.fsync(self._file.fileno())
    except OSError as error:
      logging.error("could not roll back the failed append (%s); the next start drops its torn tail", error)

  def rotate(self, segment: int, carried: Iterable[tuple[dict, bytes | Location]]) -> list[Location]:
    """Starts segment `segment` holding `carried` (what the next checkpoint does not cover); returns where
    their payloads now lie. A payload given as a Location is copied from its segment by the kernel (`copy_file`),
    never through this process's memory.

    The new segment is written aside and renamed into place, complete and durable, before
    the caller writes the checkpoint that points at it: a crash leaves either the old file
    (a retry may rewrite the same segment) or the whole new one. Older segments stay until
    `drop_before` runs after that checkpoint.
    """
    self._file.close()
    path = segment_path(self.directory, segment)
    self._file, self._offset, self.segment = open(f"{path}.tmp", "w+b"), 0, segment
    self._path = f"{path}.tmp"
    locations = [
        self.append(record,
                    _Logged(self.directory, payload) if isinstance(payload, Location) else payload)
        for record, payload in carried]
    os.replace(f"{path}.tmp", path)
    self._path = path
    fsync_directory(self.directory)
    return locations

  def drop_before(self, segment: int) -> None:
    """Deletes segments older than `segment` (the oldest checkpoint kept covers them)."""
    for old in segments(self.directory):
      if old < segment:
        os.remove(segment_path(self.directory, old))

  def close(self) -> None:
    """Closes the open segment."""
    self._file.close()


class _Logged:
  """A payload in a segment of `directory` at `location`, appended to another as a `Spool` is: by the kernel."""

  def __init__(self, directory: str, location: Location):
    self.path, self.offset, self.nbytes, self.crc = segment_path(directory, location.segment), *location[1:]

  def copy_to(self, fd: int, offset: int) -> None:
    """Copies the payload to `fd` at `offset` inside the kernel."""
    with open(self.path, "rb") as f:
      copy_file(f.fileno(), self.offset, fd, offset, self.nbytes)


def copy_file(source: int, source_offset: int, target: int, target_offset: int, nbytes: int) -> None:
  """Copies `nbytes` from file `source` to file `target` inside the kernel (copy_file_range): a payload copied
  between the log's files never passes through the process's memory (at 12B parameters a push is 48 GB)."""
  copied = 0
  while copied < nbytes:
    step = os.copy_file_range(source, target, nbytes - copied, source_offset + copied, target_offset + copied)
    if not step:
      raise OSError(f"the file copied from ended after {copied} of {nbytes} bytes")
    copied += step


@contextlib.contextmanager
def _disk_errors():
  """OSErrors of the disk raised as LogWriteError: apart from the sender's, and as fatal as a failed append."""
  try:
    yield
  except OSError as error:
    raise LogWriteError(error.errno, f"spooling a payload beside the log failed ({error})") from error


class Spool:
  """A payload received chunk by chunk into an unnamed file beside the log, not into the process's memory.

  Why: the syncer then holds no whole push (docs/syncer-memory.md). `fill` streams the bytes in
  (crc computed on the way) and maps the file read-only: `map` is what `wire.decode` reads, lazily,
  and `page_dropper(map)` lets go of the pages read so far. `Log.append` copies it into the log in the
  kernel. The file is unnamed (O_TMPFILE): nothing is left behind, however the process ends.
  """

  def __init__(self, directory: str, nbytes: int):
    self.file = tempfile.TemporaryFile(dir=directory)
    self.nbytes, self.crc, self.map = nbytes, 0, b""

  def fill(self, read: Callable[[memoryview], None]) -> "Spool":
    """Fills the spool with `read(view)`, which fills `view` from the sender or raises; returns it.

    The disk failing it raises LogWriteError (the log could not take the push either); the sender, OSError.
    """
    buffer = memoryview(bytearray(min(self.nbytes, SPOOL_CHUNK_BYTES)))
    for start in range(0, self.nbytes, buffer.nbytes):
      chunk = buffer[:min(buffer.nbytes, self.nbytes - start)]
      read(chunk)
      self.crc = zlib_ng.crc32(chunk, self.crc)
      with _disk_errors():
        self.file.write(chunk)
    with _disk_errors():
      self.file.flush()
      if self.nbytes:
        self.map = mmap.mmap(self.file.fileno(), self.nbytes, access=mmap.ACCESS_READ)
    return self

  def copy_to(self, fd: int, offset: int) -> None:
    """Copies the payload to `fd` at `offset` inside the kernel (no process memory)."""
    copy_file(self.file.fileno(), 0, fd, offset, self.nbytes)

  def close(self) -> None:
    """Deletes the file (its mapping goes with the last view of it)."""
    self.file.close()


def fsync_directory(directory: str) -> None:
  """Makes a new file's directory entry durable, not only its bytes."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)

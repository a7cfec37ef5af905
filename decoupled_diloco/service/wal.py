"""Write-ahead log of the syncer service: an acknowledged push is on disk before its ack.

Checkpoints (orbax) are taken every N merges; between two of them the log holds every
push the syncer applied (and every merge it took outside a push), so a syncer restarted
after SIGKILL restores the checkpoint, replays the log and is exactly where it was: no
acknowledged update is lost, none is applied twice (replay skips sequence numbers the
checkpoint already holds), and versions never go back.

Layout: `<dir>/<segment:012d>.log`, one segment per checkpoint; a record is
  u64 meta length | u64 payload length | u32 crc32(meta + payload) | meta (msgpack map) | payload
appended and fsync'ed; the payload (a push's bytes as received) is written from its own
buffer. A crash mid-append leaves a torn last record, which was never acknowledged:
`read_segment` stops there and `Log` truncates it before appending.
"""

import os
import struct
import zlib
from collections.abc import Iterator

import msgpack

_FRAME = struct.Struct("<QQI")
_SUFFIX = ".log"


def segment_path(directory: str, segment: int) -> str:
  """Where segment `segment` lives."""
  return os.path.join(directory, f"{segment:012d}{_SUFFIX}")


def segments(directory: str) -> list[int]:
  """Segment ids on disk, oldest first."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(name[:-len(_SUFFIX)]) for name in os.listdir(directory)
                if name.endswith(_SUFFIX) and name[:-len(_SUFFIX)].isdigit())


def _records(path: str) -> Iterator[tuple[int, dict, memoryview]]:
  """(end offset, record, payload) of every intact record; stops at the first torn or corrupt one."""
  with open(path, "rb") as f:
    data = memoryview(f.read())
  position = 0
  while position + _FRAME.size <= len(data):
    meta_length, payload_length, crc = _FRAME.unpack_from(data, position)
    start = position + _FRAME.size
    end = start + meta_length + payload_length
    if end > len(data) or zlib.crc32(data[start:end]) != crc:
      return
    position = end
    yield position, msgpack.unpackb(data[start:start + meta_length], raw=False), data[start + meta_length:end]


def read_segment(path: str) -> list[tuple[dict, memoryview]]:
  """(record, payload) of every intact record of one segment, in append order."""
  return [(record, payload) for _, record, payload in _records(path)]


class Log:
  """Appends records to one segment; each `append` returns once the record is durable."""

  def __init__(self, directory: str, segment: int):
    os.makedirs(directory, exist_ok=True)
    self.directory, self.segment = directory, segment
    path = segment_path(directory, segment)
    valid = 0
    if os.path.exists(path):
      for valid, _, _ in _records(path):
        pass
    self._file = open(path, "ab")
    self._file.truncate(valid)  # Drop a torn tail so new records follow the last intact one.
    self._file.seek(valid)

  def append(self, record: dict, payload=b"") -> None:
    """Writes and fsyncs one record (a dict of msgpack-able values) and its payload bytes."""
    meta = msgpack.packb(record, use_bin_type=True)
    payload = memoryview(payload).cast("B")
    self._file.write(_FRAME.pack(len(meta), payload.nbytes, zlib.crc32(payload, zlib.crc32(meta))))
    self._file.write(meta)
    self._file.write(payload)
    self._file.flush()
    os.fsync(self._file.fileno())

  def rotate(self, segment: int, records: list[tuple[dict, bytes]]) -> None:
    """Starts segment `segment` holding `records` (what the next checkpoint does not cover).

    The new segment is complete and durable before the caller writes the checkpoint that
    points at it; older segments stay until `drop_before` runs after that checkpoint.
    """
    self._file.close()
    path = segment_path(self.directory, segment)
    if os.path.exists(path):
      os.remove(path)
    self.segment = segment
    self._file = open(path, "ab")
    for record, payload in records:
      self.append(record, payload)
    _fsync_directory(self.directory)

  def drop_before(self, segment: int) -> None:
    """Deletes segments older than `segment` (a checkpoint now covers them)."""
    for old in segments(self.directory):
      if old < segment:
        os.remove(segment_path(self.directory, old))

  def close(self) -> None:
    """Closes the open segment."""
    self._file.close()


def _fsync_directory(directory: str) -> None:
  """Makes a new file's directory entry durable, not only its bytes."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)

"""Random-access document sources for the packed pipeline: TFDS splits, ArrayRecord shards, text files.

Why random access and pieces: grain shards and shuffles by index without reading anything, so a
source must answer `len` and `[i]` cheaply and never hold the corpus in memory. An item is a pair
`(utf8_bytes, ends_document)`: long texts are served in pieces of about `chunk_bytes` cut at line
ends, and only a document's last piece is followed by the end-of-document token. That lets a
single-document dataset (tiny Shakespeare's train split is one example) or a huge local text file
be dealt to many learners and batch rows like any corpus of many documents.
"""

import functools
import pathlib

import numpy as np

from decoupled_diloco.errors import ConfigError


def piece_bounds(data: np.ndarray, index: int, chunk_bytes: int) -> tuple[int, int]:
  """[begin, end) of piece `index` of `data`: nominal cuts every chunk_bytes, moved past the next b'\\n'.

  Each cut depends only on its own position, so pieces are computed independently and every byte
  belongs to exactly one piece (a line longer than chunk_bytes is cut where it is).
  """

  def cut(position: int) -> int:
    if position <= 0 or position >= data.size:
      return min(max(position, 0), data.size)
    window = data[position:position + chunk_bytes]
    newlines = np.flatnonzero(window == 10)
    return position + int(newlines[0]) + 1 if newlines.size else position

  return cut(index * chunk_bytes), cut((index + 1) * chunk_bytes)


def num_pieces(size: int, chunk_bytes: int) -> int:
  """Pieces of a text of `size` bytes (at least one, so an empty document still ends)."""
  return max(1, -(-size // chunk_bytes))


class FileDocuments:
  """Bytes [begin, end) of a memory-mapped text file as one document in pieces (never read whole)."""

  def __init__(self, path: str, begin: int, end: int, chunk_bytes: int):
    self._path, self._begin, self._end, self._chunk = path, begin, end, chunk_bytes

  @functools.cached_property
  def _data(self) -> np.ndarray:
    return np.memmap(self._path, dtype=np.uint8, mode="r")[self._begin:self._end]

  def __len__(self) -> int:
    return num_pieces(self._end - self._begin, self._chunk)

  def __getitem__(self, index: int) -> tuple[bytes, bool]:
    begin, end = piece_bounds(self._data, index, self._chunk)
    return self._data[begin:end].tobytes(), index == len(self) - 1


class RecordDocuments:
  """Whole documents from a random-access source of records (a TFDS split or ArrayRecord shards)."""

  def __init__(self, source, key: str | None, name: str):
    self._source, self._key, self._name = source, key, name

  def __len__(self) -> int:
    return len(self._source)

  def text(self, index: int) -> bytes:
    """UTF-8 bytes of record `index`; the feature `key` of a TFDS example, the record itself otherwise."""
    record = self._source[index]
    if self._key is not None:
      if self._key not in record:
        raise ConfigError(f"TFDS dataset {self._name!r} has no feature {self._key!r} (features: {sorted(record)}): "
                          "set data.tfds_text_key to its text feature")
      record = record[self._key]
    return record.encode("utf-8") if isinstance(record, str) else bytes(record)

  def __getitem__(self, index: int) -> tuple[bytes, bool]:
    return self.text(int(index)), True


class SplitDocuments:
  """The documents of a source with few of them, cut into pieces; indexing reads only the lengths once."""

  def __init__(self, documents: RecordDocuments, chunk_bytes: int):
    self._documents, self._chunk = documents, chunk_bytes
    counts = [num_pieces(len(documents.text(i)), chunk_bytes) for i in range(len(documents))]
    self._starts = np.concatenate([[0], np.cumsum(counts)])

  def __len__(self) -> int:
    return int(self._starts[-1])

  @functools.lru_cache(maxsize=2)
  def _document(self, index: int) -> np.ndarray:
    return np.frombuffer(self._documents.text(index), dtype=np.uint8)

  def __getitem__(self, index: int) -> tuple[bytes, bool]:
    document = int(np.searchsorted(self._starts, index, side="right") - 1)
    piece = int(index - self._starts[document])
    data = self._document(document)
    begin, end = piece_bounds(data, piece, self._chunk)
    return data[begin:end].tobytes(), piece == self._starts[document + 1] - self._starts[document] - 1


def array_record_documents(path: str):
  """The prepared ArrayRecord shards of `path` (a directory, or one split's glob) as documents."""
  import grain  # pylint: disable=g-import-not-at-top
  location = pathlib.Path(path).expanduser()
  files = sorted(location.glob("*.array_record*")) if location.is_dir() else sorted(location.parent.glob(location.name))
  if not files:
    raise ConfigError(f"data.path {path!r} holds no ArrayRecord shards: prepare them with "
                      "python -m experiments.prepare_data --input=... --output=DIR")
  return RecordDocuments(grain.sources.ArrayRecordDataSource([str(f) for f in files]), None, str(location))

r"""Converts text into ArrayRecord shards that data.source='array_record' reads with random access.

A local text file (cut into documents of about --chunk_bytes at line ends; the last
--eval_fraction of them is the eval split):
  python -m experiments.prepare_data --input=corpus.txt --output=/data/corpus_ar
A TFDS dataset prepared in another file format (e.g. C4 as TFRecord from the Beam pipeline);
its 'validation' (else 'test') split becomes the eval split:
  python -m experiments.prepare_data --tfds_name=c4/en --tfds_data_dir=gs://BUCKET/tfds \
      --output=gs://BUCKET/c4_ar --num_shards=1024 --max_bytes=0
then train with --config.data.source=array_record --config.data.path=/data/corpus_ar.

Records stream through: nothing is held in memory beyond one document. --max_bytes caps the
text written per split (0 = all). Bad input prints one `error:` line and exits with status 2,
before anything is written.
"""

import os
import pathlib

from absl import app
from absl import flags

from experiments import cli

_INPUT = flags.DEFINE_string("input", "", "Local text file to convert (or use --tfds_name).")
_TFDS_NAME = flags.DEFINE_string("tfds_name", "", "TFDS dataset to convert, e.g. c4/en (or use --input).")
_TFDS_DATA_DIR = flags.DEFINE_string("tfds_data_dir", "", "Where the TFDS dataset is prepared ('' = TFDS default).")
_TFDS_TEXT_KEY = flags.DEFINE_string("tfds_text_key", "text", "Feature holding the text of each TFDS example.")
_OUTPUT = flags.DEFINE_string("output", None, "Directory for train-*.array_record and eval-*.array_record.")
_NUM_SHARDS = flags.DEFINE_integer("num_shards", 4, "ArrayRecord files per split (hosts read any records).")
_CHUNK_BYTES = flags.DEFINE_integer("chunk_bytes", 1 << 16, "Document size a text file is cut into (--input).")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.1, "Tail of a text file's documents kept for eval.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 0, "Cap on the text bytes written per split (0 = all).")
flags.mark_flag_as_required("output")


class ShardWriter:
  """Deals records round-robin over `num_shards` ArrayRecord files of one split."""

  def __init__(self, directory: pathlib.Path, split: str, num_shards: int):
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self._writers = [
        array_record_module.ArrayRecordWriter(str(directory / f"{split}-{i:05d}-of-{num_shards:05d}.array_record"),
                                              "group_size:1") for i in range(num_shards)]
    self.records = self.bytes = 0

  def write(self, record: bytes) -> None:
    self._writers[self.records % len(self._writers)].write(record)
    self.records += 1
    self.bytes += len(record)

  def close(self) -> None:
    for writer in self._writers:
      writer.close()


def _capped(records, max_bytes: int):
  """Records until `max_bytes` of text were yielded (0 = no cap)."""
  total = 0
  for record in records:
    if 0 < max_bytes <= total:
      return
    total += len(record)
    yield record


def _pieces(source):
  """The text of every piece of a document source, in order."""
  for index in range(len(source)):
    yield source[index][0]


def text_file_splits(path: str, chunk_bytes: int, eval_fraction: float) -> dict:
  """'train' and 'eval' record iterators over a memory-mapped text file's line-aligned pieces."""
  from decoupled_diloco.data import documents  # pylint: disable=g-import-not-at-top
  size = os.path.getsize(path)
  cut = size - int(round(size * eval_fraction))
  return {
      "train": _pieces(documents.FileDocuments(path, 0, cut, chunk_bytes)),
      "eval": _pieces(documents.FileDocuments(path, cut, size, chunk_bytes))}


def tfds_splits(name: str, data_dir: str, key: str) -> dict:
  """'train' and 'eval' record iterators over a prepared TFDS dataset in any file format (via tf.data)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
    splits = builder.info.splits
  except tfds.core.DatasetNotFoundError as e:
    raise ConfigError(f"TFDS dataset {name!r} is unknown: use a name from tfds.list_builders()") from e
  if "train" not in splits:
    raise ConfigError(f"TFDS dataset {name!r} is not prepared in {data_dir or 'the default data dir'} (or has no "
                      "train split): prepare it first (tfds build, or its Beam pipeline for C4)")
  held_out = next((s for s in ("validation", "test") if s in splits), None)
  if held_out is None:
    raise ConfigError(f"TFDS dataset {name!r} has no validation or test split to evaluate on")

  def records(split):
    for example in tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False)):
      yield bytes(example[key])

  return {"train": records("train"), "eval": records(held_out)}


def prepare(output: str, splits: dict, num_shards: int, max_bytes: int) -> dict:
  """Writes every split's records; returns {split: [records, bytes]}."""
  directory = pathlib.Path(output).expanduser()
  directory.mkdir(parents=True, exist_ok=True)
  counts = {}
  for split, records in splits.items():
    writer = ShardWriter(directory, split, num_shards)
    try:
      for record in _capped(records, max_bytes):
        writer.write(record)
    finally:
      writer.close()
    counts[split] = [writer.records, writer.bytes]
  return counts


def main(argv) -> None:
  """Validates the flags, then converts; ConfigError -> one line, exit 2."""
  del argv
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    if bool(_INPUT.value) == bool(_TFDS_NAME.value):
      raise ConfigError("give exactly one of --input=FILE and --tfds_name=NAME")
    if _NUM_SHARDS.value < 1 or _CHUNK_BYTES.value < 256 or not 0 < _EVAL_FRACTION.value < 1:
      raise ConfigError("--num_shards must be >= 1, --chunk_bytes >= 256 and --eval_fraction in (0, 1)")
    if pathlib.Path(_OUTPUT.value).expanduser().is_dir() and any(pathlib.Path(_OUTPUT.value).expanduser().iterdir()):
      raise ConfigError(f"--output={_OUTPUT.value} is not empty: pick a new directory")
    if _INPUT.value:
      if not os.path.isfile(_INPUT.value):
        raise ConfigError(f"--input={_INPUT.value!r} does not exist: give a text file")
      splits = text_file_splits(_INPUT.value, _CHUNK_BYTES.value, _EVAL_FRACTION.value)
    else:
      splits = tfds_splits(_TFDS_NAME.value, _TFDS_DATA_DIR.value, _TFDS_TEXT_KEY.value)
  except ConfigError as error:
    cli.fail(error)
  for split, (records, size) in prepare(_OUTPUT.value, splits, _NUM_SHARDS.value, _MAX_BYTES.value).items():
    print(f"{split}: {records} records, {size} bytes")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

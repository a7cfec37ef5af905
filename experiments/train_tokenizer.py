r"""Trains a SentencePiece tokenizer offline on a text file or a TFDS text set, for data.tokenizer='sentencepiece'.

  python -m experiments.train_tokenizer --tfds_name=tiny_shakespeare --vocab_size=1024 \
      --output=/tmp/tok/shakespeare.model
  python -m experiments.train --config=configs/tiny_shakespeare.py --config.data.tokenizer=sentencepiece \
      --config.data.tokenizer_path=/tmp/tok/shakespeare.model --workdir=/tmp/dd_sp

`--input=FILE` trains on a local text file instead. The model has byte fallback and no text
normalisation (see decoupled_diloco/data/tokenizer.py), so bits per byte of a subword run compare
exactly with a byte-level run's. Bad input prints one `error:` line and exits with status 2.
"""

import pathlib
import tempfile

from absl import app
from absl import flags

from experiments import cli

_INPUT = flags.DEFINE_string("input", None, "Text file to train on (one sentence per line is not required).")
_TFDS_NAME = flags.DEFINE_string("tfds_name", None, "Or a TFDS text set (e.g. tiny_shakespeare): its train split.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size, byte-fallback ids included (>= 260).")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the model: PATH.model (and PATH.vocab beside it).")
_MODEL_TYPE = flags.DEFINE_enum("model_type", "bpe", ["bpe", "unigram"], "SentencePiece model type.")
flags.mark_flags_as_required(["output"])
flags.mark_flags_as_mutual_exclusive(["input", "tfds_name"], required=True)

SAMPLE_BYTES = 1 << 28  # Of a TFDS train split: SentencePiece samples 2M sentences (lines) of it anyway.


def write_tfds_text(name: str, path: pathlib.Path) -> str:
  """Writes about SAMPLE_BYTES of TFDS set `name`'s train split (feature 'text') to `path`, document by document.

  Why: SentencePiece trains on files; this trains a tokenizer on the very text a config reads through
  TFDS, with nothing downloaded by hand.
  """
  from decoupled_diloco.data import documents, sources  # pylint: disable=g-import-not-at-top
  train = documents.RecordDocuments(sources.open_tfds(name)["train"], "text", name)
  written = 0
  with path.open("wb") as out:
    for index in range(len(train)):
      if written >= SAMPLE_BYTES:
        break
      text = train.text(index)
      written += out.write(text if text.endswith(b"\n") else text + b"\n")
  return str(path)


def main(argv) -> None:
  """Trains and prints the model path; ConfigError -> one line, exit 2."""
  del argv
  from decoupled_diloco.data import tokenizer  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    with tempfile.TemporaryDirectory() as scratch:
      text = _INPUT.value or write_tfds_text(_TFDS_NAME.value, pathlib.Path(scratch) / "text")
      path = tokenizer.train_sentencepiece(text, _VOCAB_SIZE.value, _OUTPUT.value, _MODEL_TYPE.value)
  except ConfigError as error:
    cli.fail(error)
  print(path)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

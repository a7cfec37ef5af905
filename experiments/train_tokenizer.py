r"""Trains a SentencePiece tokenizer offline on a text file, for data.tokenizer='sentencepiece'.

  python -m experiments.train_tokenizer --input=../shared/data/tinyshakespeare.txt --vocab_size=1024 \
      --output=/tmp/tok/shakespeare.model
  python -m experiments.train --config=configs/tiny_shakespeare.py --config.data.tokenizer=sentencepiece \
      --config.data.tokenizer_path=/tmp/tok/shakespeare.model --workdir=/tmp/dd_sp

The model has byte fallback and no text normalisation (see decoupled_diloco/data/tokenizer.py),
so bits per byte of a subword run compare exactly with a byte-level run's. Bad input prints one
`error:` line and exits with status 2.
"""

from absl import app
from absl import flags

from experiments import cli

_INPUT = flags.DEFINE_string("input", None, "Text file to train on (one sentence per line is not required).")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size, byte-fallback ids included (>= 260).")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the model: PATH.model (and PATH.vocab beside it).")
_MODEL_TYPE = flags.DEFINE_enum("model_type", "bpe", ["bpe", "unigram"], "SentencePiece model type.")
flags.mark_flags_as_required(["input", "output"])


def main(argv) -> None:
  """Trains and prints the model path; ConfigError -> one line, exit 2."""
  del argv
  from decoupled_diloco.data import tokenizer  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.errors import ConfigError  # pylint: disable=g-import-not-at-top
  try:
    path = tokenizer.train_sentencepiece(_INPUT.value, _VOCAB_SIZE.value, _OUTPUT.value, _MODEL_TYPE.value)
  except ConfigError as error:
    cli.fail(error)
  print(path)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

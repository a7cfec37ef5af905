"""Tokenizers: bytes (default, embedded) or a SentencePiece model file, and their byte accounting.

Why two: byte ids need no vocabulary file and keep every checkpoint independent of one, which is
what the embedded demo and the synthetic language want; real runs compare models in subword
tokens, so `data.tokenizer='sentencepiece'` loads any SentencePiece `.model` (trained here with
`python -m experiments.train_tokenizer`, or shipped with T5 / Gemma checkpoints).

Why byte lengths per token: eval losses per token are not comparable across tokenizers, but
losses per byte of text are. `token_bytes[id]` is how many UTF-8 bytes of text token `id` stands
for, so the bytes behind any window are a sum over its ids, and the same text has the same byte
count under both tokenizers. The end-of-document token counts one byte (it stands for the
separator between documents). For SentencePiece this is exact for models trained without text
normalisation (as train_tokenizer does); a normalising model (NFKC, dummy prefix) is approximate.
"""

import dataclasses
import pathlib

import numpy as np

from decoupled_diloco.errors import ConfigError

VOCAB_SIZE = 256
BYTE_EOD_ID = 0  # NUL never occurs in text, so bytes need no extra id for end-of-document.
TOKENIZERS = ("byte", "sentencepiece")


def encode(text: str) -> np.ndarray:
  """UTF-8 bytes of `text` as a uint8 array, so token ids are exactly the byte values."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(ids) -> str:
  """Inverse of `encode`; model samples may cut a multi-byte character, so errors are replaced."""
  data = np.asarray(ids)
  if data.size and (data.min() < 0 or data.max() >= VOCAB_SIZE):
    raise ValueError(f"byte ids must lie in [0, {VOCAB_SIZE}), got [{data.min()}, {data.max()}]")
  return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Token id = byte value; end-of-document is byte 0."""
  name: str = "byte"
  vocab_size: int = VOCAB_SIZE
  eod_id: int = BYTE_EOD_ID

  def encode_bytes(self, data: bytes) -> np.ndarray:
    """int32 ids of raw UTF-8 bytes (no decode/encode round trip)."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def token_bytes(self) -> np.ndarray:
    """Bytes of text per id: 1 for every byte (and for end-of-document)."""
    return np.ones(self.vocab_size, np.int64)


class SentencePieceTokenizer:
  """A SentencePiece model; its eos id marks end-of-document (the unknown id if it has no eos)."""

  def __init__(self, path: str):
    import sentencepiece  # pylint: disable=g-import-not-at-top  (only for subword runs)
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
      raise ConfigError(f"data.tokenizer_path {path!r} does not exist: point it at a SentencePiece .model "
                        "(python -m experiments.train_tokenizer --input=FILE --vocab_size=N --output=PATH.model)")
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (OSError, RuntimeError) as e:
      raise ConfigError(f"data.tokenizer_path {path!r} is not a SentencePiece model ({e}): "
                        "point it at a .model file") from e
    self.name = f"sentencepiece({file.name})"
    self.vocab_size = self._sp.vocab_size()
    self.eod_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else self._sp.unk_id()

  def encode_bytes(self, data: bytes) -> np.ndarray:
    """int32 ids of UTF-8 text (invalid bytes are replaced, as a cut character would be)."""
    return np.asarray(self._sp.encode(data.decode("utf-8", errors="replace")), np.int32)

  def token_bytes(self) -> np.ndarray:
    """Bytes of text per id: byte-fallback pieces 1, control pieces 0 (eos 1), others their UTF-8 length."""
    sizes = np.zeros(self.vocab_size, np.int64)
    for i in range(self.vocab_size):
      if self._sp.is_byte(i):
        sizes[i] = 1
      elif not (self._sp.is_control(i) or self._sp.is_unknown(i) or self._sp.is_unused(i)):
        sizes[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    sizes[self.eod_id] = 1
    return sizes


def from_config(data_cfg):
  """The tokenizer `data.tokenizer` names; ConfigError for an unknown name or a missing model file."""
  if data_cfg.tokenizer == "byte":
    return ByteTokenizer()
  if data_cfg.tokenizer == "sentencepiece":
    if not data_cfg.tokenizer_path:
      raise ConfigError("data.tokenizer='sentencepiece' needs a model: set --config.data.tokenizer_path=PATH.model")
    return SentencePieceTokenizer(data_cfg.tokenizer_path)
  raise ConfigError(f"data.tokenizer={data_cfg.tokenizer!r} is unknown: use one of {', '.join(TOKENIZERS)}")


def resolve_model_vocab(config) -> None:
  """Makes the model follow the tokenizer: `model.vocab_size` (the byte default 256 becomes a subword
  model's size) and, under data.mask_document_boundaries, `model.document_eod_id` (its end-of-document id).

  Any other explicit value must hold every id of the tokenizer; a larger one pads the embedding
  (as models padded to a multiple of 128 rows do, or a config planned for a tokenizer the user
  brings), a smaller one is refused. Idempotent, so every process (trainer, syncer, learners) can
  call it on its copy of the config.
  """
  tokenizer = from_config(config.data)
  vocab = tokenizer.vocab_size
  eod = tokenizer.eod_id if config.data.get("mask_document_boundaries", False) else -1
  if config.model.get("document_eod_id", -1) not in (-1, eod):
    raise ConfigError(f"model.document_eod_id={config.model.document_eod_id} is set from "
                      "data.mask_document_boundaries: leave it at -1")
  if eod >= 0:
    config.model.document_eod_id = eod
  if config.model.vocab_size == VOCAB_SIZE and vocab != VOCAB_SIZE:
    config.model.vocab_size = vocab
  if config.model.vocab_size < vocab:
    raise ConfigError(f"model.vocab_size={config.model.vocab_size} does not match the {config.data.tokenizer} "
                      f"tokenizer's {vocab} ids: leave it at {VOCAB_SIZE} (it follows the tokenizer) or set >= {vocab}")


def train_sentencepiece(input_path: str, vocab_size: int, output: str, model_type: str = "bpe") -> str:
  """Trains a SentencePiece model on a text file offline; returns the .model path.

  No normalisation, no dummy prefix and byte fallback, so every byte of text is covered and
  `token_bytes` is exact (bits per byte compare exactly with byte-level runs).
  """
  import sentencepiece  # pylint: disable=g-import-not-at-top
  if not pathlib.Path(input_path).is_file():
    raise ConfigError(f"--input={input_path!r} does not exist: give a text file to train the tokenizer on")
  if vocab_size < 260:
    raise ConfigError(f"--vocab_size={vocab_size} is too small: byte fallback alone needs 256 + 4 ids, use >= 260")
  prefix = output[:-len(".model")] if output.endswith(".model") else output
  pathlib.Path(prefix).parent.mkdir(parents=True, exist_ok=True)
  sentencepiece.SentencePieceTrainer.train(input=input_path, model_prefix=prefix, vocab_size=vocab_size,
                                           model_type=model_type, byte_fallback=True,
                                           normalization_rule_name="identity", add_dummy_prefix=False,
                                           remove_extra_whitespaces=False, character_coverage=1.0, unk_id=0, bos_id=-1,
                                           eos_id=1, pad_id=-1, input_sentence_size=2_000_000,
                                           shuffle_input_sentence=True, max_sentence_length=1 << 16, minloglevel=2)
  return prefix + ".model"

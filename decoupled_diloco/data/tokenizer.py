"""Byte-level tokenizer: token id = UTF-8 byte value.

Why bytes: every text (any language, any TFDS dataset) encodes without a learned vocabulary or
a download, the vocabulary is fixed at 256 so checkpoints never depend on a tokenizer file, and
a corpus is simply a uint8 array, which keeps windows, shards and batches zero-copy numpy views.
"""

import numpy as np

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
  """UTF-8 bytes of `text` as a uint8 array, so token ids are exactly the byte values."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(ids) -> str:
  """Inverse of `encode`; model samples may cut a multi-byte character, so errors are replaced."""
  data = np.asarray(ids)
  if data.size and (data.min() < 0 or data.max() >= VOCAB_SIZE):
    raise ValueError(f"byte ids must lie in [0, {VOCAB_SIZE}), got [{data.min()}, {data.max()}]")
  return data.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

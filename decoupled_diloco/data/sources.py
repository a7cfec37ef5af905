"""Turns `config.data` into a byte corpus with a train and a held-out eval split.

Why one entry point: the trainer, the benchmarks and the colabs all need the same bytes for
the same config, and every way the user can get the config wrong (missing file, unknown
dataset, no network, too little text) should surface here as a one-line ConfigError before
any device or workdir is touched. TensorFlow Datasets is imported only on the 'tfds' path, so
importing the package (and the synthetic / text-file paths) stays fast.
"""

import dataclasses
import pathlib

import numpy as np

from decoupled_diloco.data import synthetic
from decoupled_diloco.errors import ConfigError

SOURCES = ("synthetic", "text_file", "tfds")


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """Byte ids of the train and eval text; `optimal_loss` is known only for synthetic data."""

  train: np.ndarray
  eval: np.ndarray
  name: str
  optimal_loss: float | None = None


def load_corpus(data_cfg, seq_len: int) -> Corpus:
  """Loads `data_cfg.source`; both splits must hold at least one window of seq_len + 1 bytes.

  `seq_len` is needed because synthetic chains are generated window-aligned (see synthetic.py)
  and because a split shorter than one window cannot produce a single batch.
  """
  if data_cfg.source == "synthetic":
    corpus = _synthetic(data_cfg, seq_len)
  elif data_cfg.source == "text_file":
    corpus = _text_file(data_cfg)
  elif data_cfg.source == "tfds":
    corpus = _tfds(data_cfg)
  else:
    raise ConfigError(
        f"data.source {data_cfg.source!r} is unknown: use one of {', '.join(SOURCES)}")
  for split in ("train", "eval"):
    size = getattr(corpus, split).size
    if size < seq_len + 1:
      raise ConfigError(
          f"the {split} split of {corpus.name} has {size} bytes, fewer than one window of "
          f"seq_len + 1 = {seq_len + 1}: use more data or a smaller model.seq_len")
  return corpus


def validate_config(data_cfg) -> None:
  """Checks the settings shared by all sources before any data loads (a syncer checks before writing)."""
  _eval_fraction(data_cfg)


def _eval_fraction(data_cfg) -> float:
  """Held-out fraction for sources without their own eval split, validated once."""
  fraction = float(data_cfg.eval_fraction)
  if not 0.0 < fraction < 1.0:
    raise ConfigError(f"data.eval_fraction={fraction} must be in (0, 1): use e.g. 0.1")
  return fraction


def _split_tail(data: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """Last `fraction` of the bytes is eval, so eval text is never interleaved with train text."""
  cut = data.size - int(round(data.size * fraction))
  return data[:cut], data[cut:]


def _synthetic(data_cfg, seq_len: int) -> Corpus:
  """Train and eval are independently seeded samples of one seeded Markov language.

  Eval is `eval_fraction` of `num_tokens` (at least one chain), drawn from its own generator
  stream so its text is fresh but comes from exactly the distribution `optimal_loss` describes.
  """
  cfg = data_cfg.synthetic
  if cfg.num_tokens < 1:
    raise ConfigError(
        f"data.synthetic.num_tokens={cfg.num_tokens} must be positive: use e.g. 2_000_000")
  language = synthetic.MarkovLanguage.random(
      cfg.alphabet_size, cfg.order, cfg.concentration, cfg.seed)
  chain_length = synthetic.aligned_chain_length(seq_len)
  num_eval = max(int(round(cfg.num_tokens * _eval_fraction(data_cfg))), chain_length)
  train = language.sample(cfg.num_tokens, np.random.default_rng([cfg.seed, 1]), chain_length)
  eval_ = language.sample(num_eval, np.random.default_rng([cfg.seed, 2]), chain_length)
  name = (f"synthetic(alphabet_size={cfg.alphabet_size}, order={cfg.order}, "
          f"concentration={cfg.concentration}, seed={cfg.seed})")
  return Corpus(train, eval_, name, language.optimal_loss(seq_len))


def _text_file(data_cfg) -> Corpus:
  """Any local file, read as raw bytes; its tail is the eval split."""
  path = pathlib.Path(data_cfg.path).expanduser()
  if not path.is_file():
    raise ConfigError(
        f"data.path {str(data_cfg.path)!r} does not exist: point --config.data.path at a text file")
  data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
  train, eval_ = _split_tail(data, _eval_fraction(data_cfg))
  return Corpus(train, eval_, f"text_file({path})")


def _tfds(data_cfg) -> Corpus:
  """Reads a TFDS text dataset through `tfds.data_source` (array_record), preparing it if needed.

  Eval is the dataset's 'validation' split, else 'test', else the tail of 'train'.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (heavy, tfds-only)

  name = data_cfg.tfds_name
  if not name:
    raise ConfigError("data.source='tfds' needs a dataset: set --config.data.tfds_name, e.g. tiny_shakespeare")
  data_dir = data_cfg.tfds_data_dir or None
  where = data_dir or "the default TFDS data dir"
  try:
    splits = tfds.data_source(name, data_dir=data_dir, split=None,
                              builder_kwargs={"file_format": "array_record"})
  except tfds.core.DatasetNotFoundError as e:
    raise ConfigError(
        f"TFDS dataset {name!r} is unknown: set data.tfds_name to a name from "
        "tfds.list_builders(), e.g. 'tiny_shakespeare'") from e
  except ImportError as e:
    raise ConfigError(
        f"preparing TFDS dataset {name!r} needs {e.name or 'a missing package'}: "
        "pip install 'decoupled_diloco[tfds]' (tensorflow-cpu, array-record)") from e
  except Exception as e:  # Download/prepare failures come from many libraries (requests, IO, TF).
    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    raise ConfigError(
        f"TFDS dataset {name!r} could not be downloaded/prepared in {where} ({reason}): "
        "give the machine network access or point data.tfds_data_dir at a prepared copy") from e
  if "train" not in splits:
    raise ConfigError(
        f"TFDS dataset {name!r} has no 'train' split (it has {sorted(splits)}): choose a "
        "data.tfds_name with a train split")
  train = _read_text(splits["train"], data_cfg.tfds_text_key, data_cfg.max_bytes, name)
  held_out = next((s for s in ("validation", "test") if s in splits), None)
  if held_out is None:
    train, eval_ = _split_tail(train, _eval_fraction(data_cfg))
  else:
    eval_ = _read_text(splits[held_out], data_cfg.tfds_text_key, data_cfg.max_bytes, name)
  return Corpus(train, eval_, f"tfds({name}, eval={held_out or 'train tail'})")


def _read_text(source, key: str, max_bytes: int, name: str) -> np.ndarray:
  """Concatenates the examples' `key` field, b'\\n'-separated, stopping at `max_bytes` (0 = all).

  A capped read of a huge split touches only the records it needs.
  """
  parts, total = [], 0
  for example in _examples(source):
    if key not in example:
      raise ConfigError(
          f"TFDS dataset {name!r} has no feature {key!r} (features: {sorted(example)}): "
          "set data.tfds_text_key to its text feature")
    text = example[key]
    parts.append(text.encode("utf-8") if isinstance(text, str) else bytes(text))
    total += len(parts[-1]) + 1
    if 0 < max_bytes <= total:
      break
  data = np.frombuffer(b"\n".join(parts), dtype=np.uint8)
  return data[:max_bytes] if max_bytes > 0 else data


def _examples(source, chunk: int = 256):
  """Yields a data source's examples in order, fetched `chunk` indices at a time (fewer reads)."""
  for start in range(0, len(source), chunk):
    yield from source.__getitems__(range(start, min(start + chunk, len(source))))

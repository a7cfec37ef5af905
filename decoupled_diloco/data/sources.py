"""Turns `config.data` into a corpus with a train and a held-out eval split, and its tokenizer.

Why one entry point: the trainer, the benchmarks and the colabs all need the same bytes for
the same config, and every way the user can get the config wrong (missing file, unknown
dataset, no network, too little text) should surface here as a one-line ConfigError before
any device or workdir is touched. TensorFlow Datasets is imported only on the 'tfds' path, so
importing the package (and the synthetic / text-file paths) stays fast.
"""

import dataclasses
import pathlib
from typing import Any

import numpy as np

from decoupled_diloco.data import documents
from decoupled_diloco.data import settings as data_settings
from decoupled_diloco.data import synthetic
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError

FEW_DOCUMENTS = 4096  # Sources with fewer documents are cut into pieces of data.chunk_bytes (see documents.py).


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """Train and eval text of a run, as token streams (synthetic, byte-level text file) or documents.

  Token streams are uint8 arrays (in memory for the generated synthetic language, memory-mapped
  for a text file) cut into windows by `batches.LearnerBatches`; documents (TFDS, ArrayRecord,
  a text file under a subword tokenizer) go through the packed grain pipeline. `train` is None
  when it was not asked for (the syncer only evaluates). `optimal_loss` is known only for synthetic data.
  """

  train: np.ndarray | None
  eval: np.ndarray | None
  name: str
  optimal_loss: float | None = None
  tokenizer: Any = tokenizer_lib.ByteTokenizer()
  train_documents: Any = None
  eval_documents: Any = None

  @property
  def packed(self) -> bool:
    """Whether this corpus is documents (packed pipeline) rather than token streams (windows)."""
    return self.eval_documents is not None


def load_corpus(data_cfg, seq_len: int, train: bool = True) -> Corpus:
  """Opens `data_cfg.source` (nothing is read whole); stream splits must hold one window of seq_len + 1.

  `seq_len` is needed because synthetic chains are generated window-aligned (see synthetic.py)
  and because a split shorter than one window cannot produce a single batch. `train=False`
  opens the eval split only (the syncer process never touches training data).
  """
  data_cfg = data_settings.Settings.from_config(data_cfg)
  tokenizer = tokenizer_lib.from_config(data_cfg)
  if data_cfg.source == "synthetic":
    corpus = _synthetic(data_cfg, seq_len, train)
  elif data_cfg.source == "text_file":
    corpus = _text_file(data_cfg, tokenizer)
  elif data_cfg.source == "array_record":
    corpus = _array_record(data_cfg, tokenizer, train)
  else:
    corpus = _tfds(data_cfg, tokenizer, train)
  if corpus.packed:
    return corpus
  for split in ("train", "eval"):
    tokens = getattr(corpus, split)
    if tokens is not None and tokens.size < seq_len + 1:
      raise ConfigError(f"the {split} split of {corpus.name} has {tokens.size} bytes, fewer than one window of "
                        f"seq_len + 1 = {seq_len + 1}: use more data or a smaller model.seq_len")
  return corpus


def _tail_cut(size: int, fraction: float) -> int:
  """Where the eval tail begins: the last `fraction` of the items, so eval never interleaves with train."""
  return size - int(round(size * fraction))


def _synthetic(data_cfg, seq_len: int, train: bool) -> Corpus:
  """Train and eval are independently seeded samples of one seeded Markov language.

  Eval is `eval_fraction` of `num_tokens` (at least one chain), drawn from its own generator
  stream so its text is fresh but comes from exactly the distribution `optimal_loss` describes.
  """
  cfg = data_cfg.synthetic
  language = synthetic.MarkovLanguage.random(cfg.alphabet_size, cfg.order, cfg.concentration, cfg.seed)
  chain_length = synthetic.aligned_chain_length(seq_len)
  num_eval = max(int(round(cfg.num_tokens * data_cfg.eval_fraction)), chain_length)
  train_tokens = (language.sample(cfg.num_tokens, np.random.default_rng([cfg.seed, 1]), chain_length)
                  if train else None)
  eval_ = language.sample(num_eval, np.random.default_rng([cfg.seed, 2]), chain_length)
  name = (f"synthetic(alphabet_size={cfg.alphabet_size}, order={cfg.order}, "
          f"concentration={cfg.concentration}, seed={cfg.seed})")
  return Corpus(train_tokens, eval_, name, language.optimal_loss(seq_len))


def _text_file(data_cfg, tokenizer) -> Corpus:
  """Any local file, memory-mapped (never read whole); its tail is the eval split.

  Bytes stay a token stream cut into windows (as before grain); a subword tokenizer reads the
  file as one document in pieces through the packed pipeline.
  """
  path = pathlib.Path(data_cfg.path).expanduser()
  if not path.is_file():
    raise ConfigError(f"data.path {str(data_cfg.path)!r} does not exist: point --config.data.path at a text file")
  size = path.stat().st_size
  cut = _tail_cut(size, data_cfg.eval_fraction)
  name = f"text_file({path})"
  if tokenizer.name == "byte":
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    return Corpus(data[:cut], data[cut:], name)
  return Corpus(None, None, name, tokenizer=tokenizer,
                train_documents=documents.FileDocuments(str(path), 0, cut, data_cfg.chunk_bytes),
                eval_documents=documents.FileDocuments(str(path), cut, size, data_cfg.chunk_bytes))


def _array_record(data_cfg, tokenizer, train: bool) -> Corpus:
  """Shards written by experiments.prepare_data: DIR/train* and DIR/eval* (one document per record).

  Without `train` (the syncer) the train shards are not opened: cutting few documents into pieces
  reads each one once.
  """
  root = pathlib.Path(data_cfg.path).expanduser()
  if not root.is_dir():
    raise ConfigError(f"data.path {str(data_cfg.path)!r} is not a directory: prepare one with "
                      "python -m experiments.prepare_data --input=... --output=DIR and set data.path=DIR")
  train_docs = (_split_few(documents.array_record_documents(str(root / "train-*.array_record*")), data_cfg.chunk_bytes)
                if train else None)
  eval_ = _split_few(documents.array_record_documents(str(root / "eval-*.array_record*")), data_cfg.chunk_bytes)
  return Corpus(None, None, f"array_record({root})", tokenizer=tokenizer, train_documents=train_docs,
                eval_documents=eval_)


def open_tfds(name: str, data_dir: str = ""):
  """`tfds.data_source` of every split of TFDS dataset `name` (ArrayRecord, random access), or a ConfigError.

  `data_dir` '' is TFDS's default ($TFDS_DATA_DIR, else ~/tensorflow_datasets); a dataset not there
  yet is downloaded and prepared into it first.
  """
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (heavy, tfds-only)

  if not hasattr(tfds, "data_source"):  # Without TensorFlow, importing TFDS logs the failure and gives no API.
    raise ConfigError(f"TFDS dataset {name!r} needs TensorFlow: pip install 'decoupled_diloco[tfds]' "
                      "(tensorflow-cpu, array-record)")
  where = data_dir or "the default TFDS data dir ($TFDS_DATA_DIR, else ~/tensorflow_datasets)"
  try:
    return tfds.data_source(name, data_dir=data_dir or None, split=None, builder_kwargs={"file_format": "array_record"})
  except tfds.core.DatasetNotFoundError as e:
    raise ConfigError(f"TFDS dataset {name!r} is unknown: set data.tfds_name to a name from "
                      "tfds.list_builders(), e.g. 'tiny_shakespeare'") from e
  except ImportError as e:
    raise ConfigError(f"preparing TFDS dataset {name!r} needs {e.name or 'a missing package'}: "
                      "pip install 'decoupled_diloco[tfds]' (tensorflow-cpu, array-record)") from e
  except Exception as e:  # Download/prepare failures come from many libraries (requests, IO, TF).
    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    raise ConfigError(
        f"TFDS dataset {name!r} could not be opened as ArrayRecord in {where} ({reason}): give the machine "
        "network access, point data.tfds_data_dir at a prepared copy, or convert a TFRecord copy with "
        "python -m experiments.prepare_data --tfds_name=...") from e


def _split_few(docs, chunk_bytes: int):
  """Sources with few documents (tiny Shakespeare has one per split) are served in pieces."""
  return documents.SplitDocuments(docs, chunk_bytes) if len(docs) < FEW_DOCUMENTS else docs


def _tfds(data_cfg, tokenizer, train: bool) -> Corpus:
  """A TFDS text dataset through `tfds.data_source` (ArrayRecord, random access); nothing read up front.

  Eval is the dataset's 'validation' split, else 'test', else the tail of 'train'.
  """
  import grain  # pylint: disable=g-import-not-at-top
  name = data_cfg.tfds_name
  splits = open_tfds(name, data_cfg.tfds_data_dir)
  if "train" not in splits:
    raise ConfigError(f"TFDS dataset {name!r} has no 'train' split (it has {sorted(splits)}): choose a "
                      "data.tfds_name with a train split")
  key, chunk = data_cfg.tfds_text_key, data_cfg.chunk_bytes
  held_out = next((s for s in ("validation", "test") if s in splits), None)
  train_docs = None
  if held_out is None:
    everything = grain.MapDataset.source(_split_few(documents.RecordDocuments(splits["train"], key, name), chunk))
    cut = _tail_cut(len(everything), data_cfg.eval_fraction)
    train_docs, eval_docs = everything[:cut], everything[cut:]
  else:
    eval_docs = _split_few(documents.RecordDocuments(splits[held_out], key, name), chunk)
    if train:
      train_docs = _split_few(documents.RecordDocuments(splits["train"], key, name), chunk)
  return Corpus(None, None, f"tfds({name}, eval={held_out or 'train tail'})", tokenizer=tokenizer,
                train_documents=train_docs, eval_documents=eval_docs)

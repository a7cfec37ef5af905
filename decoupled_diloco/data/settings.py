"""`config.data` as a typed, frozen group: where the text comes from and how it is dealt to learners.

Everything about the data that can be checked without opening a file or a dataset is checked
here, once, when `experiment.validate` (or `sources.load_corpus`) builds the group; missing files,
unknown TFDS datasets and too-short splits are found when the corpus opens.
"""

import dataclasses

import ml_collections

from decoupled_diloco import settings as settings_lib

SOURCES = ("synthetic", "text_file", "array_record", "tfds")
SPLITS = ("iid", "noniid")  # How windows are dealt to learners: shuffled, or contiguous.


@dataclasses.dataclass(frozen=True)
class Synthetic:
  """`config.data.synthetic`: the embedded Markov language, whose optimal loss is known exactly."""
  alphabet_size: int = 16
  order: int = 2
  concentration: float = 0.1
  num_tokens: int = 2_000_000
  seed: int = 1234

  def __post_init__(self):
    settings_lib.check(((self.num_tokens
                         >= 1, f"data.synthetic.num_tokens={self.num_tokens} must be positive: use e.g. 2_000_000"),))


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.data`, validated; every field is described in configs/default.py."""
  source: str
  path: str
  tokenizer: str
  tokenizer_path: str
  chunk_bytes: int
  prefetch: int
  tfds_name: str
  tfds_data_dir: str
  tfds_text_key: str
  split: str
  eval_fraction: float
  synthetic: Synthetic = Synthetic()
  mask_document_boundaries: bool = False

  def __post_init__(self):
    settings_lib.check((
        (self.source in SOURCES, f"data.source {self.source!r} is unknown: use one of {', '.join(SOURCES)}"),
        (self.split in SPLITS, f"data.split={self.split!r} is unknown: use 'iid' or 'noniid'"),
        (0.0 < self.eval_fraction < 1.0, f"data.eval_fraction={float(self.eval_fraction)} must be in (0, 1): "
         "use e.g. 0.1"),
        (self.chunk_bytes >= 256, f"data.chunk_bytes={self.chunk_bytes} must be >= 256: use e.g. 4096"),
        (self.source != "tfds" or
         self.tfds_name, "data.source='tfds' needs a dataset: set --config.data.tfds_name, e.g. tiny_shakespeare"),
        (self.source != "synthetic" or self.tokenizer == "byte",
         "the synthetic language is byte-level: use --config.data.tokenizer=byte with source='synthetic'"),
        (not self.mask_document_boundaries or
         (self.source, self.tokenizer) not in (("synthetic", "byte"), ("text_file", "byte")),
         f"data.mask_document_boundaries needs documents, but source={self.source!r} with the byte tokenizer is one "
         "token stream: use source='array_record' (experiments.prepare_data) or 'tfds', or a subword text_file"),
    ))

  @classmethod
  def from_config(cls, data_cfg) -> "Settings":
    """The data group of a config (or a Settings already); unknown fields, nested ones too, are refused by name."""
    if isinstance(data_cfg, cls):
      return data_cfg
    synthetic = settings_lib.from_config(Synthetic, data_cfg.get("synthetic", ml_collections.ConfigDict()),
                                         "data.synthetic")
    flat = ml_collections.ConfigDict({k: v for k, v in data_cfg.items() if k != "synthetic"})
    return dataclasses.replace(settings_lib.from_config(cls, flat, "data"), synthetic=synthetic)

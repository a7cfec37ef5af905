"""Per-learner shards of a corpus and deterministic, resumable batches.

Why this shape: Decoupled DiLoCo learners run asynchronously, restart independently and may
be re-spawned mid-run, so a learner's batch must be a pure function of (data, learner, step,
seed): no iterator state to checkpoint, and resuming at step k replays exactly the batches an
uninterrupted run would have seen. Shards are disjoint so learners never train on the same
window, which is what makes their outer gradients carry different information. This is the
window path (synthetic language, byte-level text); document sources go through the packed
pipeline (pipeline.py). Windows, 'iid' / 'noniid' sharding and epochs: docs/data.md.
"""

import math

import numpy as np

from decoupled_diloco.errors import ConfigError

SPLITS = ("iid", "noniid")


def make_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
  """Non-overlapping [num_windows, seq_len + 1] view of `tokens` (no copy), tail dropped."""
  if seq_len < 1:
    raise ConfigError(f"model.seq_len={seq_len} must be >= 1: use e.g. 256")
  width = seq_len + 1
  num_windows = tokens.size // width
  return tokens[:num_windows * width].reshape(num_windows, width)


def shard_indices(num_windows: int, learner_index: int, num_learners: int, split: str, seed: int) -> np.ndarray:
  """Window indices owned by one learner; the M shards are disjoint and cover all windows."""
  if num_learners < 1 or not 0 <= learner_index < num_learners:
    raise ValueError(f"learner_index={learner_index} must be in [0, num_learners={num_learners})")
  if split == "iid":
    perm = np.random.default_rng([seed, 0]).permutation(num_windows)
    return perm[learner_index::num_learners]
  if split == "noniid":
    return np.array_split(np.arange(num_windows), num_learners)[learner_index]
  raise ConfigError(f"data.split {split!r} is unknown: use one of {', '.join(SPLITS)}")


class LearnerBatches:
  """The batches of one learner: `batch(step)` is a pure function of step (see module doc)."""

  def __init__(self, tokens: np.ndarray, seq_len: int, *, learner_index: int, num_learners: int, batch_size: int,
               split: str = "iid", seed: int = 0, rows: range | None = None):
    """Shards the train `tokens` (e.g. `Corpus.train`) and fixes this learner's share.

    Raises ConfigError if some learner would get no window at all, since its shard could
    then produce no batch.
    """
    if batch_size < 1:
      raise ConfigError(f"learners.batch_size entry {batch_size} must be >= 1: use a positive batch size")
    self._windows = make_windows(tokens, seq_len)
    num_windows = self._windows.shape[0]
    if num_windows < num_learners:
      raise ConfigError(f"the train split has {num_windows} windows of seq_len + 1 = {seq_len + 1} bytes, fewer "
                        f"than the {num_learners} learners: use more data or a smaller model.seq_len")
    self.shard = shard_indices(num_windows, learner_index, num_learners, split, seed)
    self.seq_len = seq_len
    self.batch_size = batch_size
    self._seed = seed
    self._learner_index = learner_index
    self._order_cache: dict[int, np.ndarray] = {}
    self.rows = rows if rows is not None else range(batch_size)
    import grain  # pylint: disable=g-import-not-at-top  (grain only where it is used: a syncer starts sooner)
    self._dataset = grain.MapDataset.range(2**62).map(self._rows_of_step)

  @property
  def tokens_per_batch(self) -> int:
    """Predicted tokens per batch (batch_size * seq_len), the unit for throughput and budgets."""
    return self.batch_size * self.seq_len

  @property
  def num_windows(self) -> int:
    """Windows in this learner's shard, i.e. the stream positions in one epoch."""
    return self.shard.size

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """Shard window indices in epoch `epoch`'s order; the two latest epochs are memoised."""
    if epoch not in self._order_cache:
      rng = np.random.default_rng([self._seed, 1, self._learner_index, epoch])
      self._order_cache = {e: o for e, o in self._order_cache.items() if e == epoch - 1}
      self._order_cache[epoch] = self.shard[rng.permutation(self.shard.size)]
    return self._order_cache[epoch]

  def batch(self, step: int) -> np.ndarray:
    """int32 [len(rows), seq_len + 1] byte ids of `step`; input [:, :-1], target [:, 1:]."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    return self._dataset[step]

  def state(self) -> dict:
    """Nothing to save: every batch is computed from its step alone."""
    return {}

  def restore(self, state: dict) -> None:
    """Nothing to restore (see `state`)."""
    del state

  def close(self) -> None:
    """No threads to stop."""

  def _rows_of_step(self, step: int) -> np.ndarray:
    positions = step * self.batch_size + np.asarray(self.rows, np.int64)
    epochs, offsets = np.divmod(positions, self.shard.size)
    rows = np.empty(positions.size, dtype=np.int64)
    for epoch in np.unique(epochs):
      mask = epochs == epoch
      rows[mask] = self._epoch_order(int(epoch))[offsets[mask]]
    return self._windows[rows].astype(np.int32)


def learner_batches(corpus, seq_len: int, *, learner_index: int, num_learners: int, batch_size: int, split: str,
                    seed: int, rows: range | None = None, prefetch: int = 2):
  """Learner `learner_index`'s batches (this process's `rows` of them): windows or packed documents."""
  if corpus.packed:
    from decoupled_diloco.data import pipeline  # pylint: disable=g-import-not-at-top  (imports grain)
    return pipeline.PackedBatches(corpus.train_documents, corpus.tokenizer, seq_len, learner_index=learner_index,
                                  num_learners=num_learners, batch_size=batch_size, split=split, seed=seed, rows=rows,
                                  prefetch=prefetch)
  return LearnerBatches(corpus.train, seq_len, learner_index=learner_index, num_learners=num_learners,
                        batch_size=batch_size, split=split, seed=seed, rows=rows)


def eval_batches(corpus, seq_len: int, batch_size: int, num_batches: int) -> list[np.ndarray]:
  """Fixed held-out batches: the eval split's windows in order, wrapping if it is short.

  No randomness, so every learner, every evaluation and every rerun scores the same text and
  eval losses are comparable across steps and runs.
  """
  if corpus.packed:
    from decoupled_diloco.data import pipeline  # pylint: disable=g-import-not-at-top  (imports grain)
    windows = pipeline.eval_windows(corpus.eval_documents, corpus.tokenizer, seq_len, num_batches * batch_size)
    return list(windows.reshape(num_batches, batch_size, -1))
  windows = make_windows(corpus.eval, seq_len)
  if windows.shape[0] == 0:
    raise ConfigError(f"the eval split of {corpus.name} has {corpus.eval.size} bytes, fewer than one window of "
                      f"seq_len + 1 = {seq_len + 1}: use more eval data or a smaller model.seq_len")
  rows = np.arange(num_batches * batch_size) % windows.shape[0]
  return [b.astype(np.int32) for b in windows[rows].reshape(num_batches, batch_size, -1)]


def bits_per_byte_factor(tokenizer, batches: list[np.ndarray]) -> float:
  """Converts a mean eval loss in nats per predicted token into bits per byte of the text predicted.

  bits/byte = loss * (predicted tokens / their text bytes) / ln 2, with the bytes behind each
  target id from `tokenizer.token_bytes()`; the same text has the same byte count under every tokenizer.
  """
  sizes = tokenizer.token_bytes()
  targets = [b[:, 1:] for b in batches]
  num_bytes = sum(int(sizes[t].sum()) for t in targets)
  num_tokens = sum(t.size for t in targets)
  return num_tokens / max(num_bytes, 1) / math.log(2)

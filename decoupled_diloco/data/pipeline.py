"""The grain pipeline of document sources: shard, shuffle, repeat, tokenize, pack, prefetch.

Why one packed stream per batch row: row r of every batch of learner m comes from its own stream
over documents `shard_m[r::B]`, each reshuffled every epoch (seeded by seed, learner, row),
tokenized with an end-of-document token after each document and packed (grain's concat-then-split)
into windows of seq_len + 1 tokens. So the global batch does not depend on how many processes
build it: process p of P builds rows [p B/P, (p+1) B/P) only, reads only their documents, and the
rows it assembles (jax.make_array_from_process_local_data) are the rows one process would build.

Why state: packing makes a batch depend on every document before it, so a step is reached by
iterating. `PackedBatches.batch(step)` stays a pure function of (seed, learner, step): the next
step comes from the prefetching iterator, any other step by replaying from the start or from a
saved iterator state (`state()` / `restore()`, kept in learner checkpoints), which skips the replay.
"""

import weakref

import grain
import numpy as np

from decoupled_diloco.errors import ConfigError


def _seed(*parts: int) -> int:
  """A 32-bit grain seed from several integers (grain seeds are single ints)."""
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def as_dataset(documents) -> grain.MapDataset:
  """A grain MapDataset over a document source (or the dataset itself)."""
  return documents if isinstance(documents, grain.MapDataset) else grain.MapDataset.source(documents)


def learner_documents(documents, learner_index: int, num_learners: int, split: str, seed: int) -> grain.MapDataset:
  """Learner m's disjoint share of the documents, lazily (no index array the size of the corpus).

  'iid': a seeded shuffle of all documents dealt round-robin; 'noniid': the m-th contiguous block.
  """
  ds = as_dataset(documents)
  if split == "iid":
    return ds.shuffle(seed=_seed(seed, 0))[learner_index::num_learners]
  bounds = np.linspace(0, len(documents), num_learners + 1).astype(int)
  return ds[bounds[learner_index]:bounds[learner_index + 1]]


def packed_stream(documents: grain.MapDataset, tokenizer, width: int, shuffle_seed: int | None) -> grain.IterDataset:
  """Endless windows of `width` token ids packed from `documents` (shuffled per epoch unless seed is None)."""
  if shuffle_seed is not None:
    documents = documents.shuffle(seed=shuffle_seed)
  eod = np.asarray([tokenizer.eod_id], np.int32)

  def tokenize(item):
    text, ends = item
    ids = tokenizer.encode_bytes(text)
    return {"tokens": np.concatenate([ids, eod]) if ends else ids}

  # Rows read sequentially: one worker thread per learner (PackedBatches) prefetches whole batches.
  stream = documents.repeat().map(tokenize).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  packed = grain.experimental.ConcatThenSplitIterDataset(stream, length_struct={"tokens": width})
  return packed.map(lambda element: element["tokens"])


class PackedBatches:
  """This process's rows of one learner's batches from document sources (see module doc)."""

  def __init__(self, documents, tokenizer, seq_len: int, *, learner_index: int, num_learners: int, batch_size: int,
               split: str, seed: int, rows: range | None = None, prefetch: int = 2):
    """Builds the row streams; ConfigError when a row of some learner would get no document."""
    self.seq_len, self.batch_size = seq_len, batch_size
    self.rows = rows if rows is not None else range(batch_size)
    share = learner_documents(documents, learner_index, num_learners, split, seed)
    if len(share) < batch_size:
      raise ConfigError(f"learner {learner_index} gets {len(share)} documents (or pieces) for its {batch_size} batch "
                        "rows: use more data, fewer learners or rows, or a smaller data.chunk_bytes")
    streams = [
        packed_stream(share[r::batch_size], tokenizer, seq_len + 1, _seed(seed, 1, learner_index, r)) for r in self.rows
    ]
    dataset = grain.experimental.ZipIterDataset(streams).map(np.stack)
    if prefetch > 0:
      dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
    self._dataset = dataset
    self._open: list = []  # The live iterator; closed at exit too, before its prefetch thread's modules go away.
    weakref.finalize(self, _close_all, self._open)
    self._next, self._last = 0, None

  @property
  def _iterator(self):
    return self._open[0] if self._open else None

  @property
  def tokens_per_batch(self) -> int:
    """Predicted tokens per (global) batch: packing leaves no padding."""
    return self.batch_size * self.seq_len

  def _seek(self, step: int, state: dict | None = None) -> None:
    _close_all(self._open)
    self._open.append(iter(self._dataset))
    self._next = 0
    if state is not None:
      self._iterator.set_state(state["iterator"])
      self._next = state["step"]
    while self._next < step:
      next(self._iterator)
      self._next += 1

  def batch(self, step: int) -> np.ndarray:
    """int32 [len(rows), seq_len + 1] ids of `step` for this process's rows (a pure function of step)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    if self._last is not None and self._last[0] == step:
      return self._last[1]
    if self._iterator is None or step != self._next:
      self._seek(step)
    value = next(self._iterator).astype(np.int32)
    self._next += 1
    self._last = (step, value)
    return value

  def state(self) -> dict:
    """JSON-able position: the step the next `batch` call starts from and grain's iterator state."""
    if self._iterator is None:
      self._seek(0)
    return {"step": self._next, "iterator": self._iterator.get_state()}

  def restore(self, state: dict) -> None:
    """Continues from a `state()` taken by an identical pipeline, without replaying the steps before it."""
    self._seek(state["step"], state)
    self._last = None

  def close(self) -> None:
    """Stops the prefetch thread (a later `batch` call starts a new one)."""
    _close_all(self._open)


def _close_all(iterators: list) -> None:
  while iterators:
    iterators.pop().close()


def eval_windows(documents, tokenizer, seq_len: int, count: int) -> np.ndarray:
  """The first `count` packed windows of the eval documents in order (repeating a short split)."""
  iterator = iter(packed_stream(as_dataset(documents), tokenizer, seq_len + 1, None))
  try:
    return np.stack([next(iterator) for _ in range(count)]).astype(np.int32)
  finally:
    iterator.close()

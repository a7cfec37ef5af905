"""Tests for decoupled_diloco.data: tokenizer, synthetic Markov corpus, sources and batches."""

import math
import sys
import time
import types

import ml_collections
import numpy as np
import pytest

from configs import hetero_shakespeare, streaming_shakespeare, tiny_shakespeare
from decoupled_diloco.data import batches
from decoupled_diloco.data import sources
from decoupled_diloco.data import synthetic
from decoupled_diloco.data import tokenizer
from decoupled_diloco.errors import ConfigError
from tests.tfds_fixture import SHARED_TEXT, tiny_shakespeare_data_dir  # noqa: F401  (pytest fixture)


def data_config(**overrides) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict(
      dict(source="synthetic", path="", tfds_name="tiny_shakespeare", tfds_data_dir="", tfds_text_key="text",
           split="iid", eval_fraction=0.1, tokenizer="byte", tokenizer_path="", chunk_bytes=4096, prefetch=2,
           synthetic=dict(alphabet_size=16, order=2, concentration=0.5, num_tokens=50_000, seed=7)))
  cfg.update(overrides)
  return cfg


def symbol_indices(language: synthetic.MarkovLanguage, tokens: np.ndarray) -> np.ndarray:
  lookup = np.full(256, -1)
  lookup[np.frombuffer(language.alphabet.encode(), np.uint8)] = np.arange(language.alphabet_size)
  idx = lookup[tokens]
  assert idx.min() >= 0, "sample contains bytes outside the alphabet"
  return idx


def binary_entropy(p: float) -> float:
  return -p * math.log(p) - (1 - p) * math.log(1 - p)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip():
  text = "First Citizen:\nBefore we proceed — ünïcödé ✓"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.uint8 and tokenizer.VOCAB_SIZE == 256
  assert ids.size == len(text.encode("utf-8"))
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode(ids.astype(np.int32).tolist()) == text
  assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # A cut multi-byte char is replaced.


# ----------------------------------------------------------------------------- synthetic


def test_two_symbol_order_one_chain_matches_hand_computation():
  transitions = np.array([[0.9, 0.1], [0.5, 0.5]])
  language = synthetic.MarkovLanguage(transitions, alphabet="ab")
  np.testing.assert_allclose(language.stationary, [5 / 6, 1 / 6], atol=1e-12)
  expected = 5 / 6 * binary_entropy(0.1) + 1 / 6 * math.log(2)
  assert language.order == 1
  assert language.entropy_rate == pytest.approx(expected, abs=1e-12)
  for seq_len in (1, 7, 256):  # Order 1: every target has a full context.
    assert language.optimal_loss(seq_len) == pytest.approx(expected, abs=1e-12)


def test_order_two_optimal_loss_by_hand_and_order_zero():
  # Order 2 over {a,b}: next symbol repeats the older symbol with prob 0.8.
  rows = [[0.8, 0.2], [0.8, 0.2], [0.2, 0.8], [0.2, 0.8]]  # States aa, ab, ba, bb.
  language = synthetic.MarkovLanguage(np.array(rows), alphabet="ab")
  np.testing.assert_allclose(language.stationary, [0.25] * 4, atol=1e-12)
  h = binary_entropy(0.2)
  assert language.entropy_rate == pytest.approx(h, abs=1e-12)
  # Target 1 sees one symbol, which is independent of the next: pays ln 2; the rest pay h.
  assert language.optimal_loss(1) == pytest.approx(math.log(2), abs=1e-12)
  assert language.optimal_loss(4) == pytest.approx((math.log(2) + 3 * h) / 4, abs=1e-12)
  iid = synthetic.MarkovLanguage(np.array([[0.7, 0.2, 0.1]]), alphabet="xyz")
  assert iid.order == 0
  expected = -sum(p * math.log(p) for p in (0.7, 0.2, 0.1))
  assert iid.entropy_rate == pytest.approx(expected)
  assert iid.optimal_loss(5) == pytest.approx(expected)


def test_entropy_rate_matches_monte_carlo():
  language = synthetic.MarkovLanguage.random(alphabet_size=8, order=2, concentration=0.5, seed=3)
  chain_length = 1000
  tokens = language.sample(2_000_000, np.random.default_rng(0), chain_length)
  x = symbol_indices(language, tokens).reshape(-1, chain_length)
  states = x[:, :-2] * 8 + x[:, 1:-1]
  nll = -np.log(language.transitions[states, x[:, 2:]])
  # 2M draws of a quantity with std ~1: standard error ~1e-3.
  assert nll.mean() == pytest.approx(language.entropy_rate, abs=5e-3)


def test_optimal_loss_matches_plug_in_estimate_on_aligned_windows():
  """Windows cut at offset 0 with stride seq_len+1 start at stationary states, so the empirical
  conditional entropy of target 1 given the window's first byte is optimal_loss(1)."""
  language = synthetic.MarkovLanguage.random(alphabet_size=4, order=2, concentration=0.3, seed=1)
  seq_len = 1
  tokens = language.sample(1_000_000, np.random.default_rng(5), synthetic.aligned_chain_length(seq_len))
  windows = symbol_indices(language, batches.make_windows(tokens, seq_len))
  joint = np.bincount(windows[:, 0] * 4 + windows[:, 1], minlength=16) / windows.shape[0]
  marginal = joint.reshape(4, 4).sum(1)
  plug_in = -(joint * np.log(joint)).sum() + (marginal * np.log(marginal)).sum()
  optimal = language.optimal_loss(seq_len)
  assert optimal - language.entropy_rate > 0.05  # The check below can tell them apart.
  assert plug_in == pytest.approx(optimal, abs=7e-3)


def test_optimal_loss_bounds_and_monotonicity():
  language = synthetic.MarkovLanguage.random(alphabet_size=12, order=3, concentration=0.4, seed=0)
  losses = [language.optimal_loss(t) for t in (1, 2, 3, 8, 64, 1024)]
  assert all(loss >= language.entropy_rate - 1e-12 for loss in losses)
  assert all(a >= b - 1e-12 for a, b in zip(losses, losses[1:]))
  assert losses[0] <= math.log(12) + 1e-12
  assert losses[-1] == pytest.approx(language.entropy_rate, abs=1e-2)


def test_generation_is_deterministic_in_the_seed():

  def make(seed, rng_seed):
    language = synthetic.MarkovLanguage.random(16, 2, 0.5, seed)
    return language.sample(20_000, np.random.default_rng(rng_seed), 400)

  first = make(0, 0)
  assert first.dtype == np.uint8 and first.size == 20_000
  np.testing.assert_array_equal(first, make(0, 0))
  assert not np.array_equal(first, make(1, 0))
  assert not np.array_equal(first, make(0, 1))


def test_synthetic_corpus_is_seeded_and_knows_its_optimum():
  cfg = data_config()
  corpus = sources.load_corpus(cfg, seq_len=64)
  again = sources.load_corpus(cfg, seq_len=64)
  np.testing.assert_array_equal(corpus.train, again.train)
  np.testing.assert_array_equal(corpus.eval, again.eval)
  assert corpus.train.size == 50_000 and corpus.eval.size == 5_000
  assert not np.array_equal(corpus.train[:5_000], corpus.eval)
  assert set(np.unique(corpus.train).tobytes().decode()) <= set(synthetic.ALPHABET[:16])
  language = synthetic.MarkovLanguage.random(16, 2, 0.5, 7)
  assert corpus.optimal_loss == pytest.approx(language.optimal_loss(64))


# ----------------------------------------------------------------------------- sources


def test_text_file_source_splits_the_tail(tmp_path):
  path = tmp_path / "corpus.txt"
  text = ("To be, or not to be, that is the question.\n" * 200).encode()
  path.write_bytes(text)
  corpus = sources.load_corpus(data_config(source="text_file", path=str(path)), seq_len=32)
  assert corpus.optimal_loss is None
  assert corpus.train.tobytes() + corpus.eval.tobytes() == text
  assert corpus.eval.size == round(len(text) * 0.1)


@pytest.mark.parametrize("overrides, match", [
    (dict(source="text_file", path="/nonexistent/x.txt"), "does not exist"),
    (dict(source="parquet"), "unknown"),
    (dict(eval_fraction=1.5), "eval_fraction"),
    (dict(synthetic=dict(alphabet_size=500, order=1, concentration=0.5, num_tokens=10, seed=0)), "alphabet_size"),])
def test_config_errors(overrides, match):
  with pytest.raises(ConfigError, match=match):
    sources.load_corpus(data_config(**overrides), seq_len=16)


def test_corpus_shorter_than_one_window_is_a_config_error(tmp_path):
  path = tmp_path / "tiny.txt"
  path.write_bytes(b"x" * 100)
  with pytest.raises(ConfigError, match="fewer than one window"):
    sources.load_corpus(data_config(source="text_file", path=str(path)), seq_len=64)


def test_unknown_tfds_name_fails_fast_without_network(tmp_path):
  cfg = data_config(source="tfds", tfds_name="no_such_dataset_xyz", tfds_data_dir=str(tmp_path))
  start = time.monotonic()
  with pytest.raises(ConfigError, match="unknown"):
    sources.load_corpus(cfg, seq_len=16)
  assert time.monotonic() - start < 20


def test_tfds_without_tensorflow_names_the_extra(monkeypatch):
  """Without TensorFlow, importing TFDS logs its failure and leaves a module without the API."""
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", types.ModuleType("tensorflow_datasets"))
  with pytest.raises(ConfigError, match=r"needs TensorFlow: pip install 'decoupled_diloco\[tfds\]'"):
    sources.load_corpus(data_config(source="tfds"), seq_len=16)


@pytest.mark.slow  # Long: the fast subset leaves it to CI.
def test_tfds_tiny_shakespeare_offline(tiny_shakespeare_data_dir):  # noqa: F811
  cfg = data_config(source="tfds", tfds_name="tiny_shakespeare", tfds_data_dir=str(tiny_shakespeare_data_dir))
  corpus = sources.load_corpus(cfg, seq_len=128)
  assert corpus.packed and corpus.optimal_loss is None
  # One document per split, dealt out in newline-aligned pieces that cover it exactly once.
  pieces = [corpus.train_documents[i] for i in range(len(corpus.train_documents))]
  assert len(pieces) > 200 and pieces[0][0].startswith(b"First Citizen")
  assert all(p[0].endswith(b"\n") for p in pieces[:-1])
  assert [p[1] for p in pieces] == [False] * (len(pieces) - 1) + [True]
  train_bytes = sum(len(p[0]) for p in pieces)
  eval_bytes = sum(len(corpus.eval_documents[i][0]) for i in range(len(corpus.eval_documents)))
  assert eval_bytes > 10_000 and train_bytes + eval_bytes < 1_115_394  # Train + validation, not test.
  evals = batches.eval_batches(corpus, seq_len=128, batch_size=4, num_batches=2)
  assert evals[0].shape == (4, 129) and evals[0].dtype == np.int32
  assert bytes(evals[0][0].astype(np.uint8)) == corpus.eval_documents[0][0][:129]
  syncer_view = sources.load_corpus(cfg, seq_len=128, train=False)
  assert syncer_view.train_documents is None and len(syncer_view.eval_documents) == len(corpus.eval_documents)


@pytest.mark.slow  # Long: the fast subset leaves it to CI.
def test_shakespeare_configs_read_through_tfds_the_text_of_the_plain_file(tiny_shakespeare_data_dir):  # noqa: F811
  """The configs the README names read tiny Shakespeare through TFDS (nothing outside a clone); they train on the
  bytes the plain file's train part holds (one byte fewer) and evaluate on TFDS's validation split, the 55,770
  bytes that follow it, where the file's last 10% used to be the eval split."""
  data = tiny_shakespeare.get_config().data
  assert hetero_shakespeare.get_config().data == streaming_shakespeare.get_config().data == data
  assert data.source == "tfds" and data.tfds_name == "tiny_shakespeare" and data.tokenizer == "byte"
  data.tfds_data_dir = str(tiny_shakespeare_data_dir)
  corpus = sources.load_corpus(data, seq_len=128)
  plain = sources.load_corpus(data_config(source="text_file", path=str(SHARED_TEXT)), seq_len=128)
  train = b"".join(corpus.train_documents[i][0] for i in range(len(corpus.train_documents)))
  held_out = b"".join(corpus.eval_documents[i][0] for i in range(len(corpus.eval_documents)))
  assert len(train) == plain.train.size - 1 == 1_003_854 and len(held_out) == 55_770
  assert (bytes(plain.train) + bytes(plain.eval)).startswith(train + held_out)
  assert corpus.tokenizer.encode_bytes(train[:4096]).tolist() == plain.train[:4096].tolist()  # Same ids.


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("split", ["iid", "noniid"])
def test_shards_are_disjoint_and_cover_all_windows(split):
  num_windows, num_learners = 103, 4
  shards = [batches.shard_indices(num_windows, m, num_learners, split, seed=3) for m in range(num_learners)]
  together = np.concatenate(shards)
  assert together.size == num_windows
  np.testing.assert_array_equal(np.sort(together), np.arange(num_windows))
  assert max(s.size for s in shards) - min(s.size for s in shards) <= 1
  if split == "noniid":  # Contiguous blocks in order: learner m reads the m-th part of the text.
    np.testing.assert_array_equal(together, np.arange(num_windows))
  else:
    assert not np.array_equal(together, np.arange(num_windows))


def make_learner(tokens, learner_index=0, **kwargs):
  args = dict(seq_len=15, learner_index=learner_index, num_learners=3, batch_size=8, seed=11)
  args.update(kwargs)
  return batches.LearnerBatches(tokens, **args)


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, 256, size=16 * 300 + 5).astype(np.uint8)


def test_batches_are_pure_and_resumable(tokens):
  run = make_learner(tokens)
  continued = [run.batch(step) for step in range(40)]  # 100 windows, 8 per batch: crosses epochs.
  resumed = make_learner(tokens)
  for step in range(25, 40):
    np.testing.assert_array_equal(resumed.batch(step), continued[step])
  np.testing.assert_array_equal(run.batch(3), continued[3])  # Going back is also exact.
  first = continued[0]
  assert first.dtype == np.int32 and first.shape == (8, 16) and run.tokens_per_batch == 8 * 15


def test_batches_visit_own_shard_once_per_epoch(tokens):
  run = make_learner(tokens, batch_size=10)  # Shard of 100 windows: 10 batches per epoch.
  windows = batches.make_windows(tokens, 15)
  own = {windows[i].tobytes() for i in run.shard}
  for epoch in range(2):
    seen = [row.astype(np.uint8).tobytes() for s in range(10 * epoch, 10 * epoch + 10) for row in run.batch(s)]
    assert len(seen) == len(set(seen)) == run.num_windows and set(seen) == own
  first_epoch = np.concatenate([run.batch(s) for s in range(10)])
  second_epoch = np.concatenate([run.batch(s) for s in range(10, 20)])
  assert not np.array_equal(first_epoch, second_epoch)  # Reshuffled between epochs.


@pytest.mark.parametrize("split", ["iid", "noniid"])
def test_learners_get_different_data(tokens, split):
  rows = [{r.astype(np.uint8).tobytes() for s in range(5) for r in make_learner(tokens, m, split=split).batch(s)}
          for m in range(3)]
  assert not rows[0] & rows[1] and not rows[1] & rows[2] and not rows[0] & rows[2]


def test_shard_smaller_than_batch_wraps(tokens):
  small = tokens[:16 * 4]  # 4 windows, 2 learners: 2 windows each, batch of 5.
  run = make_learner(small, num_learners=2, batch_size=5)
  batch = run.batch(7)
  assert batch.shape == (5, 16)
  assert {r.astype(np.uint8).tobytes() for r in batch
         } == {w.tobytes() for w in batches.make_windows(small, 15)[run.shard]}
  with pytest.raises(ConfigError, match="fewer than the 5 learners"):
    make_learner(small, num_learners=5)
  with pytest.raises(ConfigError, match="data.split"):
    make_learner(tokens, split="random")


def test_eval_batches_are_fixed_and_wrap(tmp_path):
  corpus = sources.Corpus(train=np.zeros(0, np.uint8), eval=np.arange(50, dtype=np.uint8), name="toy")
  evals = batches.eval_batches(corpus, seq_len=9, batch_size=4, num_batches=2)  # 5 windows.
  assert len(evals) == 2 and evals[0].shape == (4, 10) and evals[0].dtype == np.int32
  np.testing.assert_array_equal(evals[0][0], np.arange(10))
  np.testing.assert_array_equal(evals[1][1], np.arange(10))  # Row 5 wraps to window 0.
  again = batches.eval_batches(corpus, seq_len=9, batch_size=4, num_batches=2)
  assert all(np.array_equal(a, b) for a, b in zip(evals, again))
  with pytest.raises(ConfigError, match="fewer than one window"):
    batches.eval_batches(corpus, seq_len=63, batch_size=4, num_batches=1)

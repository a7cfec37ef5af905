"""data.mask_document_boundaries: packed documents attend only within themselves, in every attention kernel."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from decoupled_diloco import experiment
from decoupled_diloco import model as model_lib
from decoupled_diloco.data import sources, tokenizer
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.model import transformer
from decoupled_diloco.runtime import lockstep
from tests.helpers import tiny_config, write_documents

EOD = 0


def _cfg(**overrides) -> ml_collections.ConfigDict:
  base = dict(vocab_size=64, seq_len=16, d_model=32, num_layers=2, num_heads=4, d_ff=64, position='rope', mlp='swiglu',
              num_kv_heads=2, document_eod_id=EOD)
  base.update(overrides)
  return ml_collections.ConfigDict(base)


def _two_documents(seq_len: int, boundary: int, seed: int) -> np.ndarray:
  """[1, seq_len + 1]: a random first document ending in EOD at `boundary`, then a fixed second one."""
  first = np.random.default_rng(seed).integers(1, 64, boundary)
  second = np.random.default_rng(99).integers(1, 64, seq_len - boundary)
  return np.concatenate([first, [EOD], second]).astype(np.int32)[None]


def test_each_end_of_document_token_opens_the_next_segment():
  tokens = jnp.asarray([[5, 6, EOD, 7, 8, EOD, 9], [EOD, 1, 2, 3, 4, 5, 6]])
  np.testing.assert_array_equal(transformer.document_segments(tokens, EOD),
                                [[0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize('overrides', [
    dict(attention='xla'),
    dict(attention='dot_product'),
    dict(attention='xla', scan_layers=True, remat='full', loss_chunk=4),
    dict(attention='splash_interpret', seq_len=128, num_layers=1)])
def test_no_token_sees_the_previous_document(overrides):
  """Changing the first document changes nothing after its end-of-document token; without the mask it does."""
  config = _cfg(**overrides)
  seq_len, boundary = config.seq_len, config.seq_len // 2 - 3
  model, params, _ = model_lib.build_model(config, seed=0)
  unmasked, _, _ = model_lib.build_model(_cfg(**overrides, document_eod_id=-1), seed=0)
  a, b = _two_documents(seq_len, boundary, 1), _two_documents(seq_len, boundary, 2)
  logits = jax.jit(model.logits)
  after = slice(boundary, seq_len)  # From the EOD token on: the second document's predictions.
  np.testing.assert_allclose(logits(params, a[:, :-1])[:, after], logits(params, b[:, :-1])[:, after], atol=1e-5)
  assert not np.allclose(logits(params, a[:, :-1])[:, :boundary], logits(params, b[:, :-1])[:, :boundary])
  plain = jax.jit(unmasked.logits)
  assert not np.allclose(plain(params, a[:, :-1])[:, after], plain(params, b[:, :-1])[:, after], atol=1e-5)
  # The same loss and gradients as the reference einsum kernel.
  reference, _, _ = model_lib.build_model(_cfg(seq_len=seq_len, num_layers=config.num_layers), seed=0)
  loss, grads = jax.jit(jax.value_and_grad(model.loss))(params, a)
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference.loss))(params, a)
  np.testing.assert_allclose(loss, ref_loss, atol=1e-4, rtol=0)
  assert max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), grads, ref_grads))) <= 1e-4


def test_a_window_without_documents_ends_is_unchanged():
  config = _cfg()
  model, params, _ = model_lib.build_model(config, seed=0)
  unmasked, _, _ = model_lib.build_model(_cfg(document_eod_id=-1), seed=0)
  batch = jnp.asarray(np.random.default_rng(3).integers(1, 64, (2, 17)), jnp.int32)
  np.testing.assert_allclose(model.loss(params, batch), unmasked.loss(params, batch), atol=1e-6)


def test_the_option_follows_the_tokenizer_and_refuses_token_streams(tmp_path):
  config = tiny_config(
      **{'data.source': 'array_record', 'data.path': str(tmp_path), 'data.mask_document_boundaries': True})
  tokenizer.resolve_model_vocab(config)
  tokenizer.resolve_model_vocab(config)  # Idempotent: every process resolves its own copy.
  assert config.model.document_eod_id == tokenizer.BYTE_EOD_ID
  for source in ('synthetic', 'text_file'):
    with pytest.raises(ConfigError, match='needs documents'):
      experiment.validate(
          tiny_config(
              **{'data.source': source, 'data.path': str(tmp_path / 'x.txt'), 'data.mask_document_boundaries': True}))
  with pytest.raises(ConfigError, match='leave it at -1'):
    tokenizer.resolve_model_vocab(tiny_config(**{'model.document_eod_id': 3}))
  with pytest.raises(ConfigError, match='leave it at -1'):
    model_lib.Settings.from_config(_cfg(document_eod_id=64))


def test_a_masked_packed_run_trains(tmp_path):
  """Byte-level documents (end-of-document byte 0) from ArrayRecord shards, masked, through the lockstep runtime."""
  config = tiny_config(
      outer_steps=2,
      **{'data.source': 'array_record', 'data.path': write_documents(tmp_path), 'data.mask_document_boundaries': True})
  lockstep.run(experiment.build(config), str(tmp_path / 'run'))
  (tmp_path / 'train-00000-of-00001.array_record').unlink()  # The syncer's view opens the eval split only.
  assert len(sources.load_corpus(config.data, 16, train=False).eval_documents) == 20
  assert config.model.document_eod_id == tokenizer.BYTE_EOD_ID
  records = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  losses = [r['loss'] for r in records if r['kind'] == 'train']
  assert losses and all(np.isfinite(losses)) and losses[-1] < losses[0]

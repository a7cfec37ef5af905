"""The grain pipeline of document sources, subword tokenizers, bits per byte, prepare_data and resumes."""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from decoupled_diloco import experiment
from decoupled_diloco.data import batches, pipeline, sources, tokenizer
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.runtime import lockstep
from tests.helpers import quick_compile_env, tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "Second Citizen:\nWould you proceed especially against Caius Marcius? Naïve café, ünïcödé.\n\n") * 60


def _run(*args, env=None):
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                        check=False, env=env)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
  """A tiny SentencePiece model trained through the CLI on a text the test writes."""
  directory = tmp_path_factory.mktemp("tok")
  (directory / "text.txt").write_text(TEXT * 3, encoding="utf-8")
  result = _run("experiments.train_tokenizer", f"--input={directory / 'text.txt'}", "--vocab_size=400",
                f"--output={directory / 'sp.model'}")
  assert result.returncode == 0, result.stderr[-2000:]
  return str(directory / "sp.model")


def test_train_tokenizer_refuses_bad_input(tmp_path):
  result = _run("experiments.train_tokenizer", f"--input={tmp_path / 'missing.txt'}", f"--output={tmp_path / 'x'}")
  assert result.returncode == 2 and result.stderr.startswith("error:") and "does not exist" in result.stderr
  assert not list(tmp_path.iterdir())


def test_same_text_same_byte_count_under_both_tokenizers(sp_model):
  sp, byte = tokenizer.SentencePieceTokenizer(sp_model), tokenizer.ByteTokenizer()
  text = TEXT.encode()
  counts = {}
  for tok in (sp, byte):
    ids = tok.encode_bytes(text)
    sizes = tok.token_bytes()
    counts[tok.name] = (len(ids), int(sizes[ids].sum()))
    # Bits per byte of one window holding the text: predicted tokens over the bytes they stand for.
    expected = (len(ids) - 1) / (len(text) - sizes[ids[0]]) / math.log(2)
    assert batches.bits_per_byte_factor(tok, [ids[None, :]]) == pytest.approx(expected)
  assert counts[sp.name][1] == counts["byte"][1] == len(text)
  assert counts[sp.name][0] < len(text) * 0.6  # Subword pieces really are longer than a byte.


def test_model_vocab_follows_the_tokenizer(sp_model):
  config = tiny_config(**{"data.tokenizer": "sentencepiece", "data.tokenizer_path": sp_model})
  tokenizer.resolve_model_vocab(config)
  assert config.model.vocab_size == 400
  config.model.vocab_size = 512  # Padded: every id has a row.
  tokenizer.resolve_model_vocab(config)
  assert config.model.vocab_size == 512
  config.model.vocab_size = 300
  with pytest.raises(ConfigError, match="does not match"):
    tokenizer.resolve_model_vocab(config)
  with pytest.raises(ConfigError, match="tokenizer_path"):
    tokenizer.resolve_model_vocab(tiny_config(**{"data.tokenizer": "sentencepiece"}))
  with pytest.raises(ConfigError, match="byte-level"):
    sources.load_corpus(tiny_config(**{"data.tokenizer": "sentencepiece", "data.tokenizer_path": sp_model}).data, 16)


DOCS = [((f"document {i} " * (i % 9 + 1)).encode(), True) for i in range(120)]


def _packed(**kwargs):
  args = dict(learner_index=1, num_learners=3, batch_size=4, split="iid", seed=5, prefetch=2)
  args.update(kwargs)
  return pipeline.PackedBatches(DOCS, tokenizer.ByteTokenizer(), 15, **args)


def test_packed_batches_are_a_pure_function_of_step_and_resume_from_their_state():
  run = _packed()
  sequence = [run.batch(s) for s in range(8)]
  assert sequence[0].shape == (4, 16) and sequence[0].dtype == np.int32
  assert (np.concatenate(sequence) == tokenizer.BYTE_EOD_ID).any()  # Documents end with the EOD token.
  jumped = _packed()
  np.testing.assert_array_equal(jumped.batch(6), sequence[6])  # Reached by replaying from the start.
  np.testing.assert_array_equal(jumped.batch(2), sequence[2])  # And backwards.
  state = json.loads(json.dumps(_state_after(run, 5)))  # A checkpoint's metadata is JSON.
  resumed = _packed()
  resumed.restore(state)
  assert resumed._next == 5  # pylint: disable=protected-access  (continued, not replayed)
  np.testing.assert_array_equal(resumed.batch(5), sequence[5])
  np.testing.assert_array_equal(resumed.batch(7), sequence[7])
  for b in (run, jumped, resumed):
    b.close()


def _state_after(run, step):
  run.batch(step - 1)
  return run.state()


def test_process_rows_assemble_the_single_process_batch():
  whole, first, second = _packed(), _packed(rows=range(0, 2)), _packed(rows=range(2, 4))
  for step in range(4):
    np.testing.assert_array_equal(np.concatenate([first.batch(step), second.batch(step)]), whole.batch(step))
  for b in (whole, first, second):
    b.close()


@pytest.mark.parametrize("split", ["iid", "noniid"])
def test_learners_get_disjoint_documents(split):
  shares = [pipeline.learner_documents(DOCS, m, 3, split, seed=1) for m in range(3)]
  texts = [{share[i][0] for i in range(len(share))} for share in shares]
  assert sum(len(t) for t in texts) == len(DOCS) and len(set().union(*texts)) == len(DOCS)
  with pytest.raises(ConfigError, match="documents"):
    pipeline.PackedBatches(DOCS[:5], tokenizer.ByteTokenizer(), 15, learner_index=0, num_learners=2, batch_size=4,
                           split=split, seed=0)


def test_prepare_data_text_file_to_array_record(tmp_path, sp_model):
  text_file = tmp_path / "corpus.txt"
  text_file.write_text(TEXT, encoding="utf-8")
  out = tmp_path / "prepared"
  result = _run("experiments.prepare_data", f"--input={text_file}", f"--output={out}", "--chunk_bytes=512",
                "--num_shards=2")
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(list(out.glob("train-*.array_record"))) == 2 and len(list(out.glob("eval-*.array_record"))) == 2
  again = _run("experiments.prepare_data", f"--input={text_file}", f"--output={out}")
  assert again.returncode == 2 and "not empty" in again.stderr
  config = tiny_config(
      **{
          "data.source": "array_record", "data.path": str(out), "data.tokenizer": "sentencepiece",
          "data.tokenizer_path": sp_model})
  corpus = sources.load_corpus(config.data, 16)
  texts = [corpus.train_documents[i][0] for i in range(len(corpus.train_documents))]
  texts += [corpus.eval_documents[i][0] for i in range(len(corpus.eval_documents))]
  assert sorted(texts) != [] and sum(map(len, texts)) == len(TEXT.encode())
  learner = batches.learner_batches(corpus, 16, learner_index=0, num_learners=2, batch_size=4, split="iid", seed=0)
  assert learner.batch(3).shape == (4, 17) and learner.batch(3).max() < 400
  learner.close()


def _records(workdir):
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for record in records:
    record.pop("wall_time")
  return records


def test_subword_run_resumes_exactly_and_reports_bits_per_byte(tmp_path, sp_model):
  text_file = tmp_path / "corpus.txt"
  text_file.write_text(TEXT, encoding="utf-8")
  config = tiny_config(
      outer_steps=3, checkpoint_every=1, **{
          "data.source": "text_file", "data.path": str(text_file), "data.tokenizer": "sentencepiece",
          "data.tokenizer_path": sp_model, "data.chunk_bytes": 256})
  lockstep.run(experiment.build(config), str(tmp_path / "full"))
  lockstep.run(experiment.build(config), str(tmp_path / "cut"), stop_after=2)
  config.resume = True
  lockstep.run(experiment.build(config), str(tmp_path / "cut"))
  full = _records(tmp_path / "full")
  assert _records(tmp_path / "cut") == full
  evals = [r for r in full if r["kind"] == "eval"]
  assert len(evals) == 3 and all(r["eval_bits_per_byte"] > 0 for r in evals)
  ratio = evals[0]["eval_bits_per_byte"] / evals[0]["eval_loss"]
  assert 1 / math.log(2) / 6 < ratio < 1 / math.log(2)  # Subword tokens carry more than one byte each.


_GROUP_SCRIPT = """
import sys, jax, numpy as np
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
from jax.experimental import multihost_utils
from decoupled_diloco import mesh
from decoupled_diloco.data import pipeline, tokenizer
DOCS = [((f"document {i} " * (i % 9 + 1)).encode(), True) for i in range(120)]
p = jax.process_index()
mine = pipeline.PackedBatches(DOCS, tokenizer.ByteTokenizer(), 15, learner_index=0, num_learners=2, batch_size=8,
                              split="iid", seed=5, rows=range(4 * p, 4 * p + 4))
sharding = mesh.batch_sharding(mesh.group_mesh(jax.devices()))
for step in range(3):
  local = mine.batch(step)
  assembled = jax.make_array_from_process_local_data(sharding, local)
  gathered = multihost_utils.process_allgather(assembled, tiled=True)
  np.save(f"{sys.argv[3]}/process{p}_step{step}.npy", gathered)
  np.save(f"{sys.argv[3]}/local{p}_step{step}.npy", local)
mine.close()
"""


@pytest.mark.slow
def test_two_process_group_assembles_the_single_process_batch(tmp_path):
  import portpicker  # pylint: disable=g-import-not-at-top
  coordinator = f"127.0.0.1:{portpicker.pick_unused_port()}"
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  procs = [
      subprocess.Popen([sys.executable, "-c", _GROUP_SCRIPT, coordinator,
                        str(k), str(tmp_path)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
      for k in range(2)]
  outputs = [p.communicate(timeout=300)[0].decode()[-3000:] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outputs
  single = _packed(learner_index=0, num_learners=2, batch_size=8)
  for step in range(3):
    expected = single.batch(step)
    halves = [np.load(tmp_path / f"local{k}_step{step}.npy") for k in range(2)]
    np.testing.assert_array_equal(halves[0], expected[:4])  # Each process read only its half ...
    np.testing.assert_array_equal(halves[1], expected[4:])
    for k in range(2):  # ... and the global array both see is the single-process batch.
      np.testing.assert_array_equal(np.load(tmp_path / f"process{k}_step{step}.npy"), expected)
  single.close()


@pytest.mark.slow  # Imports TensorFlow and prepares a TFDS dataset.
def test_prepare_data_converts_a_tfrecord_tfds_dataset(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  from tests import tfds_fixture  # pylint: disable=g-import-not-at-top
  if not tfds_fixture.SHARED_TEXT.is_file():
    pytest.skip(f"shared tiny Shakespeare file not found at {tfds_fixture.SHARED_TEXT}")
  data_dir = tfds_fixture.build_offline_data_dir(tmp_path / "tfds")
  tfds.builder("tiny_shakespeare", data_dir=str(data_dir), file_format="tfrecord").download_and_prepare()
  prepared = [f.name for f in data_dir.rglob("tiny_shakespeare-*")]
  assert prepared and all(".tfrecord" in name for name in prepared), prepared  # As TFDS's C4 is: no ArrayRecord.
  out = tmp_path / "prepared"
  result = _run("experiments.prepare_data", "--tfds_name=tiny_shakespeare", f"--tfds_data_dir={data_dir}",
                f"--output={out}", "--num_shards=1", "--max_bytes=0")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "train: 1 records" in result.stdout and "eval: 1 records" in result.stdout
  corpus = sources.load_corpus(tiny_config(**{"data.source": "array_record", "data.path": str(out)}).data, 16)
  pieces = [corpus.train_documents[i] for i in range(len(corpus.train_documents))]  # One document, in pieces.
  assert pieces[0][0].startswith(b"First Citizen") and [p[1] for p in pieces].count(True) == 1 and len(pieces) > 200
  assert batches.eval_batches(corpus, 16, 4, 1)[0].shape == (4, 17)
  config = tiny_config(outer_steps=2, **{"data.source": "array_record", "data.path": str(out)})
  lockstep.run(experiment.build(config), str(tmp_path / "run"))  # A few steps trained from the converted shards.
  losses = [r["loss"] for r in _records(tmp_path / "run") if r["kind"] == "train"]
  assert len(losses) == 8 and all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_data_pipeline_benchmark_runs_end_to_end():
  """A 1 MB corpus (and its 10 MB twin), two batches, one timed step: every figure of the issue's JSON line."""
  result = _run("experiments.benchmarks.data_pipeline", "--small_mb=1", "--batches=2", "--steps=1",
                env=quick_compile_env())
  assert result.returncode == 0, result.stderr[-3000:]
  figures = json.loads(result.stdout.splitlines()[-1])
  assert set(figures) == {
      "byte_tokens_per_s", "sentencepiece_tokens_per_s", "consumed_tokens_per_s", "headroom", "tpu_host_headroom",
      "rss_growth_mb"}
  assert min(figures["byte_tokens_per_s"], figures["sentencepiece_tokens_per_s"], figures["consumed_tokens_per_s"]) > 0
  assert figures["headroom"] > 0 and figures["tpu_host_headroom"] > 0, figures

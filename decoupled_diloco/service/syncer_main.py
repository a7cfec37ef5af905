"""The syncer process (`experiments.train --role=syncer`): serve Θ until the token budget is spent.

It owns Θ on its host CPU, serves learners over gRPC, evaluates Θ on the held-out batches
as tokens accumulate (in a thread, so merges never wait for an eval), and writes
metrics.jsonl: 'push', 'outer', 'eval' and a final 'summary'. It checkpoints every
`service.checkpoint_every_merges` merges, on SIGTERM and at the end; restarted with
--config.resume=True in the same workdir it restores the checkpoint, replays its log and
carries on, and the learners (who retry) never notice more than a pause.
"""

import os
import queue
import signal
import threading
import time

from absl import logging
import jax

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import compression, experiment, fragments, metrics as metrics_lib, model as model_lib, outer
from decoupled_diloco import storage, workdir_lock
from decoupled_diloco.data import batches as batches_lib
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import limits, runconfig, security, wal
from decoupled_diloco.service import server as server_lib
from decoupled_diloco.syncer import Syncer

TICK_SECONDS = 0.2


class Recorder:
  """A MetricsWriter shared by gRPC handler threads and the eval thread.

  Records written before `attach` (the log's replay) wait in memory: which records the
  file keeps depends on the checkpoint the restart could use, known only after restoring.
  """

  def __init__(self, writer: metrics_lib.MetricsWriter | None = None):
    self.writer, self.lock, self._waiting = writer, threading.Lock(), []

  def attach(self, writer: metrics_lib.MetricsWriter) -> None:
    """Starts writing into `writer`, the waiting records first."""
    with self.lock:
      self.writer = writer
      for record in self._waiting:
        writer.write(record)
      self._waiting.clear()

  def write(self, record: dict) -> None:
    """Appends one record (thread-safe)."""
    with self.lock:
      if self.writer is None:
        self._waiting.append(record)
      else:
        self.writer.write(record)


class Evaluator:
  """Held-out loss of Θ snapshots, computed in one background thread in merge order."""

  def __init__(self, config, model, corpus, recorder: Recorder):
    self.batches = batches_lib.eval_batches(corpus, config.model.seq_len, config.eval_batch_size,
                                            config.eval_batches)
    self.bits_per_byte = batches_lib.bits_per_byte_factor(corpus.tokenizer, self.batches)
    self.loss = jax.jit(model.loss)
    self.recorder, self.optimal_loss = recorder, corpus.optimal_loss
    self.last: dict | None = None
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._work, name="eval", daemon=True)
    self._thread.start()

  def submit(self, params, clock: dict) -> None:
    """Queues an eval of `params` (a snapshot: merges replace Θ, they never mutate it)."""
    self._queue.put((params, clock))

  def _work(self) -> None:
    while (item := self._queue.get()) is not None:
      params, clock = item
      loss = float(sum(float(self.loss(params, b)) for b in self.batches) / len(self.batches))
      record = {"kind": "eval", **clock, "eval_loss": loss, "eval_bits_per_byte": loss * self.bits_per_byte}
      if self.optimal_loss is not None:
        record["optimal_loss"] = self.optimal_loss
      self.recorder.write(record)
      self.last = record
      logging.info("version %d | %d tokens | eval %.4f", clock["outer_step"], clock["tokens"], loss)

  def close(self) -> None:
    """Finishes queued evals."""
    self._queue.put(None)
    self._thread.join()


def build_core(config, params, workdir: str, recorder: Recorder, evaluator: Evaluator,
               wal_dir: str | None = None) -> core_lib.SyncerCore:
  """The syncer (same state machine as the simulator's) wrapped for the service; evals every
  eval_every × inner_steps × Σ batch tokens, as the simulator does."""
  num_learners = len(config.learners.devices)
  syncer = Syncer(outer.outer_optimizer(config.outer), params, range(num_learners), experiment.syncer_settings(config),
                  codec=compression.Codec.from_config(config.compression),
                  assignment=fragments.partition(params, config.streaming.num_fragments, config.streaming.strategy))
  tokens_per_eval = (config.eval_every * config.inner_steps * config.model.seq_len
                     * sum(config.learners.batch_size))
  schedule = {"next": tokens_per_eval}

  def on_merge(version, params, now):
    if core.tokens_done >= schedule["next"]:
      schedule["next"] = next_eval(core.tokens_done, tokens_per_eval)
      evaluator.submit(params, clock(core, version, now))

  core = core_lib.SyncerCore(syncer, num_learners, runconfig.budget_steps(config), workdir,
                             checkpoint_every_merges=config.service.checkpoint_every_merges,
                             lease_seconds=config.service.lease_seconds, metadata={"config": config.to_dict()},
                             emit=recorder.write, on_merge=on_merge,
                             limits=limits.PushLimits.from_config(config, runconfig.budget_steps(config)),
                             downlink_format=config.compression.downlink_format,
                             truncate_corrupt_log=config.service.truncate_corrupt_log, wal_dir=wal_dir,
                             min_learners_to_start=config.syncer.min_learners_to_start or num_learners,
                             start_timeout_seconds=config.syncer.start_timeout_seconds)
  return core


def next_eval(tokens_done: int, tokens_per_eval: int) -> int:
  """The first multiple of the eval interval above `tokens_done`: O(1) however far a push jumped."""
  return (tokens_done // tokens_per_eval + 1) * tokens_per_eval


def clock(core: core_lib.SyncerCore, version: int, now: float) -> dict:
  """Where the run is, for records: version, mean steps per learner, tokens, seconds since it began."""
  return {"outer_step": version, "inner_step": core.steps_done // core.num_learners, "tokens": core.tokens_done,
          "wall_time": now - core.start_time}


def run(config, workdir: str) -> dict:
  """Serves until the budget is spent and every learner heard so (or linger_seconds passed); returns the summary."""
  runconfig.validate(config)
  local = storage.local_dir(workdir, config.service.local_dir, "the syncer's write-ahead log and lock")
  token = security.load_token(config.service.token_file)
  credentials = security.server_credentials(config.service.tls_cert, config.service.tls_key)
  # Everything that can refuse the run comes before the first write: a refused start leaves no
  # half-made workdir behind that a retry would take for a run to resume.
  runconfig.check_ports_free(config.service.host, config.service.port, config.service.data_port)
  tokenizer_lib.resolve_model_vocab(config)
  model, params, _ = model_lib.build_model(config.model, config.seed)
  corpus = sources.load_corpus(config.data, config.model.seq_len, train=False)  # Eval text only.
  check_same_layout(config, os.path.join(workdir, "checkpoints"))
  lock = workdir_lock.DirectoryLock(local, "syncer.lock", "syncer")  # One syncer per workdir, before any write.
  try:
    checkpoints = storage.path(workdir) / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()) and not config.resume:
      raise ConfigError(f"workdir {workdir} already holds a syncer run: pass --config.resume=True to continue it "
                        "(launch_local does on restarts), or pick a new --workdir")
    return _serve(config, workdir, local, token, credentials, model, params, corpus)
  finally:
    lock.release()


def _serve(config, workdir: str, local: str, token: str, credentials, model, params, corpus) -> dict:
  """The syncer's life in a workdir it holds: restore, serve, finish."""
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  recorder = Recorder()
  evaluator = Evaluator(config, model, corpus, recorder)
  core = build_core(config, params, workdir, recorder, evaluator, wal_dir=os.path.join(local, "wal"))
  try:
    try:
      step = core.start(time.time())
    except (wal.CorruptLog, checkpoint_lib.CorruptCheckpoint) as error:
      raise ConfigError(str(error)) from error
    # Records after the checkpoint the restart resumed from were replayed from the log: drop them first.
    with metrics_lib.MetricsWriter(workdir, resume_from_step=-1 if step is None else step) as writer:
      recorder.attach(writer)
      core.syncer.warm_up()
      server = server_lib.SyncerServer(
          core, token, host=config.service.host, port=config.service.port, chunk_bytes=config.service.chunk_bytes,
          max_payload_bytes=runconfig.max_payload_bytes(params), credentials=credentials,
          workers=2 * core.num_learners + 4, data_port=config.service.data_port,
          data_tls=security.server_tls_context(config.service.tls_cert, config.service.tls_key),
          data_timeout_seconds=config.service.rpc_timeout_seconds)
      server.rejections = core.refused  # Checkpointed with the core: refusals survive restarts.
      port = server.start()
      runconfig.write_address(workdir, f"{config.service.host}:{port}")
      logging.info("syncer serving %d learners on %s:%d (%s), version %d", core.num_learners, config.service.host,
                   port, "TLS" if credentials else "plaintext", core.syncer.version)
      done_at = None
      try:
        while not stop.wait(TICK_SECONDS):
          now = time.time()
          core.tick(now)
          if core.done:
            done_at = done_at or now
            if core.all_told_done() or now - done_at > config.service.linger_seconds:
              break
      except core_lib.Stopped as error:  # Fail-stop: the log cannot take new state; serve nothing more.
        server.stop(grace=0)
        raise SystemExit(f"error: {error}") from error
      server.stop(grace=1.0)
      core.checkpoint(time.time())  # SIGTERM: keeps the log short; at the end: already saved.
      return _finish(core, evaluator, recorder, server, write_summary=core.done and not _has_summary(writer.path))
  finally:
    core.close()


# Config sections that fix the layout of the syncer's checkpointed state.
_LAYOUT = ("model", "streaming.num_fragments", "streaming.strategy", "outer.optimizer", "learners.devices")


def check_same_layout(config, checkpoints: str) -> None:
  """Refuses (ConfigError naming the field) to resume a run whose state layout the config changed.

  Why before restoring: orbax would fail deep inside with advice (partial restore) that is
  wrong here; the field that changed is what the operator needs to know.
  """
  if not storage.path(checkpoints).is_dir():
    return
  with checkpoint_lib.Checkpointer(checkpoints) as checkpointer:
    for step in reversed(checkpointer.all_steps()):
      try:
        saved = checkpointer.restore_metadata(step).get("config")
      except Exception:  # pylint: disable=broad-except  # A damaged one: the core's fallback reports it.
        continue
      if saved is not None:
        break
    else:
      return
  now = config.to_dict()
  for field in _LAYOUT:
    old, new = saved, now
    for key in field.split("."):
      old, new = old.get(key), new.get(key)
    for name, old_value, new_value in _differences(field, old, new):
      raise ConfigError(f"{name} is {new_value!r} but the run in {os.path.dirname(checkpoints)} was checkpointed "
                        f"with {old_value!r}: resume with the same {name}, or start a new --workdir")


def _differences(name: str, old, new):
  """(dotted name, old, new) of every leaf that differs between two config values (JSON round trip aside)."""
  if isinstance(old, dict) and isinstance(new, dict):
    for key in sorted(set(old) | set(new)):
      yield from _differences(f"{name}.{key}", old.get(key), new.get(key))
  elif (list(old) if isinstance(old, (list, tuple)) else old) != (list(new) if isinstance(new, (list, tuple)) else new):
    yield name, old, new


def _has_summary(path: str) -> bool:
  """Whether an earlier start of this syncer already wrote the run's summary record."""
  return any(r["kind"] == "summary" for r in metrics_lib.read_metrics(path))


def _finish(core: core_lib.SyncerCore, evaluator: Evaluator, recorder: Recorder,
            server: server_lib.SyncerServer, write_summary: bool) -> dict:
  """Final eval, and the run's summary record once it is done (nothing more on SIGTERM)."""
  if core.done and (evaluator.last is None or evaluator.last["outer_step"] != core.syncer.version):
    evaluator.submit(core.syncer.params, clock(core, core.syncer.version, time.time()))
  evaluator.close()
  last = evaluator.last or {}
  summary = {"eval_loss": last.get("eval_loss"), "optimal_loss": last.get("optimal_loss"),
             "outer_updates": core.syncer.version, "steps_done": core.steps_done, "done": core.done,
             **{f"{k}_pushes": v for k, v in core.counts.items()},
             "refused_calls": dict(server.rejections)}
  if write_summary:
    recorder.write({"kind": "summary", **clock(core, core.syncer.version, time.time()),
                    **{k: v for k, v in summary.items() if k != "optimal_loss"}})
  return summary

"""The syncer process (`experiments.train --role=syncer`): serve Θ until the token budget is spent.

It owns Θ on its host CPU, serves learners over gRPC, evaluates Θ on the held-out batches
as tokens accumulate (in a thread, so merges never wait for an eval), and writes
metrics.jsonl: 'push', 'outer', 'eval' and a final 'summary'. It checkpoints every
`service.checkpoint_every_merges` merges, on SIGTERM and at the end; restarted with
--config.resume=True in the same workdir it restores the checkpoint, replays its log and
carries on, and the learners (who retry) never notice more than a pause. A restart serves as
soon as the log is replayed: Θ is built only as shapes (the checkpoint replaces it), the
replay's compiled programs come from the previous start's XLA cache (`<local dir>/xla_cache`)
and the merge is warmed up in the background; a 'syncer_start' record gives the start-up's phases.
"""

import os
import signal
import threading
import time

from absl import logging
import jax
import numpy as np

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import experiment, metrics as metrics_lib, model as model_lib
from decoupled_diloco import sharded_init, storage, syncer as syncer_lib, workdir_lock
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import evaluator as evaluator_lib
from decoupled_diloco.run import monitor as monitor_lib
from decoupled_diloco.run import records, schedule
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import limits, resume, runconfig, security, shardrun, wal
from decoupled_diloco.service import link as link_lib
from decoupled_diloco.service import server as server_lib

TICK_SECONDS = 0.2


def build_evaluator(config, model, corpus, recorder: records.Recorder) -> evaluator_lib.Evaluator | None:
  """The background evaluator of Θ snapshots, on this host (jitted model loss), in merge order; None unless
  service.evaluate_on='syncer': then the syncer never builds or runs the model's loss (at 1B it must not)."""
  if config.service.evaluate_on != "syncer":
    return None
  evals, loss = evaluator_lib.EvalSet.from_corpus(config, corpus), jax.jit(model.loss)
  return evaluator_lib.Evaluator(lambda params: evals.mean_loss(loss, params), evals, recorder.write, max_waiting=1)


def build_core(config, params, workdir: str, recorder: records.Recorder, evaluator: evaluator_lib.Evaluator | None,
               local_dir: str | None = None, shard: int | None = None) -> core_lib.SyncerCore:
  """The syncer (built as the in-process runtimes build it; `shard`: that shard's only) wrapped for the
  service; evals every plan.tokens_per_eval tokens, as the in-process runtimes do."""
  plan = schedule.RunPlan.from_config(config)
  eval_due = schedule.Every(plan.tokens_per_eval)

  def on_merge(version, params, now):
    if evaluator is not None and eval_due.due(core.tokens_done):
      evaluator.submit(params, clock(core, version, now))

  core = core_lib.SyncerCore(experiment.build_syncer(config, params, shard), plan.num_learners, plan.budget_steps,
                             workdir, checkpoint_every_merges=config.service.checkpoint_every_merges,
                             lease_seconds=config.service.lease_seconds, metadata={"config": config.to_dict()},
                             emit=recorder.write, on_merge=on_merge, limits=limits.PushLimits.from_config(
                                 config, plan.budget_steps, shard), downlink_format=config.compression.downlink_format,
                             truncate_corrupt_log=config.service.truncate_corrupt_log, local_dir=local_dir,
                             min_learners_to_start=config.syncer.min_learners_to_start or plan.num_learners,
                             start_timeout_seconds=config.syncer.start_timeout_seconds,
                             merge_wait_seconds=merge_wait_seconds(config),
                             barrier_call_seconds=config.service.rpc_timeout_seconds / 2)
  return core


def merge_wait_seconds(config) -> float:
  """How long a pull waits for the merge that holds its learner's push: in synchronous DiLoCo (mode='diloco')
  half a call's deadline, after which the learner asks again (every learner starts each round from the merge of
  the last, as in lockstep); 0 in decoupled mode, where nobody waits but for a grace window."""
  return config.service.rpc_timeout_seconds / 2 if config.mode == "diloco" else 0.0


def clock(core: core_lib.SyncerCore, version: int, now: float) -> dict:
  """Where the run is, for records: version, mean steps per learner, tokens, seconds since it began."""
  return {
      "outer_step": version, "inner_step": core.steps_done // core.num_learners, "tokens": core.tokens_done,
      "time": now - core.start_time, "wall_time": now - core.start_time}


def run(config, workdir: str, shard: int | None = None) -> dict:
  """Serves until the budget is spent and every learner heard so (or linger_seconds passed); returns the summary.

  `config` is one experiment.validate accepted with runtime='service' (experiments.train checks it once).
  `shard`: which syncer shard this process is, with service.shards > 1 (service/shardrun.py).
  """
  run_workdir = workdir  # The run's; `workdir` becomes this shard's (the same with one syncer).
  config, workdir = shardrun.for_shard(config, workdir, shard)
  local = storage.local_dir(workdir, config.service.local_dir, "the syncer's write-ahead log and lock")
  token = security.load_token(config.service.token_file)
  credentials = security.server_credentials(config.service.tls_cert, config.service.tls_key)
  entered = time.time()  # Start-up's first phase ends: the process started, imported and read its config.
  syncer_lib.map_large_blocks()  # Before Θ is allocated.
  # Everything that can refuse the run comes before the first write: a refused start leaves no
  # half-made workdir behind that a retry would take for a run to resume.
  runconfig.check_ports_free(config.service.host, config.service.port, config.service.data_port)
  resume.check(config, run_workdir, workdir)  # A fresh run, or a resume of this one: nothing else.
  tokenizer_lib.resolve_model_vocab(config)
  model, params = initial_params(config, os.path.join(workdir, "checkpoints"))
  corpus = (
      sources.load_corpus(config.data, config.model.seq_len, train=False)  # Eval text only.
      if config.service.evaluate_on == "syncer" else None)
  lock = workdir_lock.DirectoryLock(local, "syncer.lock", "syncer")  # One syncer per workdir, before any write.
  try:
    return _serve(config, workdir, local, token, credentials, model, params, corpus, shard, entered)
  finally:
    lock.release()


def initial_params(config, checkpoints: str):
  """(model, Θ to build the syncer from): the seed's initial params, or on a restart zeros of their shapes.

  Why: a restart's Θ comes from its checkpoint (or start-up refuses), so initialising the
  model's params (an eager computation per leaf: 13 s at the demo's size on a loaded host)
  would only delay serving; jax.eval_shape gives the shapes for nothing.
  """
  model, shapes, _ = model_lib.abstract_params(config.model)
  if not config.resume or latest_checkpoint(checkpoints) is None:
    return model, sharded_init.host_params(config.model, config.seed)  # Drawn in host memory, never on a chip.
  return model, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


def latest_checkpoint(checkpoints: str) -> int | None:
  """The newest checkpoint's step in `checkpoints`, None if there is none (the core starts the run afresh)."""
  if not storage.path(checkpoints).is_dir():
    return None
  with checkpoint_lib.Checkpointer(checkpoints, reader=True) as checkpointer:  # Before the workdir's lock.
    return checkpointer.latest_step()


def _serve(config, workdir: str, local: str, token: str, credentials, model, params, corpus, shard: int | None,
           entered: float) -> dict:
  """The syncer's life in a workdir it holds: restore, serve, finish."""
  runconfig.cache_compiled_programs(os.path.join(local, "xla_cache"))
  stop = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stop.set())
  recorder = records.Recorder()
  evaluator = build_evaluator(config, model, corpus, recorder)
  core = build_core(config, params, workdir, recorder, evaluator, local_dir=local, shard=shard)
  run_state = shardrun.RunState(workdir, shard, config.service.shards)
  try:
    try:
      step = core.start(time.time())
      replayed_at = time.time()
    except (wal.CorruptLog, checkpoint_lib.CorruptCheckpoint) as error:
      raise ConfigError(str(error)) from error
    # Records after the checkpoint the restart resumed from were replayed from the log: drop them first.
    monitor = monitor_lib.Monitor.for_config(config, evaluator.evals.optimal_loss if evaluator else None)
    with metrics_lib.MetricsWriter(workdir, resume_from_step=-1 if step is None else step,
                                   observer=monitor.observe) as writer:
      recorder.attach(writer)
      # A fresh run warms up first, so that no learner's first exchange waits for XLA; a restart
      # answers calls first (learners are waiting) and compiles meanwhile.
      warm_up = None if step is None else threading.Thread(target=core.syncer.warm_up, name="warm-up", daemon=True)
      if warm_up is None:
        core.syncer.warm_up()
      server = server_lib.SyncerServer(
          core, token, host=config.service.host, port=config.service.port, chunk_bytes=config.service.chunk_bytes,
          max_payload_bytes=runconfig.max_payload_bytes(params), credentials=credentials,
          workers=runconfig.bulk_workers(core.num_learners), data_port=config.service.data_port,
          data_tls=security.server_tls_context(config.service.tls_cert, config.service.tls_key),
          data_timeout_seconds=config.service.rpc_timeout_seconds, keepalive_seconds=config.service.keepalive_seconds,
          keepalive_timeout_seconds=config.service.keepalive_timeout_seconds,
          max_concurrent_rpcs=config.service.max_concurrent_rpcs,
          links=tuple(link_lib.links(config.service,
                                     core.num_learners)), is_final=lambda: run_state.may_stop(core, time.time()))
      server.rejections = core.refused  # Checkpointed with the core: refusals survive restarts.
      port = server.start()
      recorder.write(start_record(core, step, entered, replayed_at))  # Before the address: launchers wait for it.
      runconfig.write_address(workdir, f"{config.service.host}:{port}")
      if warm_up is not None:
        warm_up.start()
      logging.info("syncer serving %d learners on %s:%d (%s), version %d", core.num_learners, config.service.host, port,
                   "TLS" if credentials else "plaintext", core.syncer.version)
      done_at = None
      try:
        while not stop.wait(TICK_SECONDS):
          now = time.time()
          core.tick(now)
          if monitor.diverged and not core.done:
            core.end(now)  # Learners hear 'done' at their next call; the summary says why.
          run_state.sync(core, now)
          if core.done:
            done_at = done_at or now
            evaluated = config.service.evaluate_on != "evaluator" or server.reader.has_final()
            if (run_state.may_stop(core, now) and evaluated) or now - done_at > config.service.linger_seconds:
              break
      except core_lib.Stopped as error:  # Fail-stop: the log cannot take new state; serve nothing more.
        server.stop(grace=0)
        raise SystemExit(f"error: {error}") from error
      server.stop(grace=1.0)
      if warm_up is not None:
        warm_up.join()
      core.checkpoint(time.time())  # SIGTERM: keeps the log short; at the end: already saved.
      return _finish(core, evaluator, recorder, server, write_summary=core.done and not _has_summary(writer.path),
                     monitor=monitor)
  finally:
    core.close()


def start_record(core: core_lib.SyncerCore, step: int | None, entered: float, replayed_at: float) -> dict:
  """The 'syncer_start' record: where this start began serving, and when (time.time()) each phase ended.

  `entered`: imports done (syncer_main.run called); `restored`: the checkpoint restored
  (None on a fresh start); `replayed`: the log replayed; `serving`: the server up. A restart's
  recovery time is these phases plus the process start before them. Nested fields only: start-up
  facts are no TensorBoard series (and a syncer that only started writes no events).
  """
  # At the restored step (not the version after replay): a later restart from that checkpoint keeps the record.
  return {
      "kind": "syncer_start", "outer_step": step or 0,
      "start": {"incarnation": core.syncer_incarnation, "restored_step": step, "version": core.syncer.version},
      "unix_times": {"entered": entered, "restored": core.restored_at, "replayed": replayed_at, "serving": time.time()}}


def _has_summary(path: str) -> bool:
  """Whether an earlier start of this syncer already wrote the run's summary record."""
  return any(r["kind"] == "summary" for r in metrics_lib.read_metrics(path))


def _finish(core: core_lib.SyncerCore, evaluator: evaluator_lib.Evaluator | None, recorder: records.Recorder,
            server: server_lib.SyncerServer, write_summary: bool, monitor: monitor_lib.Monitor) -> dict:
  """Final eval (when this host evaluates), and the run's summary record once it is done (nothing more on SIGTERM)."""
  if evaluator is not None:
    if core.done and (evaluator.last_queued or {}).get("outer_step") != core.syncer.version:
      evaluator.submit(core.syncer.params, clock(core, core.syncer.version, time.time()))
    evaluator.close()
  now = clock(core, core.syncer.version, time.time())
  counts = {("accepted" if k == "applied" else k): v for k, v in core.counts.items()}
  summary = records.summary(now, eval_loss=((evaluator and evaluator.last) or {}).get("eval_loss"),
                            optimal_loss=evaluator.evals.optimal_loss if evaluator else None,
                            outer_updates=core.syncer.version, steps_done=core.steps_done, done=core.done,
                            wall_seconds=now["wall_time"], refused_calls=dict(server.rejections),
                            diverged=bool(monitor.diverged), **records.push_counts(counts))
  if write_summary:
    recorder.write(summary)
  return summary

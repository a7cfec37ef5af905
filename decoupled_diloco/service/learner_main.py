"""A learner process (`experiments.train --role=learner --learner_id=i --syncer=HOST:PORT`).

It builds only its own group, on the devices of this process, and runs periods of H steps
(under DyLU ⌊v/max v · H⌋ with v this learner's speed, declared or measured from its own
periods against the fastest learner the syncer has seen; under a time budget the steps that
fit policy.round_seconds at the measured speed; learners.slowdown emulates a slower slice)
as the virtual clock does (runtime/sim.py):
fragment p (streaming.num_fragments = P, 1 unless streaming) is pushed after step t_p of the
period (fragments.sync_offsets: P = 1 pushes at the period's end), its exchange (the push,
then the pull of Θ_p if it moved) runs on a background thread while the steps go on, and
τ = streaming.overlap_steps steps after the push Θ_p lands: θ_p ← α·θ_p + (1 − α)·Θ_p
(α = streaming.alpha), waited for if it is not back (`blocked`; τ = 0 waits at once). The
next push of p counts its steps and tokens from that landing (learner.receive). A fragment
whose turn comes round while it is still in flight (a short period) lands first.

The run's budget counts every step once, in the first push after it (the push header's
budget_steps, core.budget_share); a period is cut short to the budget left, so its last step
pushes. At the budget's end a learner pushes what is left of the fragments not in flight,
lands the rest and pushes what is left of them, fragment 0 last each time, each waited for.

Restarted after a crash it joins again: Θ and its last acknowledged sequence number come
from the syncer, its AdamW state and step (hence its data position) from its own
checkpoint in <workdir>/learner_<i>/.

A group may span several JAX processes (a multi-host slice, `group.py`): all of them run
this loop in step; process 0 alone talks to the syncer and writes the metrics, and shares
what it heard with the others at the same points of the loop.
"""

import concurrent.futures
import dataclasses
import os
import threading
import time

from absl import logging
import grpc
import jax
import numpy as np

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import compression, experiment, fragments, hardware, inner, mesh, metrics as metrics_lib
from decoupled_diloco import model as model_lib
from decoupled_diloco import policy as policy_lib
from decoupled_diloco import storage, workdir_lock
from decoupled_diloco.data import batches as batches_lib
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.learner import Learner
from decoupled_diloco.runtime import records
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import group as group_lib
from decoupled_diloco.service import runconfig, security


def build_learner(config, index: int) -> tuple[Learner, list[float]]:
  """Learner group `index` alone, on this process's devices (its slice of the run), and every
  group's declared speed (steps per second of its hardware profile), DyLU's declared input."""
  count = config.learners.devices[index]
  devices = jax.devices()
  if len(devices) < count:
    raise ConfigError(f"learner {index} needs {count} devices but this process has {len(devices)}: "
                      "start it with jax_num_cpu_devices (experiments.train does) or on its own slice")
  tokenizer_lib.resolve_model_vocab(config)
  corpus = sources.load_corpus(config.data, config.model.seq_len)
  model, params, param_axes = model_lib.build_model(config.model, config.seed)
  batch_sizes = config.learners.batch_size
  flops = experiment.flops_per_step(config)
  profiles = hardware.profiles_from_config(config.learners, config.sim.reference_step_seconds)
  schedule_steps = experiment.expected_steps(config, profiles, flops)[index]
  layout = mesh.layouts_from_config(config.learners)[index]
  loop = inner.build_inner_loop(model, inner.inner_optimizer(config.inner, schedule_steps),
                                mesh.group_mesh(devices[:count], layout), jax.eval_shape(lambda p: p, params),
                                param_axes, config.inner.microbatches)
  # Each process of a multi-process group reads only its rows of the group's batch (see data/pipeline.py).
  rows_per_process = batch_sizes[index] // jax.process_count()
  rows = range(jax.process_index() * rows_per_process, (jax.process_index() + 1) * rows_per_process)
  shard = batches_lib.learner_batches(corpus, config.model.seq_len, batch_size=batch_sizes[index], learner_index=index,
                                      num_learners=len(batch_sizes), split=config.data.split, seed=config.seed,
                                      rows=rows, prefetch=config.data.prefetch)
  assignment = fragments.partition(params, config.streaming.num_fragments, config.streaming.strategy)
  learner = Learner(index, loop, shard, loop.init(params), assignment,
                    compression.Codec.from_config(config.compression), config.streaming.alpha)
  return learner, experiment.declared_speeds(profiles, flops)


class HostPseudoGradient:
  """What `Learner.push` needs of a syncer when the syncer is remote: Δ = Θ − θ on this host.

  Keeps the host copy of θ it fetched, so a round that gets no new Θ can anchor on it.
  """

  def __init__(self, link: group_lib.GroupLink):
    self.link, self.local = link, None

  def pseudo_gradient(self, anchor, local_params):
    """Δ in numpy, from θ fetched off the group's devices (all of its hosts) once."""
    self.local = self.link.host_copy(local_params)
    return jax.tree.map(np.subtract, anchor, self.local)


@dataclasses.dataclass
class Accounting:
  """Where a learner's wall-clock went, and what became of its pushes."""
  begin: float = dataclasses.field(default_factory=time.perf_counter)
  compute: float = 0.0
  blocked: float = 0.0   # Waiting for the syncer (an exchange not back τ steps after its push, or the final acks).
  final_ack: float = 0.0  # The part of `blocked` spent on the last push, which no round can hide.
  exchange: float = 0.0  # Background push + pull time: what a learner without overlap would have waited.
  statuses: dict = dataclasses.field(default_factory=dict)

  def summary(self) -> dict:
    """Seconds and fractions for the 'learner_summary' record."""
    wall = time.perf_counter() - self.begin
    return {"wall_seconds": wall, "busy_seconds": self.compute, "blocked_seconds": self.blocked,
            "final_ack_seconds": self.final_ack, "exchange_seconds": self.exchange,
            "blocked_fraction": self.blocked / wall if wall else 0.0, **{f"{k}_pushes": v for k, v in
                                                                         self.statuses.items()}}


class LearnerProcess:
  """The loop of one learner group: periods of steps, pushes at the fragments' offsets, landings τ steps later."""

  def __init__(self, config, workdir: str, index: int, target: str):
    runconfig.validate(config)
    if not 0 <= index < len(config.learners.devices):
      raise ConfigError(f"--learner_id={index} is not in [0, {len(config.learners.devices)}): the config has "
                        f"{len(config.learners.devices)} learner groups")
    self.config, self.index, self.service = config, index, config.service
    self.group = group_lib.GroupLink()
    self.client = client_lib.SyncerClient(
        target, security.load_token(self.service.token_file), index, chunk_bytes=self.service.chunk_bytes,
        timeout_seconds=self.service.rpc_timeout_seconds, retry_seconds=self.service.retry_seconds,
        credentials=security.channel_credentials(self.service.tls_ca), data_channel=self.service.data_port >= 0,
        data_tls=security.client_tls_context(self.service.tls_ca)) if self.group.leader else None
    self.learner, self.declared_speeds = build_learner(config, index)
    self.speed = policy_lib.SpeedTracker([0.0])  # This group's measured steps per second (0 = none yet).
    self.compiled = False  # Whether a round ran yet in this process (the first one compiles the step).
    self.slowdown = (tuple(config.learners.slowdown) or (0.0,) * len(config.learners.devices))[index]
    self.host = HostPseudoGradient(self.group)
    self.locals = {}  # fragment -> its host params when last pushed (the anchor if no new Θ_p comes back)
    self.overlap = config.streaming.overlap_steps  # τ: steps a fragment's exchange may take before it must land.
    self.inflight = {}  # fragment -> (exchange future, push, step by which it lands, its budget share)
    self.budget = [0, 0]  # Steps and tokens since this learner's last push: what the budget has yet to count.
    self.seq = self.pushes = 0
    self.status: dict = {}
    self.mark = time.perf_counter()  # Start of the wall-clock not yet accounted (_tick).
    self.compute_since_push = [0.0] * self.learner.num_fragments  # A push's compute_seconds, per fragment.
    self.directory = os.path.join(workdir, f"learner_{index}")
    # Before anything in it is touched: a frozen predecessor's save in progress stays its own.
    local = storage.local_dir(workdir, config.service.local_dir, "a learner's lock")
    lock_dir = os.path.join(local, f"learner_{index}")
    self.lock = workdir_lock.DirectoryLock(lock_dir, f"learner.{jax.process_index()}.lock", f"learner {index}")
    self.writer = metrics_lib.MetricsWriter(self.directory) if self.group.leader else None
    self.checkpointer = checkpoint_lib.Checkpointer(os.path.join(self.directory, "checkpoints"), max_to_keep=1)
    self.exchanges = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange")
    self.accounting = Accounting()
    self._stop = threading.Event()

  def _heartbeats(self) -> None:
    """Keeps the lease while a long round computes (single attempts: the exchange retries)."""
    while not self._stop.wait(self.service.lease_seconds / 3):
      try:
        self.client.heartbeat(retry=False)
      except grpc.RpcError as error:
        logging.info("heartbeat failed (%s); the next exchange will retry", error.code())

  def _ask(self, call):
    """The leader's answer from the syncer, on every process of the group."""
    return self.group.share(call() if self.group.leader else None)

  def _write(self, record: dict) -> None:
    """Metrics are the leader's to write (one file per group)."""
    if self.writer is not None:
      self.writer.write(record)

  def _exchange(self, seq: int, push, budget: tuple[int, int]):
    """Background: the push (retried until acked or refused), then the newest Θ if it moved.

    Followers in a multi-process group have nothing to send: the leader's result reaches
    them in `_land`.
    """
    if not self.group.leader:
      return None
    begin = time.perf_counter()
    try:
      return self._push_and_pull(seq, push, budget)
    finally:
      self.accounting.exchange += time.perf_counter() - begin

  def _push_and_pull(self, seq: int, push, budget: tuple[int, int]):
    """The leader's exchange: (seq, push reply, status, new Θ or None)."""
    try:
      reply = self.client.push(seq, push.delta, base_version=push.base_version, tokens=push.tokens,
                               local_steps=push.local_steps, compute_seconds=push.compute_seconds,
                               fragment=push.fragment, budget_steps=budget[0], budget_tokens=budget[1])
    except grpc.RpcError as error:  # Refused (malformed, NaN, ...): counted, the learner carries on.
      logging.warning("push %d refused: %s %s", seq, error.code(), error.details())
      reply = {"status": "refused", "done": False}
    if reply["done"]:  # The syncer is winding down: no Θ to fetch, nothing more to push.
      return seq, reply, {**reply, "payload_bytes": 0}, None
    status, theta = self.client.pull(push.base_version, push.fragment)
    return seq, reply, status, theta

  def _restore(self) -> None:
    """AdamW state, step and data position from this learner's own checkpoint, if it has one.

    A process without a saved data position (a follower of a multi-process group: the leader writes
    the metadata) replays its rows up to the step, which yields the same batches, only slower.
    """
    step = self.checkpointer.latest_step()
    if step is not None:
      state, meta = self.checkpointer.restore(step, {"state": checkpoint_lib.abstract_like(self.learner.state)})
      self.learner.state = state["state"]
      self.learner.steps = int(self.learner.state.step)
      data_state = meta.get("data", {}).get(str(jax.process_index()))
      if data_state:
        self.learner.batches.restore(data_state)
      logging.info("learner %d restored its inner state at step %d", self.index, self.learner.steps)

  def _record_ack(self, seq: int, reply: dict) -> None:
    self.accounting.statuses[reply["status"]] = self.accounting.statuses.get(reply["status"], 0) + 1
    self._write({"kind": "ack", "outer_step": reply.get("version", self.learner.base_versions[0]),
                       "learner": self.index, "seq": seq, "status": reply["status"],
                       "wall_time": time.perf_counter() - self.accounting.begin})

  def run(self) -> dict:
    """Trains until the syncer says the budget is spent; returns the learner's summary."""
    self.status, theta = self._ask(lambda: self.client.join())
    self._restore()
    self.start_step = self.learner.steps  # Where this process took over: 0, or its checkpoint's step.
    self.learner.pull(theta, self.status["versions"])
    self.seq = self.status["acked_seq"] + 1
    if self.group.leader:
      threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
    self.accounting = Accounting()  # The clock starts with training, not with compilation.
    self.mark = time.perf_counter()
    logging.info("learner %d joined at version %d (next seq %d, %d steps left)", self.index, self.status["version"],
                 self.seq, self.status["steps_left"])
    try:
      while not self.status["done"]:  # Also when the run ended before this (re)join.
        steps = min(self._planned_steps(), self.status["steps_left"] - self._uncounted())
        if steps <= 0 and not self.inflight and self.budget[0] and not any(self.learner.steps_since_push):
          steps = 1  # Steps that every landing dropped are in no push: one more step carries their count.
        if steps > 0:
          self._period(steps)
        else:  # This learner's share of the budget is spent: land and push the rest, wait for the end.
          self._push_the_rest()
          if not self.status["done"]:
            time.sleep(0.2)
            self.status, _ = self._ask(lambda: self.client.pull(self.status["versions"][0]))
    finally:
      self._stop.set()
      self.exchanges.shutdown(wait=True)
    summary = {"learner": self.index, "steps": self.learner.steps, "rounds": self.pushes,
               "retries": self.client.retries if self.client else 0, "processes": self.group.processes,
               **self.accounting.summary()}
    self._write({"kind": "learner_summary", "outer_step": self.status["version"], **summary})
    self.close()
    return summary

  def _period(self, steps: int) -> None:
    """One period of `steps` inner steps (H, fewer under DyLU or at the budget's end), as the virtual
    clock runs it: fragment p is pushed after step t_p (fragments.sync_offsets), and before each
    step every fragment pushed τ or more steps ago lands (waited for if its exchange is not back).

    Its time per step feeds this group's measured speed, except in the first period (compilation).
    """
    learner, compute = self.learner, self.accounting.compute
    for step_in_period in range(1, steps + 1):
      self._land_due()
      if self.status["done"]:
        return
      if self.slowdown and self.compiled:  # Slower devices; compiling (host work) is not slowed.
        learner.timed_step(self.slowdown)
      else:
        learner.step()
      self.budget[0] += 1
      self.budget[1] += learner.batches.tokens_per_batch
      for fragment in fragments.due(step_in_period, learner.num_fragments, steps):
        if fragment in self.inflight:  # Its turn came round within τ (a short period): it lands first.
          self._land(fragment)
        if learner.steps_since_push[fragment]:  # (With α = 0 that landing dropped the steps it was due for.)
          self._send(fragment)
    for record in records.train_records(learner, learner.base_versions[0], self.config.log_every,
                                        {"wall_time": time.perf_counter() - self.accounting.begin}):
      self._write(record)
    self._tick()
    if self.compiled:
      self.speed.observe(0, (self.accounting.compute - compute) / steps)
    else:  # Start-up and compilation end here: what a (re)started learner costs before it trains at speed.
      self._write({"kind": "first_round", "outer_step": learner.base_versions[0], "unix_time": time.time(),
                   "start_step": self.start_step})
    self.compiled = True

  def _land_due(self) -> None:
    """Lands every fragment pushed at least τ steps ago (τ = 0: at once), oldest push first."""
    for fragment in sorted(self.inflight, key=lambda p: self.inflight[p][2]):
      if self.inflight[fragment][2] <= self.learner.steps:
        self._land(fragment)

  def _tick(self) -> None:
    """Moves the wall-clock since the last mark into compute (this push's and the learner's)."""
    now = time.perf_counter()
    elapsed, self.mark = now - self.mark, now
    self.compute_since_push = [seconds + elapsed for seconds in self.compute_since_push]
    self.accounting.compute += elapsed

  def _send(self, fragment: int) -> None:
    """Δ_p against its anchor, compressed as configured, to the background exchange; the budget's
    count of the steps since the last push of any fragment rides along (core.budget_share)."""
    self._tick()
    push = self.learner.push(self.host, fragment)
    self.locals[fragment] = self.host.local
    push.compute_seconds, self.compute_since_push[fragment] = self.compute_since_push[fragment], 0.0
    budget, self.budget = tuple(self.budget), [0, 0]
    future = self.exchanges.submit(self._exchange, self.seq, push, budget)
    self.inflight[fragment] = (future, push, self.learner.steps + self.overlap, budget)
    self.seq, self.pushes = self.seq + 1, self.pushes + 1
    if self.service.learner_checkpoint_every and self.pushes % self.service.learner_checkpoint_every == 0:
      self.checkpointer.save(self.learner.steps, {"state": self.learner.state},
                             {"steps": self.learner.steps,
                              "data": {str(jax.process_index()): self.learner.batches.state()}})

  def _land(self, fragment: int, final: bool = False) -> None:
    """Waits for `fragment`'s exchange (counted as blocked; `final`: no step can hide it), then its new
    Θ_p lands (θ_p ← α·θ_p + (1 − α)·Θ_p, counts from here), or, when no merge moved Θ_p since its
    base, its params as pushed anchor it (the local progress goes on, counted from the push)."""
    self._tick()
    future, push, _, _ = self.inflight.pop(fragment)
    seq, reply, self.status, theta = self.group.share(future.result())
    waited = time.perf_counter() - self.mark
    self.mark = time.perf_counter()
    self.accounting.blocked += waited
    if final:
      self.accounting.final_ack += waited
    self._record_ack(seq, reply)
    if theta is None:
      self.learner.anchors[fragment] = self.locals[fragment]
    else:
      self.learner.receive(fragment, theta, self.status["versions"][fragment])
      self.compute_since_push[fragment] *= self.learner.alpha

  def _uncounted(self) -> int:
    """This learner's steps the syncer has not counted yet: those since its last push, and those
    of its pushes still in flight (core.budget_share)."""
    return self.budget[0] + sum(budget[0] for _, _, _, budget in self.inflight.values())

  def _push_the_rest(self) -> None:
    """At the budget's end, as the virtual clock's flush: each fragment with steps since its last push
    and none in flight is pushed, then every exchange in flight lands and the fragments that still
    have steps are pushed (fragment 0 last each time), all waited for, as no step is left to hide them.
    Pushes after the run's end carry no budget steps, so the syncer still merges them (core.push)."""
    order = [*range(1, self.learner.num_fragments), 0]
    for fragment in [p for p in order if p not in self.inflight and self.learner.steps_since_push[p]]:
      self._send(fragment)
    for fragment in sorted(self.inflight, key=lambda p: self.inflight[p][2]):
      self._land(fragment, final=True)
    for fragment in [p for p in order if self.learner.steps_since_push[p]]:
      self._send(fragment)
      self._land(fragment, final=True)

  def _planned_steps(self) -> int:
    """The next period's length, decided by the leader for the whole group (see the module doc)."""
    planned = policy_lib.measured_round_steps(self.config.policy, self.config.inner_steps, self.speed.speeds[0],
                                              self.status["max_speed"], self.declared_speeds[self.index],
                                              max(self.declared_speeds))
    return self.group.share(planned)

  def close(self) -> None:
    """Releases the channel, the metrics file, the checkpointer and the data pipeline's threads."""
    if self.group.leader:
      self.client.close()
      self.writer.close()
    self.checkpointer.close()
    self.learner.batches.close()
    self.lock.release()


def run(config, workdir: str, index: int, target: str) -> dict:
  """Runs learner `index` against the syncer at `target` until the run is done."""
  return LearnerProcess(config, workdir, index, target).run()

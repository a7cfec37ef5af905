"""A learner process (`experiments.train --role=learner --learner_id=i --syncer=HOST:PORT`).

It builds only its own group, on the devices of this process, and loops: a round of inner
steps, push the pseudo-gradient, carry on. A round is H steps, or under DyLU ⌊v/max v · H⌋
with v this learner's speed (declared, or measured from its own rounds against the fastest
learner the syncer has seen), or under a time budget the steps that fit
policy.round_seconds at the measured speed; learners.slowdown emulates a slower slice.
Communication overlaps compute by one round (τ = H): at a round's end the push of the
round, and the pull of the newest Θ after it, go to a background thread while the next
round already runs from the local params; at the end of that round the learner collects
the exchange (time spent waiting for it is `blocked`) and starts the following round from
α·θ + (1 − α)·Θ_new (α = streaming.alpha). Every round's progress is pushed exactly once:
the round that ran during the exchange is pushed as the change from the local params it
started at, with the base version they derive from.

Streaming (streaming.num_fragments = P > 1): a round is 1/P of the period and pushes one
fragment, 0, 1, ..., P − 1 in turn, so each fragment goes once per period with the steps
since its own last push; its exchange pulls Θ_p alone, which lands a round later. The
syncer counts the budget from fragment 0's pushes; at the budget's end a learner pushes
every fragment's remaining steps, fragment 0 last.

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
from decoupled_diloco.data import batches as batches_lib
from decoupled_diloco.data import sources
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
  corpus = sources.load_corpus(config.data, config.model.seq_len)
  model, params, param_axes = model_lib.build_model(config.model, config.seed)
  batch_sizes = config.learners.batch_size
  flops = experiment.flops_per_step(config)
  profiles = hardware.profiles_from_config(config.learners, config.sim.reference_step_seconds)
  schedule_steps = experiment.expected_steps(config, profiles, flops)[index]
  loop = inner.build_inner_loop(model, inner.inner_optimizer(config.inner, schedule_steps),
                                mesh.group_mesh(devices[:count]), jax.eval_shape(lambda p: p, params), param_axes,
                                config.learners.fsdp)
  shard = batches_lib.LearnerBatches(corpus.train, config.model.seq_len, batch_size=batch_sizes[index],
                                     learner_index=index, num_learners=len(batch_sizes), split=config.data.split,
                                     seed=config.seed)
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
  blocked: float = 0.0   # Waiting for the syncer (the exchange of the previous round, or the final ack).
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
  """The overlapped pull → H steps → push loop of one learner group."""

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
    self.compute_since_push = [0.0] * self.learner.num_fragments  # A push's compute_seconds, per fragment.
    self.directory = os.path.join(workdir, f"learner_{index}")
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

  def _exchange(self, seq: int, push):
    """Background: the push (retried until acked or refused), then the newest Θ if it moved.

    Followers in a multi-process group have nothing to send: the leader's result reaches
    them in `_collect`.
    """
    if not self.group.leader:
      return None
    begin = time.perf_counter()
    try:
      return self._push_and_pull(seq, push)
    finally:
      self.accounting.exchange += time.perf_counter() - begin

  def _push_and_pull(self, seq: int, push):
    """The leader's exchange: (seq, push reply, status, new Θ or None)."""
    try:
      reply = self.client.push(seq, push.delta, base_version=push.base_version, tokens=push.tokens,
                               local_steps=push.local_steps, compute_seconds=push.compute_seconds,
                               fragment=push.fragment)
    except grpc.RpcError as error:  # Refused (malformed, NaN, ...): counted, the learner carries on.
      logging.warning("push %d refused: %s %s", seq, error.code(), error.details())
      reply = {"status": "refused", "done": False}
    if reply["done"]:  # The syncer is winding down: no Θ to fetch, nothing more to push.
      return seq, reply, {**reply, "payload_bytes": 0}, None
    status, theta = self.client.pull(push.base_version, push.fragment)
    return seq, reply, status, theta

  def _restore(self) -> None:
    """AdamW state and step from this learner's own checkpoint, if it has one."""
    step = self.checkpointer.latest_step()
    if step is not None:
      state, _ = self.checkpointer.restore(step, {"state": checkpoint_lib.abstract_like(self.learner.state)})
      self.learner.state = state["state"]
      self.learner.steps = int(self.learner.state.step)
      logging.info("learner %d restored its inner state at step %d", self.index, self.learner.steps)

  def _record_ack(self, seq: int, reply: dict) -> None:
    self.accounting.statuses[reply["status"]] = self.accounting.statuses.get(reply["status"], 0) + 1
    self._write({"kind": "ack", "outer_step": reply.get("version", self.learner.base_versions[0]),
                       "learner": self.index, "seq": seq, "status": reply["status"],
                       "wall_time": time.perf_counter() - self.accounting.begin})

  def run(self) -> dict:
    """Trains until the syncer says the budget is spent; returns the learner's summary."""
    status, theta = self._ask(lambda: self.client.join())
    self._restore()
    self.learner.pull(theta, status["versions"])
    seq, inflight, rounds = status["acked_seq"] + 1, None, 0
    if self.group.leader:
      threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
    self.accounting = Accounting()  # The clock starts with training, not with compilation.
    logging.info("learner %d joined at version %d (next seq %d, %d steps left)", self.index, status["version"], seq,
                 status["steps_left"])
    fresh = None  # (fragment, Θ_p or None) from the last exchange, not applied yet.
    try:
      while not status["done"]:  # Also when the run ended before this (re)join.
        steps = min(self._planned_steps(status), status["steps_left"] - self._uncounted(inflight))
        if steps > 0:
          push = self._round(steps, rounds % self.learner.num_fragments)
        if inflight is not None:
          status, fresh = self._collect(inflight, final=steps <= 0)
          inflight = None
        elif steps <= 0:  # Nothing to do and nothing in flight: the budget's end is being recorded.
          seq, status = self._push_the_rest(seq, status)
          time.sleep(0.2)
          status, _ = self._ask(lambda: self.client.pull(status["versions"][0]))
        if status["done"]:
          break
        if steps <= 0:  # No round now; land what came back, so that every anchor is set if one follows.
          if fresh is not None:
            self._start_next(fresh, status, fresh[0])
            fresh = None
          continue
        self._start_next(fresh, status, push.fragment)
        fresh = None
        inflight = (self.exchanges.submit(self._exchange, seq, push), push)
        seq, rounds = seq + 1, rounds + 1
        if self.service.learner_checkpoint_every and rounds % self.service.learner_checkpoint_every == 0:
          self.checkpointer.save(self.learner.steps, {"state": self.learner.state}, {"steps": self.learner.steps})
    finally:
      self._stop.set()
      self.exchanges.shutdown(wait=True)
    summary = {"learner": self.index, "steps": self.learner.steps, "rounds": rounds,
               "retries": self.client.retries if self.client else 0, "processes": self.group.processes,
               **self.accounting.summary()}
    self._write({"kind": "learner_summary", "outer_step": status["version"], **summary})
    self.close()
    return summary

  def _collect(self, inflight: tuple[concurrent.futures.Future, object], final: bool) -> tuple[dict, tuple]:
    """Waits for the previous round's exchange (counted as blocked; `final`: no round ran meanwhile,
    the budget's last pushes); returns (status, (its fragment, new Θ_p or None))."""
    future, push = inflight
    begin = time.perf_counter()
    seq, reply, status, theta = self.group.share(future.result())
    waited = time.perf_counter() - begin
    self.accounting.blocked += waited
    if final:
      self.accounting.final_ack += waited
    self._record_ack(seq, reply)
    return status, (push.fragment, theta)

  def _uncounted(self, inflight) -> int:
    """This learner's steps the syncer has not counted yet: those since its last push of fragment 0
    (the one the budget counts, core.budget_share), and that push if it is still in flight."""
    in_flight = inflight is not None and inflight[1].fragment == 0
    return self.learner.steps_since_push[0] + (inflight[1].local_steps if in_flight else 0)

  def _push_the_rest(self, seq: int, status: dict) -> tuple[int, dict]:
    """At the budget's end, each fragment's steps since its last push, fragment 0 last (with P = 1
    every step was pushed already): waited for, as no round is left to hide them."""
    for fragment in [*range(1, self.learner.num_fragments), 0]:
      if self.learner.steps_since_push[fragment] and not status["done"]:
        push = self._push(fragment, time.perf_counter())
        status, _ = self._collect((self.exchanges.submit(self._exchange, seq, push), push), final=True)
        seq += 1
    return seq, status

  def _planned_steps(self, status: dict) -> int:
    """The next round's length, decided by the leader for the whole group (see the module doc): with
    P fragments, 1/P of the period (at least one step), so each fragment goes once per period."""
    planned = policy_lib.measured_round_steps(self.config.policy, self.config.inner_steps, self.speed.speeds[0],
                                              status["max_speed"], self.declared_speeds[self.index],
                                              max(self.declared_speeds))
    return self.group.share(max(1, planned // self.learner.num_fragments))

  def _round(self, steps: int, fragment: int):
    """A round of inner steps (fewer at the budget's end); returns the push of `fragment`'s pseudo-gradient.

    With P fragments a round is 1/P of the planned steps, and fragment p goes at the end of
    every P-th round. Its time per step feeds this group's measured speed, except in the
    first round (compilation).
    """
    learner, begin = self.learner, time.perf_counter()
    for _ in range(steps):
      if self.slowdown and self.compiled:  # Slower devices; compiling (host work) is not slowed.
        learner.timed_step(self.slowdown)
      else:
        learner.step()
    for record in records.train_records(learner, learner.base_versions[0], self.config.log_every,
                                        {"wall_time": time.perf_counter() - self.accounting.begin}):
      self._write(record)
    if self.compiled:
      self.speed.observe(0, (time.perf_counter() - begin) / steps)
    self.compiled = True
    return self._push(fragment, begin)

  def _push(self, fragment: int, begin: float):
    """Δ_p against its anchor, compressed as configured; compute since `begin` is added to every
    fragment's, and a push carries its fragment's since that fragment's last push."""
    push = self.learner.push(self.host, fragment)
    self.locals[fragment] = self.host.local
    elapsed = time.perf_counter() - begin
    self.compute_since_push = [seconds + elapsed for seconds in self.compute_since_push]
    push.compute_seconds, self.compute_since_push[fragment] = self.compute_since_push[fragment], 0.0
    self.accounting.compute += elapsed
    return push

  def _start_next(self, fresh: tuple | None, status: dict, pushed: int) -> None:
    """Anchors after an exchange: the collected fragment's new Θ_p lands (θ_p ← α·θ_p + (1 − α)·Θ_p),
    or its params as pushed anchor it if none came. With P = 1 the fragment just `pushed` goes
    again next round, before its exchange is collected: it anchors on its pushed params too."""
    if fresh is not None:
      fragment, theta = fresh
      if theta is None:
        self.learner.anchors[fragment] = self.locals[fragment]
      else:
        # Counting from the push, not the receipt: the budget counts each step once in fragment 0's
        # pushes (core.budget_share), and this loop's one-round overlap is not τ (issue 14, item 5).
        self.learner.receive(fragment, theta, status["versions"][fragment], recount=False)
    following = (pushed + 1) % self.learner.num_fragments
    if self.learner.anchors[following] is None:
      self.learner.anchors[following] = self.locals[following]

  def close(self) -> None:
    """Releases the channel, the metrics file and the checkpointer."""
    if self.group.leader:
      self.client.close()
      self.writer.close()
    self.checkpointer.close()


def run(config, workdir: str, index: int, target: str) -> dict:
  """Runs learner `index` against the syncer at `target` until the run is done."""
  return LearnerProcess(config, workdir, index, target).run()

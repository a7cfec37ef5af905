"""A learner process (`experiments.train --role=learner --learner_id=i --syncer=HOST:PORT`).

It builds only its own group and runs periods of H steps (DyLU-sized) as the virtual clock
does: fragment p is pushed after step t_p of the period, its exchange runs on a background
thread while the steps go on, and τ steps later Θ_p lands (waited for if it is not back).
Restarted after a crash it joins again from the syncer's Θ and its own checkpoint; a
multi-process group runs this loop in step with process 0 alone talking to the syncer.
Budget counting, the end of the run and restarts are detailed in docs/runtimes.md.
"""
import concurrent.futures
import os
import threading
import time
import zlib

from absl import logging
import grpc
import jax

from decoupled_diloco import checkpoint as checkpoint_lib
from decoupled_diloco import fragments, metrics as metrics_lib, shards
from decoupled_diloco import policy as policy_lib
from decoupled_diloco import storage, workdir_lock
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import records, schedule
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import fingerprint
from decoupled_diloco.service import group as group_lib
from decoupled_diloco.service import learner_build
from decoupled_diloco.service import link as link_lib
from decoupled_diloco.service import runconfig, shardclient


class LearnerProcess:
  """The loop of one learner group: periods of steps, pushes at the fragments' offsets, landings τ steps later."""

  def __init__(self, config, workdir: str, index: int, target: str):
    if not 0 <= index < len(config.learners.devices):
      raise ConfigError(f"--learner_id={index} is not in [0, {len(config.learners.devices)}): the config has "
                        f"{len(config.learners.devices)} learner groups")
    self.config, self.index, self.service = config, index, config.service
    local = storage.local_dir(workdir, config.service.local_dir, "a learner's lock")
    lock_dir = os.path.join(local, f"learner_{index}")
    runconfig.cache_compiled_programs(os.path.join(lock_dir, "xla_cache"))  # Before any compile: a restart loads.
    self.group = group_lib.GroupLink()
    self.plan = schedule.RunPlan.from_config(config)
    self.learner = learner_build.build_learner(config, self.plan, index, self.group)
    # Fragments whose pushes carry the budget's count: shard 0's (all of them with one syncer).
    shapes = jax.eval_shape(self.learner.loop.from_step, self.learner.state.params)  # block_i's, as pushes see them.
    self.shard_map = shards.ShardMap.of(shapes, self.learner.assignment, self.service.shards)
    self.client = (shardclient.connect(target, self.service, index, self.shard_map, self.learner.assignment,
                                       link_lib.links(self.service, len(config.learners.devices))[index])
                   if self.group.leader else None)
    self.speed = policy_lib.SpeedTracker([0.0])  # This group's measured steps per second (0 = none yet).
    self.compiled = False  # Whether a round ran yet in this process (the first one compiles the step).
    self.slowdown = self.plan.slowdown[index]
    self.overlap = config.streaming.overlap_steps  # τ: steps a fragment's exchange may take before it must land.
    self.inflight = {}  # fragment -> (exchange future, push, step by which it lands, its budget share)
    self.budget = [0, 0]  # Steps and tokens since this learner's last push: what the budget has yet to count.
    self.seq = self.pushes = 0
    self.refused_in_a_row = 0  # The syncer's refusals of this process's last pushes (service.max_refusals_in_a_row).
    self.status: dict = {}
    self.mark = time.perf_counter()  # Start of the wall-clock not yet accounted (_tick).
    self.compute_since_push = [0.0] * self.learner.num_fragments  # A push's compute_seconds, per fragment.
    self.directory = os.path.join(workdir, f"learner_{index}")
    # Before anything in it is touched: a frozen predecessor's save in progress stays its own.
    self.lock = workdir_lock.DirectoryLock(lock_dir, f"learner.{jax.process_index()}.lock", f"learner {index}")
    self.writer = metrics_lib.MetricsWriter(self.directory) if self.group.leader else None
    self.checkpointer = checkpoint_lib.Checkpointer(os.path.join(self.directory, "checkpoints"), max_to_keep=1)
    self.exchanges = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange")
    self.account = learner_build.ProcessAccount()
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
    """Background: the push (retried until acked or refused), then the newest Θ if it moved: (seq, push reply,
    status, new Θ or None). Followers in a multi-process group have nothing to send: the leader's result
    reaches them in `_land`."""
    if not self.group.leader:
      return None
    begin = time.perf_counter()
    try:
      try:
        reply = self.client.push(seq, push.delta, base_version=push.base_version, tokens=push.tokens,
                                 local_steps=push.local_steps, compute_seconds=push.compute_seconds,
                                 fragment=push.fragment, budget_steps=budget[0], budget_tokens=budget[1])
      except grpc.RpcError as error:  # Refused (malformed, NaN, ...): counted, the learner carries on (_land).
        logging.warning("push %d refused: %s %s", seq, error.code(), error.details())
        fenced = error.code() == grpc.StatusCode.PERMISSION_DENIED  # A replaced process, or another's credential.
        reply = {"status": "fenced" if fenced else "refused", "done": False, "details": error.details()}
      if reply["done"]:  # The syncer is winding down: no Θ to fetch, nothing more to push.
        return seq, reply, {**reply, "payload_bytes": 0}, None
      status, theta = self.client.pull(push.base_version, push.fragment)
      # Synchronous DiLoCo: the syncer holds each pull until the merge that has this push (up to half a call's
      # deadline): ask again until Θ moved, so every round starts from the last round's merge.
      while self.config.mode == "diloco" and theta is None and not status["done"] and reply["status"] == "applied":
        status, theta = self.client.pull(push.base_version, push.fragment)
      return seq, reply, status, theta
    finally:
      self.account.exchange += time.perf_counter() - begin

  def _join(self) -> tuple[dict, object]:
    """(status, Θ) from the syncer's Join, on every process of the group; ConfigError with the syncer's one line
    when this config differs from the syncer's in what both must agree on (service/fingerprint.py): the process
    exits 2 with it, before it trains (experiments.train)."""

    def call():
      try:
        return self.client.join(fingerprint.of(self.config))
      except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
          raise
        return error.details()  # Shared as it is: the group's other processes stop with the same line.

    joined = self._ask(call)
    if isinstance(joined, str):
      self.close()  # Its data pipeline's threads would keep the process alive.
      raise ConfigError(joined)
    return joined

  def _restore(self) -> None:
    """Optimizer state, step, data position and error-feedback residuals from this learner's own checkpoint, if
    it has one.

    A process without a saved data position (a follower of a multi-process group: the leader writes
    the metadata) replays its rows up to the step, which yields the same batches, only slower.
    """
    step = self.checkpointer.latest_step()
    if step is not None:
      state, meta = self.checkpointer.restore(step, checkpoint_lib.abstract_like(self._checkpoint_trees()))
      self.learner.restore(state["state"], meta.get("data", {}).get(str(jax.process_index())))
      self.learner.residuals = state.get("residuals", self.learner.residuals)
      logging.info("learner %d restored its inner state at step %d", self.index, self.learner.steps)

  def _checkpoint_trees(self) -> dict:
    """What this learner's checkpoint holds: its inner state (block_i's) and, with error feedback, its residuals."""
    trees = {"state": self.learner.loop.from_step(self.learner.state)}
    if self.learner.codec.error_feedback:
      trees["residuals"] = self.learner.feedback_state()
    return trees

  def run(self) -> dict:
    """Trains until the syncer says the budget is spent; returns the learner's summary."""
    self.status, theta = self._join()
    self._restore()
    self.start_step = self.learner.steps  # Where this process took over: 0, or its checkpoint's step.
    self.learner.start_from(theta, self.status["versions"])
    began = time.perf_counter()  # Part of start-up: else the first push and landing compile in the first round.
    self.learner.warm_up()
    logging.info("learner %d warmed up its push and landing in %.2fs", self.index, time.perf_counter() - began)
    self.seq = self.status["acked_seq"] + 1
    if self.group.leader:
      threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
    self.account = learner_build.ProcessAccount()  # The clock starts with training, not with compilation.
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
            self.status = self._ask(lambda: self.client.pull(self.status["versions"][0])[0])
    finally:
      self._stop.set()
      if self.client is not None and self.status.get("done"):
        self.client.abandon()  # From here each call makes one attempt: the syncer may be gone already.
      self.exchanges.shutdown(wait=True)  # Final pushes still in flight get their attempt.
      if self.client is not None and self.status.get("done"):
        self._goodbye()
    summary = self._summary()
    self._write(summary)
    self.close()
    return summary

  def _goodbye(self) -> None:
    """Tells the syncer this learner heard the end and has nothing more to push, so it may stop.

    Why a call of its own: a push's reply saying 'done' can reach the learner while its final
    pushes of other fragments are still on their way; the syncer counts only a pull as heard.
    """
    try:
      self.client.pull(self.status["versions"][0])
    except (grpc.RpcError, client_lib.SyncerUnreachable) as error:  # Gone already (it lingered long enough).
      logging.info("the syncer did not hear this learner's goodbye: %s", error)

  def _summary(self) -> dict:
    """The learner_summary record: wall-clock split into busy and blocked, and the syncer's acks."""
    account, wall = self.account, time.perf_counter() - self.account.begin
    clock = {"outer_step": self.status["version"], "inner_step": self.learner.steps, "time": wall, "wall_time": wall}
    # Null what a learner process does not measure: the syncer's side of its pushes, and stalls by count.
    return records.learner_summary(
        clock, account, learner=self.index, steps=self.learner.steps,
        tokens=self.learner.steps * self.learner.batches.tokens_per_batch, wall_seconds=wall,
        compute_utilization=account.busy / wall if wall else 0.0,
        blocked_fraction=account.blocked / wall if wall else 0.0, final_ack_seconds=account.final_ack,
        exchange_seconds=account.exchange, rounds=self.pushes, retries=self.client.retries if self.client else 0,
        syncer_restarts=self.client.syncer_restarts if self.client else 0, processes=self.group.processes,
        group_peak_bytes=self.group.peak_bytes, group_host_bytes=self.group.host_peaks(),
        ack_statuses=dict(account.statuses), pushes=sum(account.statuses.values()), dropped=account.statuses["dropped"],
        rejected=account.statuses["refused"], idle_seconds=None, stalls=None, bytes_sent=None, bytes_received=None,
        staleness_histogram=None)

  def _period(self, steps: int) -> None:
    """One period of `steps` inner steps (H, fewer under DyLU or at the budget's end), as the virtual
    clock runs it: fragment p is pushed after step t_p (fragments.sync_offsets), and before each
    step every fragment pushed τ or more steps ago lands (waited for if its exchange is not back).

    Its pushes' time per step feed this group's measured speed, except in the first period (compilation).
    """
    learner = self.learner
    first_step, digests, compiled_at = learner.steps, [], None
    for step_in_period in range(1, steps + 1):
      self._land_due()
      if self.status["done"]:
        return
      if self.slowdown and self.compiled:  # Slower devices; compiling (host work) is not slowed.
        learner.timed_step(self.slowdown)
      elif not self.compiled and compiled_at is None:  # Waited for: XLA on CPU finishes a program loaded from
        learner.timed_step()  # its cache in the first run (0.4-1.3 s on 2 loaded cores), part of start-up.
      else:
        learner.step()
      compiled_at = compiled_at or time.time()  # The first step compiled (or loaded) and ran.
      digests.append(zlib.crc32(learner.batches.batch(learner.steps - 1)))  # The batch just trained on.
      self.budget[0] += 1
      self.budget[1] += learner.batches.tokens_per_batch
      for fragment in fragments.due(step_in_period, learner.num_fragments, steps):
        if fragment in self.inflight:  # Its turn came round within τ (a short period): it lands first.
          self._land(fragment)
        if learner.steps_since_push[fragment]:  # (With α = 0 that landing dropped the steps it was due for.)
          self._send(fragment)
    for record in records.train_records(learner, learner.base_versions[0], self.config.log_every,
                                        {"wall_time": time.perf_counter() - self.account.begin}):
      self._write(record)
    # Which data each step trained on (crc32 of this process's rows): a restarted learner's stream can be checked.
    self._write({
        "kind": "batches", "outer_step": learner.base_versions[0], "learner": self.index, "first_step": first_step,
        "crc32": digests})
    self._tick()
    if not self.compiled:  # Start-up and compilation end here: what a (re)started learner costs before training.
      self._write({
          "kind": "first_round", "outer_step": learner.base_versions[0], "unix_time": time.time(),
          "compiled_unix_time": compiled_at, "start_step": self.start_step})
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
    self.account.busy += elapsed

  def _send(self, fragment: int) -> None:
    """Δ_p against its anchor, compressed as configured, to the background exchange; the budget's
    count of the steps since the last push of any fragment rides along (admission.budget_share), on pushes
    to syncer shard 0 only when the syncer is sharded (service/shardrun.py)."""
    push = self.learner.push(fragment)  # Waits for the steps JAX dispatched asynchronously, so the
    self._tick()  # push's compute_seconds (the syncer's measure of this learner's speed) holds their time.
    push.compute_seconds, self.compute_since_push[fragment] = self.compute_since_push[fragment], 0.0
    if self.compiled and push.local_steps and push.compute_seconds:  # As the syncer measures the others (DyLU
      self.speed.observe(0, push.compute_seconds / push.local_steps)  # compares like with like), compilation aside.
    budget = (0, 0)
    if self.shard_map.shard_of[fragment] == 0:  # Shard 0 keeps the budget (service/shardrun.py).
      budget, self.budget = tuple(self.budget), [0, 0]
    future = self.exchanges.submit(self._exchange, self.seq, push, budget)
    self.inflight[fragment] = (future, push, self.learner.steps + self.overlap, budget)
    self.seq, self.pushes = self.seq + 1, self.pushes + 1
    if self.service.learner_checkpoint_every and self.pushes % self.service.learner_checkpoint_every == 0:
      self._checkpoint()

  def _checkpoint(self) -> None:
    """Saves the inner state; a failed save (a full disk) costs one line and is retried at the next checkpoint.

    Why not stop: the learner's state is also the syncer's Θ plus its own recent steps, so training on loses at
    most what a restart from the previous checkpoint would; a crash here would crash-loop under a supervisor.
    """
    try:
      self.checkpointer.save(
          self.learner.steps, self._checkpoint_trees(),
          {"steps": self.learner.steps, "data": {str(jax.process_index()): self.learner.batches.state()}})
    except (OSError, ValueError) as error:  # orbax reports tensorstore's I/O errors as ValueError.
      logging.error("learner %d checkpoint at step %d failed (%s): training on, retrying at the next checkpoint",
                    self.index, self.learner.steps, checkpoint_lib.first_line(error))

  def _land(self, fragment: int, final: bool = False) -> None:
    """Waits for `fragment`'s exchange (counted as blocked; `final`: no step can hide it), then its new
    Θ_p lands (θ_p ← α·θ_p + (1 − α)·Θ_p, counts from here), or, when no merge moved Θ_p since its
    base, its params as pushed anchor it (the local progress goes on, counted from the push)."""
    self._tick()
    future, push, _, _ = self.inflight.pop(fragment)
    seq, reply, self.status, theta = future.result() if self.group.leader else (None,) * 4
    seq, reply, self.status, moved = self.group.share((seq, reply, self.status, theta is not None))
    waited = time.perf_counter() - self.mark
    self.mark = time.perf_counter()
    self.account.blocked += waited
    if final:
      self.account.final_ack += waited
    self.account.statuses[reply["status"]] += 1
    self._write({
        "kind": "ack", "outer_step": reply.get("version", self.learner.base_versions[0]), "learner": self.index,
        "seq": seq, "status": reply["status"], "wall_time": time.perf_counter() - self.account.begin,
        **({} if push.delta_norm is None else {"pseudo_gradient_norm": float(push.delta_norm)})})
    self.refused_in_a_row = client_lib.refusals_in_a_row(self.index, reply, self.refused_in_a_row,
                                                         self.service.max_refusals_in_a_row)
    if not moved:
      self.learner.anchor_on_pushed(fragment)
      return
    if self.group.processes == 1:
      self.learner.land(fragment, theta, self.status["versions"][fragment])
    else:  # Θ_p placed on the group's devices leaf by leaf; the leader's host copy anchors the next push.
      like = fragments.select(self.learner.params, self.learner.assignment, fragment)
      self.learner.land(fragment, self.group.share_tree(theta, like), self.status["versions"][fragment], anchor=theta)
    self.compute_since_push[fragment] *= self.learner.alpha  # As the learner's counts: from the landing.

  def _uncounted(self) -> int:
    """This learner's steps the syncer has not counted yet: those since its last push, and those
    of its pushes still in flight (admission.budget_share)."""
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
      if self.status["done"]:  # A landing heard the end: the syncer may be gone, and a push would retry.
        return
      self._send(fragment)
      self._land(fragment, final=True)

  def _planned_steps(self) -> int:
    """The next period's length, decided by the leader for the whole group (see the module doc)."""
    planned = policy_lib.measured_round_steps(self.config.policy, self.config.inner_steps, self.speed.speeds[0],
                                              self.status["max_speed"], self.plan.declared_speeds[self.index],
                                              max(self.plan.declared_speeds))
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
  """Runs learner `index` against the syncer at `target` until the run is done.

  `config` is one experiment.validate accepted with runtime='service' (experiments.train checks it once).
  """
  process = LearnerProcess(config, workdir, index, target)
  try:
    return process.run()
  except client_lib.LearnerStopped:
    process.close()  # Its data pipeline's threads would keep the process alive.
    raise

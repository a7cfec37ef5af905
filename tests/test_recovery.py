"""Recovery from a lost syncer local dir (service/recovery.py, durable.py): the workdir's newest checkpoint is
resumed from with a new log, the loss is said in one line, the syncer incarnation only grows, and a running learner
(its client as it was, its seqs and its incarnation ahead of the checkpoint) carries on against the restarted
syncer."""

import logging
import os
import time

from decoupled_diloco import outer
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import server as server_lib
from decoupled_diloco.syncer import Settings, Syncer
from experiments.launch_local import free_port
from tests import service_config
from tests.test_datachannel import MAX_PAYLOAD
from tests.test_limits import HONEST, _learner
from tests.test_service_units import TOKEN, _delta, params  # pylint: disable=unused-import


def _core(params, workdir, local_dir):
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=1))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(workdir), checkpoint_every_merges=2,
                             lease_seconds=30.0, metadata={}, local_dir=str(local_dir))
  core.start(time.time())
  return core


def _serve(core, port):
  server = server_lib.SyncerServer(core, TOKEN, host="127.0.0.1", port=port, chunk_bytes=1 << 16,
                                   max_payload_bytes=MAX_PAYLOAD)
  server.start()
  return server


def test_a_syncer_with_an_empty_local_dir_resumes_from_the_workdirs_checkpoint_and_learners_carry_on(
    params, tmp_path, caplog):
  """Before: no checkpoint was usable without its log segment ("restore from a backup"), and the incarnation, kept
  only in the lost dir, went back to 1: every running learner took the restarted syncer for a stale one and exited."""
  workdir, port = tmp_path / "workdir", free_port()
  first = _core(params, workdir, tmp_path / "vm1")
  server = _serve(first, port)
  learner = _learner(f"127.0.0.1:{port}", 0)
  learner.join()
  for seq in range(2):  # Two merges: checkpoint 2 at the next tick.
    assert learner.push(seq, _delta(params), base_version=seq, **HONEST)["status"] == "applied"
  first.tick(time.time())
  assert first.store.checkpointer.latest_step() == 2
  learner.join()  # A restarted learner process after that checkpoint: incarnation 2, in the log only.
  for seq in range(2, 4):  # Acknowledged after the checkpoint: these are what a lost local dir loses.
    assert learner.push(seq, _delta(params), base_version=seq, **HONEST)["status"] == "applied"
  server.stop()
  first.close()  # The VM and its disk are gone: a new VM, an empty local dir.
  with caplog.at_level(logging.WARNING):
    second = _core(params, workdir, tmp_path / "vm2")
  lost = [r.getMessage() for r in caplog.records if "holds no log" in r.getMessage()]
  assert len(lost) == 1 and "pushes acknowledged after that checkpoint" in lost[0] and "checkpoint 2" in lost[0]
  assert second.syncer.version == 2 and second.syncer_incarnation == first.syncer_incarnation + 1
  server = _serve(second, port)
  status, theta = learner.pull(4)  # The learner's next exchange lands the restored Θ (version 2)...
  assert status["version"] == 2 and theta is not None and learner.syncer_restarts == 1
  reply = learner.push(4, _delta(params), base_version=2, **HONEST)  # ...its seq and incarnation run on.
  assert reply["status"] == "applied" and reply["incarnation"] == 2
  assert second.acked[0] == 4 and second.syncer.version == 3
  server.stop()
  second.close()
  third = _core(params, workdir, tmp_path / "vm3")  # Lost again, before any checkpoint of the second start.
  assert third.syncer_incarnation == second.syncer_incarnation + 1 and os.listdir(tmp_path / "vm3" / "wal")
  third.close()

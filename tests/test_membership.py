"""The start barrier as a learner meets it (service/membership.py): told so, and waiting as long as the barrier does."""

import logging
import threading
import time

from decoupled_diloco import outer
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import membership, security
from decoupled_diloco.syncer import Settings, Syncer
from tests import service_config
from tests.test_datachannel import _serving
from tests.test_service_units import TOKEN, params  # pylint: disable=unused-import


def test_a_learner_started_long_before_its_peers_is_told_it_waits_at_the_barrier_and_joins(params, tmp_path, caplog):
  """Scaled down: joins wait at the barrier up to 60 s (600 s by default), a learner's calls time out after 1 s and
  its retries after 2 s (rpc_timeout_seconds 20, retry_seconds 300); its peer joins 5 s later (400 s). Before, the
  learner's join timed out, was retried until its retry budget ran out and the learner gave up ("syncer
  unreachable ... CANCELLED") while the barrier still waited."""
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=2))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(tmp_path), checkpoint_every_merges=10,
                             lease_seconds=30.0, metadata={}, min_learners_to_start=2, start_timeout_seconds=60.0,
                             barrier_call_seconds=0.5)
  core.start(time.time())
  with _serving(core) as (server, address):
    early, late = (client_lib.SyncerClient(address, security.learner_credential(TOKEN, m), m, chunk_bytes=1 << 16,
                                           timeout_seconds=1.0, retry_seconds=2.0) for m in (0, 1))
    joined = {}
    with caplog.at_level(logging.WARNING):
      thread = threading.Thread(target=lambda: joined.setdefault(0, early.join()))
      thread.start()
      time.sleep(5.0)
      assert not joined and thread.is_alive() and not core.barrier.started
      status, _ = late.join()
      thread.join(timeout=10)
    assert 0 in joined and joined[0][0]["incarnation"] == 1 and status["incarnation"] == 1
    told = [r.getMessage() for r in caplog.records if membership.AT_BARRIER in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("learner 0 is waiting at the start barrier: 1 of the 2"), told
    assert not server.rejections  # Asked to wait, not refused.
  core.close()

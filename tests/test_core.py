"""SyncerCore's bookkeeping of refused pushes (service/core.py): a refused learner leaves the quorum until a push of it
is applied, refusals never lock out its later valid pushes, and a replaced process is fenced in a status of its own.
Pushes go through the real server around an in-process core, as a learner's client sends them."""

import time

import grpc
import jax
import numpy as np
import pytest

from decoupled_diloco import outer
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import limits
from decoupled_diloco.syncer import Settings, Syncer
from tests import service_config
from tests.test_datachannel import _serving
from tests.test_limits import HONEST, TOKENS_PER_STEP, _learner
from tests.test_service_units import _core, _delta, _push, params  # pylint: disable=unused-import


def _bounded_core(params, directory, quorum):
  """Two learners, the service's push bounds (rounds of H = 4), quorum `quorum`."""
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=quorum))
  bounds = limits.PushLimits((TOKENS_PER_STEP,) * 2, limits.ROUND_SLACK * 4, 1000, False, (1.0, 1.0))
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(directory), checkpoint_every_merges=100,
                             lease_seconds=30.0, metadata={}, limits=bounds)
  core.start(time.time())
  return core


def test_more_refused_pushes_in_a_row_than_the_seq_window_then_a_valid_one_is_applied(params, tmp_path):
  """Before: each refused push spent a seq that never became acked, so after SEQ_WINDOW (64) of them every later push
  was refused out of bounds, the learner locked out for good."""
  core = _bounded_core(params, tmp_path, quorum=1)
  nan = jax.tree.map(lambda x: np.full(x.shape, np.nan, np.float32), params)
  with _serving(core) as (server, address):
    learner = _learner(address, 0)
    learner.join()
    for seq in range(limits.SEQ_WINDOW + 6):
      with pytest.raises(grpc.RpcError) as refused:
        learner.push(seq, nan, base_version=0, **HONEST)
      assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert server.rejections == {"rejected": limits.SEQ_WINDOW + 6}
    reply = learner.push(limits.SEQ_WINDOW + 6, _delta(params), base_version=0, **HONEST)
    assert reply["status"] == "applied" and core.acked[0] == limits.SEQ_WINDOW + 6
    with pytest.raises(grpc.RpcError, match="beyond its acknowledged seq"):  # The window itself still holds.
      learner.push(3 * limits.SEQ_WINDOW, _delta(params), base_version=0, **HONEST)
  core.close()


def test_a_refused_learner_leaves_the_quorum_until_a_push_of_it_is_applied(params, tmp_path):
  """Synchronous rounds (quorum 2): before, a learner whose pushes were refused stayed in the quorum while it called,
  and no round merged again (1 outer update in a diloco run instead of 19)."""
  core = _core(params, tmp_path, quorum=2)
  assert _push(core, params, 0, 0)["status"] == "applied" and core.syncer.version == 0  # Waits for learner 1.
  with pytest.raises(core_lib.PushRejected):
    _push(core, params, 1, 0, value=float("nan"))
  assert core.syncer.version == 1 and core.syncer.learners == {0}  # Learner 0's round merged without it.
  core.heartbeat(1, time.time())  # Calls alone do not bring a refused learner back...
  assert core.syncer.learners == {0}
  assert _push(core, params, 0, 1)["status"] == "applied" and core.syncer.version == 2
  assert _push(core, params, 1, 1)["status"] == "applied"  # ...an applied push of it does.
  assert core.syncer.learners == {0, 1} and core.syncer.version == 2  # Quorum 2 again: it waits for learner 0.
  core.close()


def test_a_replaced_process_is_fenced_in_a_status_of_its_own(params, tmp_path):
  """Its learner stops at once on PERMISSION_DENIED (learner_main); a refusal of the learner's own is
  INVALID_ARGUMENT, which it survives max_refusals_in_a_row - 1 times."""
  core = _bounded_core(params, tmp_path, quorum=1)
  with _serving(core) as (server, address):
    zombie, replacement = _learner(address, 0), _learner(address, 0)
    zombie.join()
    replacement.join()
    with pytest.raises(grpc.RpcError) as fenced:
      zombie.push(0, _delta(params), base_version=0, **HONEST)
    assert fenced.value.code() == grpc.StatusCode.PERMISSION_DENIED and "incarnation 1" in fenced.value.details()
    assert server.rejections == {"fenced": 1} and 0 not in core.benched  # Not a refusal of learner 0's own.
    assert replacement.push(0, _delta(params), base_version=0, **HONEST)["status"] == "applied"
  core.close()


def test_a_learner_process_stops_on_a_fenced_push_and_after_its_refusals_in_a_row():
  """The client's rule (learner_main applies it), on the replies its exchange makes of the syncer's answers."""
  count = 0
  for status in ("refused", "refused", "applied", "refused", "refused"):
    count = client_lib.refusals_in_a_row(1, {"status": status, "details": "NaN"}, count, 3)
  assert count == 2
  with pytest.raises(client_lib.LearnerStopped, match=r"refused its last 3 pushes in a row .*the last: NaN"):
    client_lib.refusals_in_a_row(1, {"status": "refused", "details": "NaN"}, count, 3)
  with pytest.raises(client_lib.LearnerStopped, match="learner 1 stops: replaced"):
    client_lib.refusals_in_a_row(1, {"status": "fenced", "details": "replaced"}, 0, 3)

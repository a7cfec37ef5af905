"""Push-header bounds (service/limits.py, with service/pace.py): a learner's own credential claims no more than that
learner can have done. Forged pushes go through the real server around an in-process core, as the learner's client
sends them; each is refused INVALID_ARGUMENT, counted as `out_of_bounds`, and leaves the syncer's state as it was."""

import time

import grpc
import pytest

from decoupled_diloco import model as model_lib
from decoupled_diloco import outer
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import limits, security
from decoupled_diloco.syncer import Settings, Syncer
from experiments.benchmarks import attacks
from tests import service_config
from tests.test_datachannel import _serving
from tests.test_service_units import TOKEN, _delta

TOKENS_PER_STEP = 64  # service_config: batch 4 × seq_len 16.
HONEST = {"tokens": 4 * TOKENS_PER_STEP, "local_steps": 4, "compute_seconds": 0.1}  # 0.025 s per step.


@pytest.fixture(scope="module")
def params():
  return model_lib.build_model(service_config.get_config().model, 0)[1]


def _limited_core(params, directory, time_budget=False, keeps_budget=True):
  """Two learners, quorum 1, a budget of 1000 steps, rounds of H = 4 (P = 1), the service's bounds."""
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(2), Settings(quorum=1))
  bounds = limits.PushLimits((TOKENS_PER_STEP,) * 2, limits.ROUND_SLACK * 4, 1000, time_budget, (1.0, 1.0),
                             keeps_budget)
  core = core_lib.SyncerCore(syncer, 2, budget_steps=1000, directory=str(directory), checkpoint_every_merges=100,
                             lease_seconds=30.0, metadata={}, limits=bounds)
  core.start(time.time())
  return core


def _learner(address, learner):
  """A learner's client with its own credential (HMAC of the run secret), as launch_local hands it out."""
  return client_lib.SyncerClient(address, security.learner_credential(TOKEN, learner), learner, chunk_bytes=1 << 16,
                                 timeout_seconds=10, retry_seconds=5)


def _push(client, params, core, seq, **fields):
  header = {**HONEST, **fields}
  return client.push(seq, _delta(params), base_version=core.syncer.version, **header)


def _state(core):
  """What a push may change: versions, the budget's count, every learner's pace and acked seq."""
  return (core.syncer.version, core.steps_done, core.tokens_done, core.pace.speeds, [list(r) for r in core.pace.recent],
          dict(core.acked), core.done)


@pytest.mark.parametrize("fields, text", [
    ({"budget_steps": 10**12}, "budget_steps=1000000000000 exceeds the 8 steps"),
    ({"budget_steps": -1000, "budget_tokens": 0}, "budget_steps=-1000 is not a share"),
    ({"budget_tokens": 2**62}, "budget_tokens=4611686018427387904 exceeds budget_steps"),
    ({"budget_tokens": -64}, "budget_tokens=-64 is not a share"),
    ({"local_steps": 1000, "budget_steps": 4, "budget_tokens": 256}, "local_steps=1000 exceeds the 8 steps"),
    ({"compute_seconds": 1e-6}, "over 16x faster than its hardware's"),
    ({"compute_seconds": 1e9}, "the seconds since it joined"),])
def test_a_header_beyond_what_its_learner_can_have_done_is_refused_and_changes_nothing(params, tmp_path, fields, text):
  core = _limited_core(params, tmp_path)
  with _serving(core) as (server, address):
    learners = [_learner(address, m) for m in range(2)]
    for learner in learners:
      learner.join()
    for seq in range(4):  # The first push of each holds compilation; the next three give each learner its median.
      for learner in learners:
        assert _push(learner, params, core, seq)["status"] == "applied"
    before = _state(core)
    assert before[3] == [40.0, 40.0] and before[1] == 32  # 4 steps per push, counted once each.
    with pytest.raises(grpc.RpcError) as refused:
      _push(learners[1], params, core, 4, **fields)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and text in refused.value.details(), (
        refused.value.details())
    assert server.rejections["out_of_bounds"] == 1 and _state(core) == before
    assert _push(learners[1], params, core, 4)["status"] == "applied"  # Its honest push of that seq: not a duplicate.
  core.close()


def test_a_fast_step_time_on_a_learners_first_pushes_is_held_to_its_hardwares(params, tmp_path):
  """A learner with no median of its own yet (its first pushes) is bounded by the others': over BAND× faster than
  its peers' medians (scaled by declared speeds) is refused, so DyLU never takes a first report's word for it."""
  core = _limited_core(params, tmp_path)
  with _serving(core) as (server, address):
    honest, liar = _learner(address, 0), _learner(address, 1)
    honest.join()
    liar.join()
    for seq in range(4):
      _push(honest, params, core, seq)
    with pytest.raises(grpc.RpcError, match="faster than its hardware's"):
      _push(liar, params, core, 0, compute_seconds=1e-6)
    assert server.rejections["out_of_bounds"] == 1 and core.pace.speeds == [40.0, 0.0]
    assert core.status(0)["max_speed"] == 0.0  # Learner 0's DyLU reference is not the lie.
  core.close()


def test_a_syncer_shard_that_does_not_keep_the_budget_refuses_a_budget_share():
  bounds = limits.PushLimits((64, 64), 8, 1000, keeps_budget=False)
  header = attacks.push_header(1, 8, local_steps=4, tokens=256, budget_steps=0, budget_tokens=0)
  limits.check_push(bounds, header, acked_seq=0, most_steps=8)
  for change in ({"budget_steps": 4, "budget_tokens": 256}, {"budget_steps": 1}):
    with pytest.raises(limits.OutOfBounds, match="does not keep the budget"):
      limits.check_push(bounds, {**header, **change}, acked_seq=0, most_steps=8)


def test_push_limits_follow_each_learners_batch_the_round_policy_and_the_shard():
  config = service_config.get_config()
  config.learners.batch_size = (4, 8)
  config.streaming.num_fragments = 2
  bounds = limits.PushLimits.from_config(config, budget_steps=80)
  assert bounds.tokens_per_step == (4 * config.model.seq_len, 8 * config.model.seq_len)
  assert bounds.round_steps == limits.ROUND_SLACK * 4 * 2 and bounds.keeps_budget and not bounds.time_budget
  assert not limits.PushLimits.from_config(config, 80, shard=1).keeps_budget
  config.policy.kind = "time_budget"
  assert limits.PushLimits.from_config(config, budget_steps=80).time_budget
  header = attacks.push_header(1, 8, tokens=8 * config.model.seq_len * 3, local_steps=3, seq=64, budget_steps=3,
                               budget_tokens=8 * config.model.seq_len * 3)
  limits.check_push(bounds, header, acked_seq=0, most_steps=3)  # Exactly at every bound: accepted.
  for change in ({"tokens": header["tokens"] + 1}, {"local_steps": 4}, {"budget_steps": 4}, {"seq": 65},
                 {"budget_tokens": header["budget_tokens"] + 1}):
    with pytest.raises(limits.OutOfBounds):
      limits.check_push(bounds, {**header, **change}, acked_seq=0, most_steps=3)


def test_a_time_budget_push_carries_what_its_pace_fits_since_that_fragments_last_push(params, tmp_path):
  core = _limited_core(params, tmp_path, time_budget=True)
  with _serving(core) as (_, address):
    learner = _learner(address, 0)
    learner.join()
    with pytest.raises(grpc.RpcError, match="exceeds the 8 steps"):  # Unmeasured: its first rounds are H.
      _push(learner, params, core, 0, local_steps=9, tokens=9 * 64, budget_steps=9, budget_tokens=9 * 64)
    for seq in range(2):
      _push(learner, params, core, seq)  # 0.025 s per step (the first push's is not a report).
    core.pace.pushed_at[(0, 0)] -= 10.0  # Its last push was 10 s ago: at most 4 × 10 / 0.025 = 1600 steps.
    assert core.pace.most_steps(0, 0, time.time(), 8, 1000) >= 1600
    core.pace.joined_at.pop(0)  # A learner that joined an earlier syncer process: its pace is unknown.
    assert core.pace.most_steps(0, 0, time.time(), 8, 1000) == 1000
  core.close()

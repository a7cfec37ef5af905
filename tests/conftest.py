"""Every test sees 8 virtual CPU devices, so learner groups get real, disjoint meshes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

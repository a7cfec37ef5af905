"""How a train process starts on the hardware it finds: the devices it asks for, the multi-host runtime, or a refusal.

A process sees only its own host's chips until it joins a multi-host runtime
(`jax.distributed.initialize`). That is right for one learner group on one multi-host slice:
every host runs `--role=learner --learner_id=I --group_coordinator=auto` (Cloud TPU and GKE
find the slice's hosts themselves) or `--group_coordinator=HOST:PORT --group_processes=N
--group_process_id=K` (flags, or DD_GROUP_COORDINATOR / DD_GROUP_PROCESSES /
DD_GROUP_PROCESS_ID in the environment, for launchers that set the environment per pod). It is
never right for several groups: a v5p slice and a v6e slice cannot be one JAX runtime, and
groups on one runtime would step in lockstep. So a config whose groups need more devices
than the process sees is refused in one line naming the launcher that runs it.
"""

import os

from decoupled_diloco.errors import ConfigError

ENV = {"coordinator": "DD_GROUP_COORDINATOR", "processes": "DD_GROUP_PROCESSES", "process_id": "DD_GROUP_PROCESS_ID"}


def from_env(name: str, default):
  """A group flag's default: the launcher's environment variable for it, else `default`."""
  value = os.environ.get(ENV[name], "")
  return type(default)(value) if value else default


def process_devices(devices: tuple[int, ...], role: str, learner_id: int | None, coordinator: str, processes: int,
                    evaluator_devices: int = 0) -> int:
  """Devices this process needs: all groups (local), one group or its share of one (learner), one (syncer),
  service.evaluator_devices or learner group 0's (evaluator). Sizes the virtual CPU backend, which must be set
  before JAX starts."""
  from decoupled_diloco.service import group  # pylint: disable=g-import-not-at-top  (imports JAX)

  if role == "syncer":
    return 1
  if role == "evaluator":
    return evaluator_devices or max(devices[0], 1)
  if role == "learner" and learner_id is not None and 0 <= learner_id < len(devices):
    return group.local_device_count(devices[learner_id], processes if coordinator != group.AUTO else 1)
  return max(sum(devices), 1)


def shortfall(devices: tuple[int, ...], role: str, learner_id: int | None, visible: int, platform: str) -> str:
  """'' when this process sees the devices its role needs, else the one line that says how to run the config."""
  if role == "syncer" or (role == "learner" and (learner_id is None or not 0 <= learner_id < len(devices))):
    return ""
  needed = devices[learner_id] if role == "learner" else sum(devices)
  if visible >= needed:
    return ""
  what = f"learner group {learner_id}" if role == "learner" else f"learners.devices={tuple(devices)}"
  head = f"{what} needs {needed} devices but this process sees {visible} ({platform})"
  if role == "learner":
    return (f"{head}: a group over a multi-host slice runs on every host with --group_coordinator=auto (Cloud "
            "TPU, GKE) or --group_coordinator=HOST:PORT --group_processes=N --group_process_id=K")
  if len(devices) > 1:
    return (f"{head}: each learner group is its own process on its own slice (groups on different slices cannot be "
            "one JAX runtime): start them with python -m experiments.launch_tpu up/start (configs/tpu_1b.py shows "
            "how), or --role=syncer plus --role=learner per group")
  return (f"{head}: one group over a multi-host slice runs as --config.runtime=service with --role=learner "
          "--learner_id=0 --group_coordinator=auto on every host and one --role=syncer (python -m "
          "experiments.launch_tpu starts them)")


def check_devices(devices: tuple[int, ...], role: str, learner_id: int | None) -> None:
  """Raises ConfigError (the shortfall line) when the runtime this process joined has too few devices."""
  import jax  # pylint: disable=g-import-not-at-top

  message = shortfall(devices, role, learner_id, jax.device_count(), jax.default_backend())
  if message:
    raise ConfigError(message)

"""Which GPUs each process of a one-machine run sees: launch_local's placement, as a pure function.

Why: every JAX process on a GPU machine opens every visible GPU and preallocates 75% of each,
so a second learner process runs out of memory, and a syncer or evaluator that never trains
would start the CUDA backend too. Here each learner group gets its own GPUs through
CUDA_VISIBLE_DEVICES (consecutive and disjoint while there are enough), several groups may
share GPUs for small ablations (each then preallocates only its share of a GPU's memory,
XLA_PYTHON_CLIENT_MEM_FRACTION), and the syncer and evaluator run on CPU only (JAX_PLATFORMS=cpu,
no GPU visible). Without GPUs every child gets the parent's environment: each sizes its own
CPU backend (jax_num_cpu_devices), as before.
"""

import os
import shutil
import subprocess
from collections.abc import Sequence

from decoupled_diloco.errors import ConfigError

# Share of a GPU's memory that the groups sharing it may preallocate together; the rest is the CUDA context's,
# cuDNN's workspace and fragmentation.
SHARED_MEMORY_FRACTION = 0.9
CPU_ONLY = {"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""}


def assign_gpus(group_devices: Sequence[int], gpus: int) -> list[tuple[int, ...]]:
  """The GPU indices of each learner group: disjoint while the groups need at most `gpus` in all, else round-robin
  (groups then share GPUs: every group needs no more than `gpus`, and each GPU hosts as few groups as can be).

  Why round-robin rather than refusing: one GPU must run the demo and the notebooks as a CPU
  does (four groups), at a share of its memory each; a group never sees the same GPU twice.
  """
  if any(count > gpus for count in group_devices):
    raise ConfigError(f"learners.devices={tuple(group_devices)} has a group of more than the {gpus} GPU(s) here: a "
                      f"group needs that many distinct GPUs; shrink it to <= {gpus} or run on a larger node")
  assigned, start = [], 0
  for count in group_devices:
    assigned.append(tuple((start + k) % gpus for k in range(count)))
    start += count
  return assigned


def child_env(base: dict, role: str, index: int, group_devices: Sequence[int], gpu_ids: Sequence[str]) -> dict:
  """The environment of launch_local's child `role` ('syncer', 'evaluator' or 'learner' group `index`) on a machine
  whose visible GPUs are `gpu_ids` (visible_gpus; empty: a CPU machine, `base` as it is)."""
  env = dict(base)
  if not gpu_ids:
    return env
  if role != "learner":
    return env | CPU_ONLY  # Merges and evaluation of Θ on the host: no GPU memory, no CUDA start-up.
  assigned = assign_gpus(group_devices, len(gpu_ids))
  env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[gpu] for gpu in assigned[index])
  env.pop("JAX_PLATFORMS", None)
  sharing = max(sum(gpu in mine for mine in assigned) for gpu in assigned[index])
  if sharing > 1:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{SHARED_MEMORY_FRACTION / sharing:.3f}"
  return env


def visible_gpus(env: dict | None = None) -> tuple[str, ...]:
  """The ids of the GPUs a child may be given: CUDA_VISIBLE_DEVICES' entries when set, else `nvidia-smi -L`'s
  indices (none without a driver, or under JAX_PLATFORMS=cpu). Asked without starting JAX, so the launcher
  itself never opens a GPU."""
  env = os.environ if env is None else env
  if env.get("JAX_PLATFORMS", "") == "cpu":
    return ()
  if "CUDA_VISIBLE_DEVICES" in env:
    return tuple(d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip())
  if not shutil.which("nvidia-smi"):
    return ()
  done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
  count = sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0
  return tuple(map(str, range(count)))

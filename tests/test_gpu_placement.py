"""launch_local's placement on a GPU machine, checked without GPUs: the environment each child process gets."""

import pytest

from decoupled_diloco.errors import ConfigError
from experiments import gpu_placement, launch_local

BASE = {"PATH": "/usr/bin", "JAX_PLATFORMS": "", "DD_SYNCER_TOKEN": "t"}


def _learner_gpus(group_devices, gpu_ids):
  envs = [gpu_placement.child_env(BASE, "learner", i, group_devices, gpu_ids) for i in range(len(group_devices))]
  return [env["CUDA_VISIBLE_DEVICES"].split(",") for env in envs], envs


@pytest.mark.parametrize("group_devices", [(2, 2, 2, 2), (4, 4), (1, 3, 4), (8,)])
def test_groups_on_a_node_of_8_gpus_get_disjoint_gpus_and_preallocate_freely(group_devices):
  gpus, envs = _learner_gpus(group_devices, tuple(map(str, range(8))))
  assert [len(g) for g in gpus] == list(group_devices)
  flat = [gpu for group in gpus for gpu in group]
  assert len(flat) == len(set(flat))  # Disjoint: no GPU opened by two learner processes.
  assert all("XLA_PYTHON_CLIENT_MEM_FRACTION" not in env and "JAX_PLATFORMS" not in env for env in envs)


@pytest.mark.parametrize("role", ["syncer", "evaluator"])
def test_the_syncer_and_evaluator_never_touch_a_gpu(role):
  env = gpu_placement.child_env(BASE, role, 0, (2, 2), ("0", "1", "2", "3"))
  assert env["JAX_PLATFORMS"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
  assert env["DD_SYNCER_TOKEN"] == "t" and env["PATH"] == "/usr/bin"


def test_groups_sharing_one_gpu_split_its_memory():
  gpus, envs = _learner_gpus((1, 1, 1, 1), ("0",))
  assert gpus == [["0"]] * 4
  assert {env["XLA_PYTHON_CLIENT_MEM_FRACTION"] for env in envs} == {"0.225"}  # 0.9 / 4: no preallocation fight.


def test_gpu_ids_follow_the_parents_visible_devices_and_a_cpu_machine_changes_nothing():
  gpus, _ = _learner_gpus((1, 1), gpu_placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "5,7"}))
  assert gpus == [["5"], ["7"]]
  assert gpu_placement.visible_gpus({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"}) == ()
  for role in ("syncer", "learner", "evaluator"):
    assert gpu_placement.child_env(BASE, role, 0, (2, 2), ()) == BASE


def test_a_group_larger_than_the_node_is_refused_in_one_line():
  with pytest.raises(ConfigError, match="shrink it to <= 2"):
    gpu_placement.assign_gpus((4, 1), 2)


def test_launch_local_hands_each_child_its_placement(tmp_path):
  cluster = launch_local.LocalCluster("configs/demo.py", str(tmp_path), [], 2, env=dict(BASE), group_devices=(1, 1),
                                      gpu_ids=("0", "1"))
  assert cluster._env("learner", 1)["CUDA_VISIBLE_DEVICES"] == "1"  # pylint: disable=protected-access
  assert cluster._env("syncer")["JAX_PLATFORMS"] == "cpu"  # pylint: disable=protected-access

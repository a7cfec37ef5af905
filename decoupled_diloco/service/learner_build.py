"""What a learner process is made of: its learner group, built as the in-process runtimes build theirs, and its
wall-clock account. `learner_main.LearnerProcess` runs the loop around them.
"""
import collections
import dataclasses
import time

import jax

from decoupled_diloco import experiment
from decoupled_diloco import model as model_lib
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.learner import Learner
from decoupled_diloco.run import account as account_lib
from decoupled_diloco.run import schedule
from decoupled_diloco.service import group as group_lib


def build_learner(config, plan: schedule.RunPlan, index: int, group: group_lib.GroupLink) -> Learner:
  """Learner group `index` alone, on this process's devices (its slice of the run), built as the
  in-process runtimes build theirs; this process reads only its rows of the group's batch."""
  count = config.learners.devices[index]
  devices = jax.devices()
  if len(devices) < count:
    raise ConfigError(f"learner {index} needs {count} devices but this process has {len(devices)}: "
                      "start it with jax_num_cpu_devices (experiments.train does) or on its own slice")
  tokenizer_lib.resolve_model_vocab(config)
  corpus = sources.load_corpus(config.data, config.model.seq_len)
  model, shapes, param_axes = model_lib.abstract_params(config.model)  # The params are created sharded, on the mesh.
  rows_per_process = config.learners.batch_size[index] // jax.process_count()
  rows = range(jax.process_index() * rows_per_process, (jax.process_index() + 1) * rows_per_process)
  learner = experiment.build_learner(config, plan, index, devices[:count], corpus, model, shapes, param_axes, rows)
  # θ comes to the leader one leaf at a time (only its Δ is sent); as pushed, it anchors a fragment no merge moved.
  learner.to_host, learner.keep_pushed, learner.forms_delta = group.gather_to_leader, True, group.leader
  return learner


@dataclasses.dataclass(kw_only=True)
class ProcessAccount(account_lib.Account):
  """A learner process's account: busy and blocked in wall-clock seconds, plus its exchanges."""
  begin: float = dataclasses.field(default_factory=time.perf_counter)
  final_ack: float = 0.0  # The part of `blocked` spent on the last push, which no round can hide.
  exchange: float = 0.0  # Background push + pull time: what a learner without overlap would have waited.
  statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # Acks by status.

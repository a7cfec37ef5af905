"""Assembles a run from its config: validated, then model, data, meshes, learners, syncer.

Everything that can reject a config runs here, before a runtime touches the workdir, so
a bad flag costs one error line and leaves nothing behind that a resume would trip over.
Runtimes take the assembled `Experiment` and only decide when things happen.
"""

import dataclasses
import math
from typing import Any

from absl import logging
import jax

from decoupled_diloco import compression, fragments, hardware, inner, mesh, mode_defaults, model as model_lib, outer
from decoupled_diloco import policy, robust
from decoupled_diloco.model import attention
from decoupled_diloco import shards
from decoupled_diloco import sharded_init
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.data import batches as batches_lib
from decoupled_diloco.data import settings as data_settings
from decoupled_diloco.data import sources
from decoupled_diloco.data import tokenizer as tokenizer_lib
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.learner import Learner
from decoupled_diloco.run import evaluator, schedule
from decoupled_diloco.runtime import byzantine, failures
from decoupled_diloco.service import runconfig
from decoupled_diloco.syncer import Settings, Syncer

MODES = ("diloco", "decoupled", "ddp")
RUNTIMES = ("lockstep", "sim", "service", "threads")  # service: experiments.train --role=syncer|learner.


@dataclasses.dataclass
class Experiment:
  """A ready-to-run experiment; runtimes mutate its learners and syncer as it trains."""
  config: Any
  plan: schedule.RunPlan  # Budget, cadence, schedules and speeds, derived once from the config.
  model: model_lib.LanguageModel
  corpus: sources.Corpus
  learners: list[Learner]
  syncer: Syncer | None  # None in ddp mode: one group, no outer loop.
  evals: evaluator.EvalSet  # Held-out batches Θ is evaluated on.
  byte_scale: float  # Simulated / real parameter count: real payload bytes -> simulated bytes.
  assignment: tuple[int, ...] = ()  # Fragment id of every param leaf (streaming); all 0 when P = 1.

  @property
  def global_params(self):
    """The params the run stands for: Θ under DiLoCo, the single group's params under ddp."""
    if self.syncer is not None:
      return self.syncer.params
    return self.learners[0].params


def with_overrides(config, overrides: dict):
  """`config` with dotted-key overrides applied ({'outer.lr': 0.5}), as `--config.outer.lr=0.5` would.

  Benchmarks, sweeps and tests derive their variants this way from a shipped config.
  """
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for name in (*parents, leaf):
      _require(
          hasattr(node, "keys") and name in node, f"unknown config key {key!r}: every field is one of "
          "configs/default.py's; fix the spelling")
      if name != leaf:
        node = node[name]
    node[leaf] = value
  return config


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def validate(config) -> settings_lib.Groups:
  """Builds every typed config group, each checking its own fields, and applies the rules that span groups.

  Rejects impossible run shapes with one line that names the fix, before a runtime touches the
  workdir; returns the groups, so that nothing has to parse the config again. Fields left at
  'auto' take the mode's recipe first (mode_defaults), in place, so every reader sees the values.
  """
  mode_defaults.resolve(config)
  _validate_run_shape(config)
  data = data_settings.Settings.from_config(config.data)
  tokenizer_lib.resolve_model_vocab(config)
  model = model_lib.Settings.from_config(config.model)
  inner_settings = inner.Settings.from_config(config.inner)
  layouts = mesh.layouts_from_config(config.learners)
  for group, (layout, batch) in enumerate(zip(layouts, config.learners.batch_size)):
    _require(
        batch >= 1 and batch % layout.batch_shards == 0,
        f"learner group {group}: batch_size {batch} is not divisible by its {layout.batch_shards} batch shards "
        f"(data × fsdp of {layout}): make each learners.batch_size a positive multiple of them")
    inner.validate_microbatches(inner_settings.microbatches, batch, layout.batch_shards, group)
    experts = model.moe.num_experts
    _require(
        layout.expert == 1 or (experts and experts % layout.expert == 0),
        f"learners.layouts[{group}]={str(layout)!r} splits model.moe.num_experts={experts} experts over expert="
        f"{layout.expert}: use an expert axis size that divides num_experts (a dense model: data=N instead)")
  _require(
      config.eval_batch_size % layouts[0].batch_shards == 0,
      f"eval_batch_size {config.eval_batch_size} is not divisible by group 0's {layouts[0].batch_shards} batch "
      "shards (data × fsdp): make it a multiple")
  outer_settings = syncer = streaming = codec = None
  _require(config.mode != "ddp" or config.service.shards == 1,
           f"mode='ddp' has no syncer to shard but service.shards={config.service.shards}: leave it at 1")
  if config.mode != "ddp":
    outer_settings, syncer = outer.Settings.from_config(config.outer), _syncer_group(config)
    streaming, codec = _streaming_groups(config)
  policy_settings = policy.Settings.from_config(config.policy)
  failure_settings = failures.Settings.from_config(config)
  byzantine.Settings.from_config(config)
  hardware.profiles_from_config(config.learners, config.sim.reference_step_seconds)
  service = runconfig.validate(config) if config.runtime == "service" else None
  return settings_lib.Groups(model, data, inner_settings, outer_settings, syncer, streaming, codec, policy_settings,
                             failure_settings, service)


def _validate_run_shape(config) -> None:
  """Mode, runtime, run length, cadences and the learner groups: the top level of the config."""
  _require(config.mode in MODES, f"mode={config.mode!r} is unknown: use one of {MODES}")
  _require(config.runtime in RUNTIMES, f"runtime={config.runtime!r} is unknown: use one of {RUNTIMES}")
  schedule.require_supported(config.mode, config.runtime)
  _require(config.inner_steps >= 1, f"inner_steps (H) = {config.inner_steps} must be >= 1: set --config.inner_steps=N")
  _require(config.outer_steps >= 1, f"outer_steps = {config.outer_steps} must be >= 1: set --config.outer_steps=N")
  for name in ("eval_every", "checkpoint_every", "log_every", "eval_batches", "eval_batch_size"):
    _require(config[name] >= 1, f"{name} = {config[name]} must be >= 1: set --config.{name}=N")
  _require(config.divergence_evals >= 0,
           f"divergence_evals = {config.divergence_evals} must be >= 0 (0 = only a non-finite loss is divergence)")
  devices, batch_sizes = tuple(config.learners.devices), tuple(config.learners.batch_size)
  _require(len(devices) >= 1, "learners.devices is empty: list one device count per learner group")
  _require(
      len(devices) == len(batch_sizes),
      f"learners.devices has {len(devices)} groups but learners.batch_size has {len(batch_sizes)}: "
      "give one batch size per group")
  _require(all(count >= 1 for count in devices), f"learners.devices={devices} has a group with < 1 device: "
           "give every group at least 1")
  _require(config.mode != "ddp" or len(devices) == 1,
           f"mode='ddp' trains one group but learners.devices={devices}: use one group, e.g. (8,)")
  slowdown = tuple(config.learners.slowdown)
  _require(
      len(slowdown) in (0, len(devices)),
      f"learners.slowdown has {len(slowdown)} entries for {len(devices)} learner groups: give one factor per "
      "group (0 = full speed) or () for none")
  _require(all(f >= 0 for f in slowdown), f"learners.slowdown={slowdown} has a negative factor: use factors >= 0")


def _syncer_group(config) -> Settings:
  """The merge policy, and the syncer's start rules, against the number of learners."""
  settings_lib.refuse_unknown(
      config.syncer, "syncer",
      (*(f.name for f in dataclasses.fields(Settings)), "min_learners_to_start", "start_timeout_seconds"))
  settings = Settings.from_config(config.syncer)
  learners = len(config.learners.devices)
  _require(
      settings.quorum <= learners,
      f"syncer.quorum={settings.quorum} exceeds the {learners} learners: it could never be met; "
      "lower --config.syncer.quorum (0 = all learners)")
  _require(
      0 <= config.syncer.min_learners_to_start <= learners,
      f"syncer.min_learners_to_start={config.syncer.min_learners_to_start} must be in [0, {learners}] "
      "(0 = all learners)")
  _require(config.syncer.start_timeout_seconds > 0,
           f"syncer.start_timeout_seconds={config.syncer.start_timeout_seconds} must be > 0")
  if settings.merge_rule == "trimmed_mean":
    _require(
        config.runtime != "service",
        "syncer.merge_rule='trimmed_mean' holds a merge's pushes in memory, built for runtimes sim and threads "
        "only (the service would read them back from its log; not built): use merge_rule='clip' there")
    quorum = settings.quorum if config.mode == "decoupled" and settings.quorum else learners
    _require(
        robust.trim_count(quorum, settings.trim_fraction) >= 1,
        f"syncer.merge_rule='trimmed_mean' trims floor({settings.trim_fraction} x {quorum}) = 0 of a merge's "
        f"{quorum} pushes (its quorum): raise syncer.quorum to >= {math.ceil(1 / settings.trim_fraction)} or "
        "syncer.trim_fraction, or use merge_rule='clip'")
  return settings


def _streaming_groups(config) -> tuple[fragments.Streaming, compression.Codec]:
  """Fragments, overlap and compression: checked against the model's real tensors, H, runtime and policy."""
  streaming = fragments.Streaming.from_config(config.streaming)
  codec = compression.Codec.from_config(config.compression)
  fragments.partition(model_lib.abstract_params(config.model)[1], streaming.num_fragments, streaming.strategy)
  shards.check_count(config.service.shards, streaming.num_fragments)
  _require(
      0 <= streaming.overlap_steps < config.inner_steps,
      f"streaming.overlap_steps (tau) = {streaming.overlap_steps} must be in [0, inner_steps={config.inner_steps}): "
      "a merged fragment must land before the same fragment syncs again")
  _require(
      config.runtime in ("sim", "service") or not streaming.streams,
      "streaming (num_fragments > 1 or overlap_steps > 0) needs a clock: add --config.runtime=sim, or run "
      "the syncer and learners as processes (--role)")
  _require(streaming.num_fragments == 1 or config.policy.kind != "time_budget",
           "streaming schedules fragments over H steps: use policy.kind 'fixed' or 'dylu' with num_fragments > 1")
  sim = config.sim
  for name in ("learner_link_gbps", "learner_link_latency_seconds"):
    _require(
        len(sim[name]) in (0, len(config.learners.devices)),
        f"sim.{name} has {len(sim[name])} entries for {len(config.learners.devices)} learner groups: "
        "give one per group or none")
  _require(
      min((sim.link_gbps, sim.link_latency_seconds, *sim.learner_link_gbps, *sim.learner_link_latency_seconds)) >= 0,
      "sim link bandwidths and latencies must be >= 0 (bandwidth 0 = unlimited)")
  return streaming, codec


def syncer_settings(config) -> Settings:
  """The merge policy `config.syncer` asks for, in every mode that has a syncer.

  Synchronous DiLoCo is the decoupled machine with every learner in the quorum, and every
  push has staleness 0 there (so each staleness function weighs 1 and none is dropped):
  merge_rule and token_weighting apply as configured. A quorum K of fewer learners cannot
  apply to rounds that wait for all; it is said so once, not silently dropped, so that a
  decoupled config still switches to its synchronous baseline with --config.mode=diloco.
  """
  settings = Settings.from_config(config.syncer)
  if config.mode == "decoupled":
    return settings
  if settings.quorum not in (0, len(config.learners.devices)):
    logging.warning(
        "mode='diloco' merges once all %d learners reported: syncer.quorum=%d (and its grace window) "
        "applies to mode='decoupled' only", len(config.learners.devices), settings.quorum)
  return dataclasses.replace(settings, quorum=0)


def fragment_assignment(config, params) -> tuple[int, ...]:
  """Fragment id of every param leaf (all 0 unless streaming); () under ddp, which syncs nothing."""
  if config.mode == "ddp":
    return ()
  return fragments.partition(params, config.streaming.num_fragments, config.streaming.strategy)


def build_learner(config, plan: schedule.RunPlan, index: int, devices, corpus, model, params_shape, param_axes,
                  rows: range | None = None) -> Learner:
  """Learner group `index` on `devices`, starting from the seed's params (created sharded on its mesh,
  sharded_init): what every runtime and a learner process train. `params_shape`: the params' shapes
  (model.abstract_params). `rows`: this process's rows of the group's batch (a multi-process group)."""
  layout = mesh.layouts_from_config(config.learners)[index]
  # What the group's backend cannot run is refused here, before a runtime starts (splash off a TPU, cuDNN off a GPU).
  attention.select(config.model.attention, devices[0].platform, config.model.dtype, config.model.document_eod_id >= 0)
  loop = inner.build_inner_loop(model, inner.inner_optimizer(config.inner, plan.expected_steps[index]),
                                mesh.group_mesh(devices, layout), params_shape, param_axes, config.inner.microbatches)
  shard = batches_lib.learner_batches(corpus, config.model.seq_len, batch_size=config.learners.batch_size[index],
                                      learner_index=index, num_learners=plan.num_learners, split=config.data.split,
                                      seed=config.seed, rows=rows, prefetch=config.data.prefetch)
  return Learner(index, loop, shard, loop.init_fresh(sharded_init.params_fn(config.model, config.seed)),
                 fragment_assignment(config, params_shape), compression.Codec.from_config(config.compression),
                 config.streaming.alpha,
                 keep_pushed=config.mode == "decoupled")  # A quorum K > 1 may answer a push with the same Θ.


def build_syncer(config, params, shard: int | None = None) -> Syncer | None:
  """The syncer that owns Θ (None under ddp): the in-process runtimes' (all `service.shards` shards behind
  one interface) and the syncer process's (`shard`: that shard's own fragments only)."""
  if config.mode == "ddp":
    return None
  mode_defaults.resolve(config)  # Idempotent: a config built by hand (a test, a notebook) gets the mode's recipe too.
  settings, codec = syncer_settings(config), compression.Codec.from_config(config.compression)

  def make(part, assignment) -> Syncer:
    return Syncer(outer.outer_optimizer(config.outer), part, range(len(config.learners.devices)), settings,
                  assignment=assignment, codec=codec)

  return shards.build(make, params, fragment_assignment(config, params), config.service.shards, shard)


def build(config, devices=None) -> Experiment:
  """Validates `config` and builds every component; raises ConfigError on bad input."""
  validate(config)
  plan = schedule.RunPlan.from_config(config)
  devices = jax.devices() if devices is None else devices
  groups = mesh.partition_devices(devices, config.learners.devices)
  corpus = sources.load_corpus(config.data, config.model.seq_len)
  model, shapes, param_axes = model_lib.abstract_params(config.model)
  num_params = config.sim.simulated_params or model_lib.count_params(shapes)
  learners = [
      build_learner(config, plan, index, group, corpus, model, shapes, param_axes) for index, group in enumerate(groups)
  ]
  syncer = None if config.mode == "ddp" else build_syncer(config, sharded_init.host_params(config.model, config.seed))
  return Experiment(config, plan, model, corpus, learners, syncer, evaluator.EvalSet.from_corpus(config, corpus),
                    num_params / model_lib.count_params(shapes), learners[0].assignment if syncer else ())

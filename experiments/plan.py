r"""Plans a run before anyone books a slice: per-chip memory, step time and the exchange, per group.

  python -m experiments.plan --config=configs/tpu_1b.py
  python -m experiments.plan --config=configs/tpu_8b.py --xla=false   # analytic only, seconds

For every learner group it prints bytes per chip (params, AdamW state, gradients, activations
at the model's remat) from `decoupled_diloco.plan`, beside XLA's own peak for the group's inner
step compiled abstractly (ShapeDtypeStructs with the layout's shardings, nothing allocated) over
as many virtual CPU devices as the slice has chips, in a subprocess; the start-up peak (params and
AdamW state created sharded, sharded_init) beside the step's, analytic and compiled; FLOPs, step time at the
profile's MFU and tokens/s per chip; and the exchange with the syncer per fragment. No TPU needed.
When a group does not fit its chip's HBM it ends with one `error:` line naming the group, the
shortfall and the knob to turn, and exits with status 2 (as it does on bad input).
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco import experiment, hardware, mesh, model as model_lib, plan
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.run import schedule
from experiments import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (a configs/*.py).", lock_config=True)
_XLA = flags.DEFINE_bool(
    "xla", True, "Also compile each group's inner step abstractly on virtual CPU devices "
    "and show XLA's memory analysis (minutes for 1B-8B models).")
_COMPILE_GROUP = flags.DEFINE_integer(
    "compile_group", None, "Internal: compile this group in this process "
    "(started with enough virtual devices) and print its figures as JSON.")
GB = 1e9


def compile_in_subprocess(group: int, devices: int) -> dict:
  """Runs `compile_group` in a fresh process that sees `devices` virtual CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  argv = [a for a in sys.argv[1:] if not a.startswith(("--compile_group", "--xla", "--noxla"))]
  done = subprocess.run([sys.executable, "-m", "experiments.plan", *argv, f"--compile_group={group}"], env=env,
                        capture_output=True, text=True, check=False)
  if done.returncode:
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    cli.fail(f"compiling group {group} on {devices} virtual CPU devices failed ({last}): fix that, or plan without "
             "XLA's figures with --xla=false")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
  return f"{n / GB:8.2f} GB"


def _active(model_cfg) -> str:
  """' (2.10B active)' for an MoE model, whose FLOPs (step time) follow its active params; '' for a dense one."""
  idle = model_lib.idle_expert_params(model_cfg)
  return f" ({model_lib.active_params(model_cfg) / 1e9:.2f}B active)" if idle else ""


def _time(seconds: float) -> str:
  return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def knob(config, group: int, memory) -> str:
  """What to turn when a group does not fit: the biggest lever for what fills the chip."""
  layout = mesh.layouts_from_config(config.learners)[group]
  if memory.activations >= memory.peak / 2:
    if config.model.remat == "none":
      return "turn on remat (--config.model.remat=full)"
    return (f"split the batch into microbatches (--config.inner.microbatches={2 * config.inner.microbatches}), "
            f"lower learners.batch_size[{group}] or add batch shards (data/fsdp) to learners.layouts[{group}]")
  return f"shard the state over more chips: raise fsdp (or tensor) in learners.layouts[{group}] (now {layout})"


def print_group(config, group: int, xla: dict | None):
  """One group's memory, compute and exchange; returns its MemoryPlan and the peak that decides the fit."""
  layout = mesh.layouts_from_config(config.learners)[group]
  chip, memory = plan.chip_of(config, group), plan.memory_plan(config, group)
  batch, seq = config.learners.batch_size[group], config.model.seq_len
  remat, runs = config.model.remat, plan.chip_attention(config.model, chip)
  traced = runs.kernel
  print(f"group {group}: {chip} x {layout.devices} chips, layout {layout}, batch {batch} x {seq} tokens "
        f"({batch // layout.batch_shards} sequences per batch shard, {config.inner.microbatches} microbatch(es)), "
        f"remat {remat}, attention {traced}{f' ({runs.fallback})' if runs.fallback else ''}")
  print("  memory per chip           analytic       XLA (CPU compile)")
  for name in ("params", "optimizer", "gradients", "activations"):
    print(f"    {name:<20} {_gb(getattr(memory, name))}")
  decided = max(memory.peak, memory.startup)
  xla_text = init_text = "not compiled (--xla=false)"
  if xla:
    xla_text, init_text = f"{_gb(xla['peak_bytes'])}  (compiled in {xla['compile_seconds']:.0f} s)", _gb(
        xla["init_peak_bytes"])
    if xla["attention"] == traced:
      decided = max(decided, xla["peak_bytes"], xla["init_peak_bytes"])
    else:
      xla_text += (f"; XLA on CPU compiled attention as {xla['attention']} (T x T scores) where the chip runs "
                   f"{traced}: the fit uses the analytic figure")
  verdict = "fits" if decided <= memory.usable else "DOES NOT FIT"
  print(f"    {'peak (step)':<20} {_gb(memory.peak)}   {xla_text}")
  print(f"    {'start-up (init)':<20} {_gb(memory.startup)}   {init_text}  (params and AdamW state created sharded)")
  print(f"    chip HBM {memory.hbm / GB:.0f} GB, {memory.usable / GB:.1f} GB usable "
        f"({plan.RESERVED_HBM_FRACTION:.1%} reserved): {verdict}")
  comm = plan.comm_plan(config, group)
  flops = schedule.flops_per_step(config)[group]
  scanned = "; a scanned layer's body counted once" if config.model.scan_layers else ""
  xla_flops = f" (XLA's cost analysis per chip: {xla['flops']:.3g}{scanned})" if xla else ""
  print(f"  compute: {flops:.3g} FLOPs per step, {flops / layout.devices:.3g} per chip{xla_flops}; "
        f"{_time(comm.step_seconds)} per step at MFU {config.learners.mfu}; "
        f"{batch * seq / comm.step_seconds / layout.devices:,.0f} tokens/s per chip")
  gbps, latency = plan.link(config, group)
  link = f"{gbps:g} Gbit/s + {latency * 1e3:g} ms" if gbps else "unlimited bandwidth"
  print(f"  exchange per fragment (P={comm.num_fragments}, {config.compression.format} up, "
        f"{config.compression.downlink_format} down, link {link}): push {comm.push_bytes / GB:.2f} GB + pull "
        f"{comm.pull_bytes / GB:.2f} GB in {_time(comm.transfer_seconds)}; H={comm.inner_steps} steps compute "
        f"{_time(comm.compute_seconds)}")
  if comm.hides:
    print(f"    hides under compute with tau={comm.overlap_steps} (needs tau >= {comm.overlap_needed})")
  else:
    fmt, fragments = plan.hiding_format(config, group), plan.hiding_fragments(config, group)
    print(f"    does NOT hide with tau={comm.overlap_steps}: needs tau >= {comm.overlap_needed} steps "
          f"(and P x transfer <= H steps); most faithful format that hides: {fmt or 'none'}; "
          f"fewest fragments that hide: {fragments or 'none'}")
  return memory, decided


def main(argv):
  del argv
  if _CONFIG.value is None:
    cli.fail("--config is required: e.g. --config=configs/tpu_1b.py")
  config = cli.load_config(_CONFIG)
  try:
    experiment.validate(config)
    for group, chip in enumerate(plan.chip_of(config, g) for g in range(len(config.learners.devices))):
      if chip not in hardware.ACCELERATORS:
        raise ConfigError(f"learner group {group} has no chip (learners.hardware={tuple(config.learners.hardware)}): "
                          f"set --config.learners.hardware to one of {sorted(hardware.ACCELERATORS)} per group")
  except ConfigError as error:
    cli.fail(error)
  if _COMPILE_GROUP.value is not None:
    print(json.dumps(plan.compile_group(config, _COMPILE_GROUP.value)))
    return
  print(f"plan for {config.mode} over {len(config.learners.devices)} learner groups: "
        f"{model_lib.count_params(model_lib.abstract_params(config.model)[1]) / 1e9:.2f}B params"
        f"{_active(config.model)}, "
        f"H={config.inner_steps}, P={config.streaming.num_fragments}, tau={config.streaming.overlap_steps}\n")
  misfits = []
  for group, devices in enumerate(config.learners.devices):
    xla = compile_in_subprocess(group, devices) if _XLA.value else None
    memory, decided = print_group(config, group, xla)
    if decided > memory.usable:
      misfits.append(f"group {group} ({plan.chip_of(config, group)} x {devices}) needs {decided / GB:.1f} GB per chip, "
                     f"{(decided - memory.usable) / GB:.1f} GB over its {memory.usable / GB:.1f} GB usable HBM: "
                     f"{knob(config, group, memory)}")
    print()
  print(f"syncer host: {plan.syncer_bytes(config) / GB:.2f} GB (Θ, outer state and merge sums in fp32, the outer "
        f"step's scratch ({plan.merge_scratch_bytes(config) / GB:.2f} GB, {config.outer.optimizer}), plus the push "
        "being received; the same for any number of learners)")
  if misfits:
    cli.fail(misfits[0] + (f" (and {len(misfits) - 1} more group(s))" if len(misfits) > 1 else ""))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)

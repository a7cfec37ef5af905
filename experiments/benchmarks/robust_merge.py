r"""One faulty learner among 8: how far each merge rule lets it move Θ (issue 31's robust merges).

Rows, on the virtual clock (Decoupled DiLoCo, 8 learner groups of one device, quorum 4, the demo's
synthetic language with a ~30k-parameter model, equal tokens: `outer_steps` rounds of H = 10): the
merge rules `mean`, `clip` (the default robust rule: each push scaled to at most 2 × the median of
recent push norms) and `trimmed_mean` (β = 0.25: one of a merge's 4 pushes trimmed at each end, per
coordinate), each with every learner honest and with learner 3 pushing (failures.byzantine_kind) its
pseudo-gradient ×100 (`scaled`), sign-flipped (`flipped`), or Gaussian noise of its honest norm
(`noise`).

JSON key `loss_ratio`: {rule: {scaled, flipped, noise, honest}} = final eval loss / the all-honest
`mean` run's. Targets: `clip` within 2 % of honest under every fault and within 1 % with none;
`mean` worse than 2 % under at least the scaled fault. Context line: the eval losses, the pushes
each rule clipped and the faulty learner's trimmed share.

  python -m experiments.benchmarks.robust_merge [--outer_steps=6] [--rules=mean,clip,trimmed_mean]
"""

from experiments.benchmarks import common

common.use_virtual_devices()

import os  # noqa: E402  pylint: disable=g-import-not-at-top
import tempfile  # noqa: E402
import time  # noqa: E402

from configs import demo  # noqa: E402
from decoupled_diloco import experiment, metrics as metrics_lib  # noqa: E402
from decoupled_diloco.runtime import sim  # noqa: E402

FAULTY, KINDS, LEARNERS = 3, ("scaled", "flipped", "noise"), 8
TARGET_HONEST, TARGET_FAULT = 1.01, 1.02
DEFAULT_RULE = "clip"
SMALL = {  # A ~30k-parameter model on the synthetic language: 12 runs fit a loaded 2-core machine.
    "model.seq_len": 16, "model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2, "model.d_ff": 64,
    "data.synthetic.num_tokens": 60_000, "eval_batches": 2, "eval_batch_size": 8, "inner.warmup_steps": 2}


def config(rule: str, kind: str, outer_steps: int):
  """The demo shrunk to 8 one-device learners, quorum 4, `rule`, and learner 3 faulty unless `kind` is 'honest'."""
  overrides = {
      "mode": "decoupled",
      "runtime": "sim",
      "learners.devices": (1,) * LEARNERS,
      "learners.batch_size": (4,) * LEARNERS,
      "outer_steps": outer_steps,
      "inner_steps": 10,
      "eval_every": 10_000,
      "syncer.quorum": 4,
      "syncer.grace_gamma": 0.0,  # Merges of exactly 4 pushes: no window gathers all 8.
      "syncer.merge_rule": rule,
      "syncer.trim_fraction": 0.25,
      **SMALL}
  if kind != "honest":
    overrides.update({"failures.byzantine_learner": FAULTY, "failures.byzantine_kind": kind})
  return experiment.with_overrides(demo.get_config(), overrides)


def run(rule: str, kind: str, outer_steps: int) -> dict:
  """One row: its final eval loss, pushes clipped, and the faulty learner's trimmed share."""
  exp = experiment.build(config(rule, kind, outer_steps))
  try:
    with tempfile.TemporaryDirectory() as workdir:
      summary = sim.run(exp, workdir)
      records = list(metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl")))
  finally:
    for learner in exp.learners:
      learner.batches.close()
  faulty = next(r for r in records if r["kind"] == "learner_summary" and r["learner"] == FAULTY)
  loss = float("inf") if summary.get("diverged") else summary["eval_loss"]
  return {
      "eval_loss": loss, "clipped": sum(r.get("clipped", 0) for r in records if r["kind"] == "push"),
      "faulty_clipped": faulty["clipped"], "faulty_trimmed_share": faulty["trimmed_share"]}


def main() -> None:
  """Runs every rule under every fault, prints the table and the JSON line."""
  parser = common.parser(__doc__)
  parser.add_argument("--outer_steps", type=int, default=6, help="rounds of H = 10 steps (fewer: a reduced run)")
  parser.add_argument("--rules", default="mean,clip,trimmed_mean", help="comma-separated merge rules")
  args = parser.parse_args()
  rules = args.rules.split(",")
  if "mean" not in rules:
    parser.error("--rules must hold 'mean': every ratio is to its all-honest run")
  rows = {}
  with common.compile_once():
    for rule in rules:
      for kind in ("honest", *KINDS):
        begin = time.time()
        rows[(rule, kind)] = run(rule, kind, args.outer_steps)
        print(
            f"{rule:13s} {kind:8s} eval {rows[(rule, kind)]['eval_loss']:.4f} ({time.time() - begin:.0f} s) "
            f"{rows[(rule, kind)]}", flush=True)
  reference = rows[("mean", "honest")]["eval_loss"]
  ratio = {
      rule: {kind: round(rows[(rule, kind)]["eval_loss"] / reference, 4) for kind in ("honest", *KINDS)} for rule in rules
  }
  print(f"\n{'rule':13s} " + " ".join(f"{k:>8s}" for k in ("honest", *KINDS)))
  for rule in rules:
    print(f"{rule:13s} " + " ".join(f"{ratio[rule][k]:8.4f}" for k in ("honest", *KINDS)))
  if DEFAULT_RULE in ratio:
    met = ratio[DEFAULT_RULE]["honest"] <= TARGET_HONEST and all(ratio[DEFAULT_RULE][k] <= TARGET_FAULT for k in KINDS)
    print(f"{DEFAULT_RULE}: {'met' if met else 'MISSED'} (honest <= {TARGET_HONEST}, faults <= {TARGET_FAULT})")
  worse = ratio["mean"]["scaled"] > TARGET_FAULT
  print(f"mean under the scaled fault: {ratio['mean']['scaled']} ({'>' if worse else '<='} {TARGET_FAULT})")
  common.emit_keys(
      {
          "loss_ratio": ratio, "outer_steps": args.outer_steps, "rows": {
              f"{rule}/{kind}": row for (rule, kind), row in rows.items()}}, ("loss_ratio",))


if __name__ == "__main__":
  main()

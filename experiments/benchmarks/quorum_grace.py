r"""Minimum quorum and the adaptive grace window under mixed hardware (Decoupled DiLoCo paper, §5).

Eight learners on the virtual clock: four "v6e" that step 18 % faster than four "v5p", each
step time jittered by 10 % (log-normal, seeded), H = 20, equal tokens in every row, and in
every row a streaming overlap of τ = 4 steps: a learner pushes, keeps training, and needs the
merged Θ only τ steps later (the paper's main runs overlap τ = 2 of H = 24 steps, P = 24).
- k_all: every learner in every merge, and each waits for it once its τ steps are done
  (synchronous DiLoCo: the fast ones idle while the slow ones finish), outer Nesterov SGD;
- k1: quorum 1, learners never wait, each merge takes whoever arrived (Delayed Nesterov, one
  momentum step per 8 merges); DyLU sizes every learner's H by its speed, to the nearest step (20 and 17),
  so all periods take about as long;
- k1_grace: k1 plus the adaptive grace window (γ = 0.85, slack τ_g = τ = 4 steps): the syncer
  holds a merge open for late learners within the slack the overlap gives, and the learners in
  a window receive its merge, which lands while they go on training. With DyLU's periods
  within half a step of each other, a window gathers all eight learners, one merge a round,
  so Nesterov steps on every merge (N = 1), as k_all's.
Goodput is the paper's: the share of allocated chip-time the chips compute (the summary's
`compute_utilization`): its K = 1 rows reach 100 % with τ = 2 overlapped steps, so overlapped
steps count. The project's stricter `goodput` (merged compute only; with α = 0 a landing drops
what the τ steps did) is printed beside it (docs/experiments.md).
Published (arXiv 2604.21428, §5; text score, higher is better): K = 8 54.4 at 84 % goodput,
K = 1 51.4 at 100 %, K = 1 + grace 55.3 at 100 %.
Target: k1_grace's eval loss <= 1.005 × k_all's at goodput >= 0.98; k1 visibly worse than both.

  python -m experiments.benchmarks.quorum_grace
"""

from experiments.benchmarks import common

common.use_virtual_devices(16)

from absl import app  # noqa: E402  pylint: disable=g-import-not-at-top

from experiments.benchmarks import shakespeare  # noqa: E402

LEARNERS, OUTER_STEPS, OVERLAP = 8, 8, 4
SPEED_GAP, JITTER = 1.18, 0.1
PUBLISHED = {
    "text_score": {"k_all": 54.4, "k1": 51.4, "k1_grace": 55.3}, "goodput": {"k_all": 0.84, "k1": 1.0, "k1_grace": 1.0}}


def rows() -> dict:
  """Row name -> config; tiny size keeps the rows with 2 learners (one fast, one slow) and τ = 2 (H = 4 there)."""
  learners, overlap = (2, 2) if shakespeare.tiny() else (LEARNERS, OVERLAP)
  mixed = {
      "learners.speed": (SPEED_GAP,) * (learners // 2) + (1.0,) * (learners // 2), "learners.jitter": JITTER,
      "streaming.overlap_steps": overlap}
  quorum_1 = {**mixed, "policy.kind": "dylu", "policy.dylu_rounding": "nearest"}
  return {
      "k_all": shakespeare.config(learners, OUTER_STEPS, **mixed, mode="diloco",
                                  **{"outer.optimizer": "sgd", "outer.buffer_size": 1}),
      "k1": shakespeare.config(learners, OUTER_STEPS, **quorum_1),
      "k1_grace": shakespeare.config(
          learners, OUTER_STEPS, **quorum_1,
          **{"syncer.grace_gamma": 0.85, "syncer.grace_overlap_steps": float(overlap), "outer.buffer_size": 1}),}


def main(argv) -> None:
  """Runs the three rows, prints the table and the ratios, then the JSON line (eval_loss, goodput)."""
  del argv
  results, figures = shakespeare.compare(rows(), PUBLISHED["goodput"], counts=("merges",))
  loss = figures["eval_loss"]
  utilization = {name: round(r["compute_utilization"], 4) for name, r in results.items()}
  print(f"goodput (paper's: busy chip-time) {utilization}; merged compute only {figures['goodput']}")
  print(f"k1_grace / k_all loss {loss['k1_grace'] / loss['k_all']:.4f}, k1 / k_all {loss['k1'] / loss['k_all']:.4f}")
  common.emit({"eval_loss": loss, "goodput": utilization})


if __name__ == "__main__":
  app.run(main)

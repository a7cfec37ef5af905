r"""Minimum quorum and the adaptive grace window under mixed hardware (Decoupled DiLoCo paper, §5).

Eight learners on the virtual clock: four "v6e" that step 18 % faster than four "v5p", each
step time jittered by 10 % (log-normal, seeded), H = 20, equal tokens in every row:
- k_all: every learner in every merge, and each waits for it (synchronous DiLoCo: the fast
  ones idle while the slow ones finish), outer Nesterov SGD once per merge;
- k1: quorum 1, learners never wait, each merge takes whoever arrived (Delayed Nesterov, one
  momentum step per 8 merges); DyLU sizes every learner's H by its speed (24 and 20 steps),
  so all periods take about as long;
- k1_grace: k1 plus the adaptive grace window (γ = 0.8, τ = 4 steps): the syncer holds a
  merge open for late learners, and the learners in a window receive its merge (they have
  τ = 0 steps of overlap here, so they wait for it). With DyLU a window gathers all eight
  (about one merge per round), so the outer step is Nesterov on every merge (N = 1).
  Without DyLU (fixed H) a window gathered only the four fast or the four slow learners:
  2.6592 with N = 2, 2.8848 with N = 8 (docs/experiments.md).
Published (arXiv 2604.21428, §5; text score, higher is better): K = 8 54.4 at 84 % goodput,
K = 1 51.4 at 100 %, K = 1 + grace 55.3 at 100 %.
Target: k1_grace's eval loss <= 1.005 × k_all's at goodput >= 0.98; k1 visibly worse than both.

  python -m experiments.benchmarks.quorum_grace
"""

from experiments.benchmarks import common

common.use_virtual_devices(16)

from absl import app  # noqa: E402  pylint: disable=g-import-not-at-top

from experiments.benchmarks import shakespeare  # noqa: E402

LEARNERS, OUTER_STEPS = 8, 8
SPEED_GAP, JITTER = 1.18, 0.1
PUBLISHED = {"text_score": {"k_all": 54.4, "k1": 51.4, "k1_grace": 55.3},
             "goodput": {"k_all": 0.84, "k1": 1.0, "k1_grace": 1.0}}


def rows() -> dict:
  """Row name -> config; tiny size keeps the rows with 2 learners (one fast, one slow)."""
  learners = 2 if shakespeare.tiny() else LEARNERS
  mixed = {"learners.speed": (SPEED_GAP,) * (learners // 2) + (1.0,) * (learners // 2), "learners.jitter": JITTER}
  quorum_1 = {**mixed, "policy.kind": "dylu"}
  return {
      "k_all": shakespeare.config(learners, OUTER_STEPS, **mixed, mode="diloco",
                                  **{"outer.optimizer": "sgd", "outer.buffer_size": 1}),
      "k1": shakespeare.config(learners, OUTER_STEPS, **quorum_1),
      "k1_grace": shakespeare.config(learners, OUTER_STEPS, **quorum_1, **{
          "syncer.grace_gamma": 0.8, "syncer.grace_overlap_steps": 4.0, "outer.buffer_size": 1}),
  }


def main(argv) -> None:
  """Runs the three rows and prints the table and the JSON line."""
  del argv
  _, figures = shakespeare.compare(rows(), PUBLISHED["goodput"], counts=("merges",))
  loss = figures["eval_loss"]
  common.emit({**figures, "k1_grace_vs_k_all_loss": round(loss["k1_grace"] / loss["k_all"], 4),
               "k1_vs_k_all_loss": round(loss["k1"] / loss["k_all"], 4), "published": PUBLISHED})


if __name__ == "__main__":
  app.run(main)

"""What a call must satisfy before the syncer acts on it: a known learner, its current incarnation, sane arrays.

Pure checks on a call's header and decoded payload, no state of their own; `SyncerCore`
runs them (with the header bounds of `limits`) before anything of a push is logged. Each
raises an error the server turns into a counted, one-line refusal.
"""

import jax
import numpy as np

from decoupled_diloco import compression
from decoupled_diloco.push import PushRejected

PUSH_SCHEMA = {
    "learner": int, "seq": int, "base_version": int, "fragment": int, "tokens": int, "local_steps": int,
    "compute_seconds": float, "payload_bytes": int, "budget_steps": int, "budget_tokens": int, "incarnation": int}


class Fenced(PushRejected):
  """A push of a replaced learner process: a newer incarnation of its learner has joined since."""


class UnknownLearner(LookupError):
  """A call names a learner id outside the run's range."""


def require_known(learner: int, num_learners: int) -> None:
  """Raises UnknownLearner for an id outside the run (no state read beyond the run's size)."""
  if not 0 <= learner < num_learners:
    raise UnknownLearner(f"unknown learner {learner}: this run has learners 0..{num_learners - 1}")


def check_incarnation(header: dict, current: int) -> None:
  """Refuses a push of a replaced learner process: a newer incarnation of that learner has joined since.

  Why: a frozen process that wakes up after its replacement joined would otherwise push
  (and take seqs) as that learner.
  """
  learner = header["learner"]
  if header["incarnation"] != current:
    raise Fenced(f"push from learner {learner} rejected: it comes from incarnation {header['incarnation']}, "
                 f"but incarnation {current} of learner {learner} has joined since (a replaced process: stop it)")


def check_float32(delta, learner: int) -> None:
  """An uncompressed pseudo-gradient must arrive as float32, checked on the wire arrays.

  Why here: the syncer moves pushes onto its device first, and with 64-bit types off that
  move silently turns float64 into float32, so the syncer's own dtype check cannot see it.
  """
  if isinstance(delta, compression.Compressed):
    return  # Its payload arrays are checked against the format by compression.decode.
  for path, leaf in jax.tree_util.tree_leaves_with_path(delta):
    dtype = getattr(leaf, "dtype", type(leaf).__name__)
    if dtype != np.float32:
      raise PushRejected(f"push from learner {learner} rejected: {jax.tree_util.keystr(path)} arrived as {dtype}; "
                         "uncompressed pseudo-gradients travel as float32")


def budget_share(header: dict) -> tuple[int, int]:
  """(steps, tokens) a push adds to the run's count: its `budget_steps` / `budget_tokens`.

  Why not local_steps / tokens: those count from the receipt of Θ_p (the weight of the Δ),
  so the τ steps before a landing are in no push, and with P fragments each other step is in
  P pushes. A learner instead counts every step it took once, in the first push after it
  (of any fragment; its last pushes leave nothing uncounted).
  """
  return header["budget_steps"], header["budget_tokens"]

r"""Syncer merge throughput: M pushes of N params (weighting + outer step) vs a numpy copy of their bytes.

  python -m experiments.benchmarks.merge_throughput

One block hands M float32 pseudo-gradients of N parameters to `Syncer.receive` with quorum
M, as the syncer service does: each is a decoded wire payload (received into an aligned
buffer, read-only). Each push is put on the host device (zero-copy: XLA aliases the
aligned buffer), validated (shapes, dtypes, NaN/Inf) and folded into the running sums
(streaming accumulation); the last one triggers the merge (token × staleness weights,
weighted mean) and the outer step (Nesterov SGD). The baseline copies the same M·N·4 bytes
with numpy (`np.copyto` into preallocated buffers), interleaved with the syncer in the same
run. Last line: key `ratio` = numpy seconds / syncer seconds, i.e. the syncer's bytes/s as a fraction
of a memory copy's (target >= 0.5).
"""

import os

from absl import app
from absl import flags
import numpy as np

from experiments.benchmarks import common

_PARAMS = flags.DEFINE_integer("params", 4_000_000, "N: parameters per push.")
_PUSHES = flags.DEFINE_integer("pushes", 4, "M: pushes per merge (the quorum).")
_BLOCKS = flags.DEFINE_integer("blocks", 7, "Interleaved repetitions (median taken).")


def main(argv) -> None:
  """Times one M-push merge of the real syncer against copying the same bytes."""
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  from decoupled_diloco import outer  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.service import wire  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.push import Push  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.syncer import Settings, Syncer, map_large_blocks  # pylint: disable=g-import-not-at-top
  from ml_collections import ConfigDict  # pylint: disable=g-import-not-at-top

  map_large_blocks()  # As the syncer process does.

  m, leaves = _PUSHES.value, 8
  shape = (_PARAMS.value // leaves,)
  rng = np.random.default_rng(0)
  params = {f"block_{i}": {"w": rng.standard_normal(shape, dtype=np.float32)} for i in range(leaves)}
  deltas = []
  for _ in range(m):
    parts = wire.encode(jax.tree.map(lambda x: (rng.standard_normal(x.shape, dtype=np.float32) * 1e-3), params))
    size, chunk = wire.encoded_size(parts), 4 << 20
    deltas.append(wire.decode(wire.assemble(wire.chunks(parts, chunk), size, size, chunk)))
  optimizer = outer.outer_optimizer(ConfigDict({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}))
  syncer = Syncer(optimizer, params, range(m), Settings(quorum=m, token_weighting="tokens"))
  sources = [leaf for delta in deltas for leaf in jax.tree.leaves(delta)]
  targets = [np.empty_like(leaf) for leaf in sources]

  def merge():
    reports = [
        syncer.receive(Push(k, delta, syncer.version, 1024 * (k + 1), 16), now=0.0)[1] for k, delta in enumerate(deltas)
    ]
    assert reports[-1] is not None
    jax.block_until_ready(syncer.params)

  def copy():
    for source, target in zip(sources, targets):
      np.copyto(target, source)

  merge(), copy()  # Compile and warm up.
  medians = common.interleaved_medians({"syncer": merge, "numpy": copy}, _BLOCKS.value)
  size = sum(leaf.nbytes for leaf in sources)
  common.emit_keys(
      common.throughput_figures(
          {
              "benchmark": "merge_throughput", "pushes": m, "params": _PARAMS.value, "load_average": round(
                  os.getloadavg()[0], 1)}, size, medians, "syncer", "numpy"), ("ratio",))


if __name__ == "__main__":
  app.run(main)

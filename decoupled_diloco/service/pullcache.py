"""Θ on its way down to learners: in `compression.downlink_format`, each fragment encoded once per version.

Why a cache: with M learners pulling after every merge, encoding Θ_p once per version of
fragment p (not once per pull) keeps the syncer's lock short and its CPU free for merges.
It holds only the current version: `forget` drops a fragment's entry when it merges, so an
old Θ_p (which fp32 parts view without a copy) is freed at once, not at the next pull.
"""

import jax
import numpy as np

from decoupled_diloco.service import wire


class PullCache:
  """Encoded Θ for joins (whole) and pulls (one fragment); callers hold the core's lock."""

  def __init__(self, downlink_format: str = "fp32"):
    self.dtype = np.float32 if downlink_format == "fp32" else jax.numpy.bfloat16  # Θ on the wire.
    self._fragments: dict[int, tuple[int, list]] = {}  # fragment -> (its version, encoded Θ_p)

  def whole(self, params) -> list:
    """All of Θ encoded (a joining learner's start), not cached: joins are rare."""
    return wire.encode(self._downlink(params))

  def fragment(self, syncer, fragment: int, have_version: int) -> list | None:
    """Θ_fragment of `syncer` encoded once per version of that fragment, however many learners pull it.

    None when the puller already has that version; wire.WireError for a fragment the run does not have.
    """
    versions = syncer.versions
    if not 0 <= fragment < len(versions):
      raise wire.WireError(f"fragment {fragment} is not in [0, {len(versions)}): this run syncs {len(versions)} "
                           "fragments")
    version = versions[fragment]
    if have_version == version:
      return None
    cached_version, parts = self._fragments.get(fragment, (None, None))
    if cached_version != version:
      parts = wire.encode(self._downlink(syncer.fragment_params(fragment)))
      self._fragments[fragment] = (version, parts)
    return parts

  def forget(self, fragment: int) -> None:
    """Drops fragment `fragment`'s encoded Θ (it merged: that version is no longer current)."""
    self._fragments.pop(fragment, None)

  def _downlink(self, tree):
    """Θ as compression.downlink_format sends it (bf16 halves the bytes; learners widen it back to fp32)."""
    if self.dtype == np.float32:
      return tree
    return jax.tree.map(lambda x: np.asarray(x).astype(self.dtype), tree)

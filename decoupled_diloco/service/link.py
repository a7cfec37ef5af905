"""Wide-area links in real time: each learner's data-channel traffic paced at its sender.

Why: a wall-clock run on one machine moves its bytes over loopback at gigabytes per second,
so overlap, streaming and compression could not be measured for real. `service.link_mbps`
and `service.link_latency_ms` make every data-channel transfer of learner i take about
latency + bytes·8 / Mbps seconds, through a token bucket at the sender in user space (`tc`
would need privileges users may not have), shared by every transfer of one learner in one
direction (docs/exchange.md).
"""

import dataclasses
import math
import threading
import time

from decoupled_diloco.errors import ConfigError

SLICE_BYTES = 16 << 10  # Largest send between two waits: small against any link's second of bytes.
MAX_LATENCY_MS = 1000.0  # One way: a WAN's latency, not a stalled peer's.
BURST_SECONDS = 0.01  # What an idle link may send at once: 10 ms of its bytes (at least one slice).


class TokenBucket:
  """Bytes per second with a small burst; `take(n)` blocks until `n` bytes may go out."""

  def __init__(self, bytes_per_second: float):
    self.rate = bytes_per_second
    self.burst = max(SLICE_BYTES, bytes_per_second * BURST_SECONDS)
    self._tokens, self._last = self.burst, time.monotonic()  # Bytes it may send now (negative: owed).
    self._lock = threading.Lock()

  def take(self, nbytes: int) -> None:
    """Takes `nbytes` from the bucket and waits until what it owes is refilled at the rate."""
    with self._lock:
      now = time.monotonic()
      self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - nbytes
      self._last = now
      wait = -self._tokens / self.rate
    if wait > 0:
      time.sleep(wait)


@dataclasses.dataclass(frozen=True)
class Link:
  """One learner's link as its sender sees it: Mbps (0 = unshaped) and one-way latency."""
  mbps: float = 0.0
  latency_ms: float = 0.0
  bucket: TokenBucket | None = dataclasses.field(default=None, compare=False, repr=False)

  @classmethod
  def shaped(cls, mbps: float, latency_ms: float) -> "Link":
    """A link with its own bucket (0 Mbps: no pacing, only the latency)."""
    return cls(mbps, latency_ms, TokenBucket(mbps * 1e6 / 8) if mbps else None)

  def paced(self, parts: list[memoryview]):
    """The parts, sliced, each slice released when the link has room for it (after the latency, once)."""
    if self.latency_ms:
      time.sleep(self.latency_ms / 1e3)
    for part in parts:
      if self.bucket is None:
        yield part
        continue
      for start in range(0, part.nbytes, SLICE_BYTES):
        piece = part[start:start + SLICE_BYTES]
        self.bucket.take(piece.nbytes)
        yield piece

  def seconds(self, nbytes: int) -> float:
    """How long `nbytes` take on this link (0 when unshaped): what a transfer's deadline must allow."""
    return self.latency_ms / 1e3 + (nbytes * 8 / (self.mbps * 1e6) if self.mbps else 0.0)


UNSHAPED = Link()


def validate(service, num_learners: int) -> None:
  """Refuses link settings that cannot be honoured, in one line naming the fix."""
  for name in ("link_mbps", "link_latency_ms"):
    values = tuple(service[name])
    if values and len(values) != num_learners:
      raise ConfigError(f"service.{name} has {len(values)} values for {num_learners} learners: give one per "
                        f"learner, e.g. --config.service.{name}='{(1.0,) * num_learners}', or () for none")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values):
      raise ConfigError(f"service.{name}={values} must be finite numbers >= 0 (0 = that learner's link unshaped)")
  if max(service.link_latency_ms, default=0.0) > MAX_LATENCY_MS:
    raise ConfigError(f"service.link_latency_ms={tuple(service.link_latency_ms)} is over {MAX_LATENCY_MS:.0f} ms, "
                      "longer than any wide-area link's one-way latency: use a latency <= 1000 ms")
  if (any(service.link_mbps) or any(service.link_latency_ms)) and service.data_port < 0:
    raise ConfigError("service.link_mbps / link_latency_ms shape the data channel, which service.data_port=-1 "
                      "turns off: set --config.service.data_port=0 or drop the link settings")


def links(service, num_learners: int) -> list[Link]:
  """Each learner's link from the config (UNSHAPED for all when neither setting is given)."""
  mbps = tuple(service.link_mbps) or (0.0,) * num_learners
  latency = tuple(service.link_latency_ms) or (0.0,) * num_learners
  return [Link.shaped(float(b), float(l)) if b or l else UNSHAPED for b, l in zip(mbps, latency)]

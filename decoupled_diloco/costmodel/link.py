"""A wide-area link as a FIFO queue: latency plus bytes over bandwidth, one transfer at a time.

The virtual-clock runtime (runtime/sim.py) and the WAN cost model (costmodel/wan.py) both
price transfers with it, so a push costs the same in a simulated run and in the cost model.
"""

import dataclasses


@dataclasses.dataclass
class Link:
  """One direction of a learner's wide-area link: transfers queue first-in first-out."""
  gbps: float  # 0 = unlimited.
  latency: float  # One-way seconds added to every transfer.
  free_at: float = 0.0  # When the transfer queued last leaves the link.
  busy: float = 0.0  # Seconds spent sending.
  bytes: int = 0

  def seconds(self, nbytes: int) -> float:
    """Time one transfer of `nbytes` takes on an idle link (latency included)."""
    return self.latency + (nbytes / (self.gbps * 1e9 / 8) if self.gbps else 0.0)

  def send(self, now: float, nbytes: int) -> float:
    """Queues a transfer behind those already on the link; returns its arrival time."""
    start = max(now, self.free_at)
    sending = self.seconds(nbytes) - self.latency
    self.free_at, self.busy, self.bytes = start + sending, self.busy + sending, self.bytes + nbytes
    return start + self.seconds(nbytes)

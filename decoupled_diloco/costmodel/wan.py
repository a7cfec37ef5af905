"""Wide-area training time: data-parallel, DiLoCo and decoupled streaming DiLoCo, priced.

Why a cost model: whether a scheme can train across regions is decided by how long its
groups wait on the WAN, not by the math, so no training step runs here. M regions, each a
slice whose step time follows its hardware profile behind its own link, train a token
budget under 'ddp', 'diloco' or 'streaming'; the result is the time to train, the compute
utilization and the WAN bytes. The model of each scheme is in docs/costmodels.md.
"""

import dataclasses
import heapq
import math

from decoupled_diloco import compression
from decoupled_diloco import fragments
from decoupled_diloco.errors import ConfigError
from decoupled_diloco.hardware import CHIP_PEAK_FLOPS, RELATIVE, HardwareProfile
from decoupled_diloco.settings import is_int
from decoupled_diloco.costmodel.link import Link

SCHEMES = ("ddp", "diloco", "streaming")
FLOPS_PER_PARAM_TOKEN = 6  # Forward + backward of a dense decoder (Kaplan et al. 2020).


@dataclasses.dataclass(frozen=True)
class Region:
  """One learner group: its slice, its batch and its wide-area link."""
  hardware: HardwareProfile
  tokens_per_step: int
  gbps: float  # Per direction; math.inf = free transfers (latency still counts).
  latency_seconds: float = 0.0  # One way.

  def step_seconds(self, params: int) -> float:
    """One inner step of this group (the profile's mean: no jitter)."""
    return self.hardware.mean_step_seconds(FLOPS_PER_PARAM_TOKEN * params * self.tokens_per_step)


@dataclasses.dataclass(frozen=True)
class Setup:
  """What is trained where: model size, its layers, the token budget and the regions."""
  params: int
  layers: int
  token_budget: float
  regions: tuple[Region, ...]

  def with_gbps(self, gbps: float) -> "Setup":
    """The same setup with every region's link at `gbps` (what a bandwidth sweep varies)."""
    return dataclasses.replace(self, regions=tuple(dataclasses.replace(r, gbps=gbps) for r in self.regions))


@dataclasses.dataclass(frozen=True)
class Scheme:
  """How the groups synchronize (see the module docstring)."""
  kind: str  # One of SCHEMES.
  inner_steps: int = 1  # H: steps between two syncs of the same parameters.
  fragments: int = 1  # P ('streaming'): fragments synced at staggered offsets.
  overlap_steps: int = 0  # τ ('streaming'): steps a sync may take before the learner stalls.
  wire_format: str = "fp32"  # A `compression.FORMATS` entry: what each sync sends.


DDP = Scheme("ddp", wire_format="bf16")


def diloco(inner_steps: int) -> Scheme:
  """Synchronous DiLoCo: a blocking fp32 all-reduce of the whole model every H steps."""
  return Scheme("diloco", inner_steps=inner_steps, wire_format="fp32")


def streaming(inner_steps: int, num_fragments: int, overlap_steps: int, wire_format: str = "int4") -> Scheme:
  """Decoupled streaming DiLoCo: P staggered fragments, τ overlapped steps, 4-bit both ways."""
  return Scheme("streaming", inner_steps, num_fragments, overlap_steps, wire_format)


@dataclasses.dataclass(frozen=True)
class Result:
  """What a scheme costs on a setup."""
  seconds: float  # Wall time to process the token budget.
  utilization: float  # Compute seconds / wall seconds, averaged over chips.
  wan_bytes: float  # Every byte sent over the WAN, counted once.
  peak_bytes: float  # Largest burst one learner sends at one sync (what its link absorbs at once).
  steps: tuple[int, ...]  # Inner steps each region took.


def validate(setup: Setup, scheme: Scheme) -> None:
  """One ConfigError naming the fix for each impossible setup or scheme."""
  if not is_int(setup.params) or not is_int(setup.layers) or not 1 <= setup.layers <= setup.params:
    raise ConfigError(f"params={setup.params!r}, layers={setup.layers!r}: need ints with 1 <= layers <= params")
  if not setup.token_budget > 0 or not math.isfinite(setup.token_budget):
    raise ConfigError(f"token_budget={setup.token_budget!r} must be a finite number > 0: pass the tokens to train")
  if not setup.regions:
    raise ConfigError("no regions: pass at least one Region")
  if scheme.kind not in SCHEMES:
    raise ConfigError(f"scheme {scheme.kind!r} is unknown: use one of {SCHEMES}")
  if scheme.wire_format not in compression.FORMATS:
    raise ConfigError(f"wire_format={scheme.wire_format!r} is unknown: use one of {compression.FORMATS}")
  if not is_int(scheme.inner_steps) or scheme.inner_steps < 1:
    raise ConfigError(f"inner_steps={scheme.inner_steps!r} must be an int >= 1: pass H, e.g. 24")
  if scheme.kind == "ddp" and scheme.inner_steps != 1:
    raise ConfigError(f"ddp syncs every step, got inner_steps={scheme.inner_steps}: use scheme 'diloco' for H > 1")
  if scheme.kind != "streaming" and (scheme.fragments != 1 or scheme.overlap_steps != 0):
    raise ConfigError(f"{scheme.kind} blocks on whole-model syncs (fragments={scheme.fragments}, overlap_steps="
                      f"{scheme.overlap_steps}): use scheme 'streaming' for fragments and overlap")
  if not is_int(scheme.fragments) or not 1 <= scheme.fragments <= setup.layers:
    raise ConfigError(f"fragments={scheme.fragments!r} must be an int in [1, layers={setup.layers}]: "
                      "each fragment needs at least one layer")
  if not is_int(scheme.overlap_steps) or not 0 <= scheme.overlap_steps < scheme.inner_steps:
    raise ConfigError(f"overlap_steps={scheme.overlap_steps!r} must be an int in [0, inner_steps="
                      f"{scheme.inner_steps}): a fragment must land before its next sync")
  for m, region in enumerate(setup.regions):
    hw = region.hardware
    if hw.chip != RELATIVE and hw.chip not in CHIP_PEAK_FLOPS:
      raise ConfigError(f"region {m}: chip {hw.chip!r} is unknown: use one of {sorted(CHIP_PEAK_FLOPS)} or "
                        f"{RELATIVE!r}")
    if not is_int(hw.chips) or hw.chips < 1 or not 0 < hw.mfu <= 1 or not hw.speed > 0:
      raise ConfigError(f"region {m}: chips={hw.chips!r}, mfu={hw.mfu}, speed={hw.speed}: need chips >= 1, "
                        "0 < mfu <= 1, speed > 0")
    if not is_int(region.tokens_per_step) or region.tokens_per_step < 1:
      raise ConfigError(f"region {m}: tokens_per_step={region.tokens_per_step!r} must be an int >= 1")
    if not region.gbps > 0:
      raise ConfigError(f"region {m}: gbps={region.gbps!r} must be > 0: give the link's bandwidth in Gbit/s "
                        "(math.inf for free transfers)")
    if not 0 <= region.latency_seconds < math.inf:
      raise ConfigError(f"region {m}: latency_seconds={region.latency_seconds!r} must be finite and >= 0")


def layer_shapes(setup: Setup) -> tuple[tuple[int, ...], ...]:
  """The model as L flat layers of params / L values (the remainder goes to the last)."""
  size, rest = divmod(setup.params, setup.layers)
  return tuple((size + (rest if i == setup.layers - 1 else 0),) for i in range(setup.layers))


def fragment_wire_bytes(setup: Setup, scheme: Scheme) -> tuple[int, ...]:
  """Bytes one sync of each fragment sends in the scheme's format (strided: layer i → i mod P)."""
  codec = compression.Codec(format=scheme.wire_format)
  shapes = layer_shapes(setup)
  return tuple(compression.wire_bytes(codec, shapes[p::scheme.fragments]) for p in range(scheme.fragments))


def _synchronous(setup: Setup, scheme: Scheme) -> Result:
  """ddp and DiLoCo: rounds of H steps paced by the slowest group, then a blocking ring all-reduce.

  Closed form: every round is identical, so wall = rounds × (H · max step + all-reduce).
  """
  regions, count = setup.regions, len(setup.regions)
  (payload,) = fragment_wire_bytes(setup, scheme)
  h = scheme.inner_steps
  steps = [r.step_seconds(setup.params) for r in regions]
  slowest_link = min(r.gbps for r in regions)
  phase = payload / count * 8 / (slowest_link * 1e9) + max(r.latency_seconds for r in regions)
  all_reduce = 2 * (count - 1) * phase
  period = h * max(steps) + all_reduce
  rounds = math.ceil(setup.token_budget / (h * sum(r.tokens_per_step for r in regions)))
  chips = [r.hardware.chips for r in regions]
  utilization = sum(c * h * s for c, s in zip(chips, steps)) / (sum(chips) * period)
  ring_share = 2 * (count - 1) / count * payload  # What each group sends per all-reduce.
  return Result(seconds=rounds * period, utilization=utilization, wan_bytes=rounds * count * ring_share,
                peak_bytes=ring_share, steps=(rounds * h,) * count)


@dataclasses.dataclass
class _Learner:
  """One streaming learner's clock: its links, steps taken and the fragments it waits for."""
  step: float
  tokens: int
  up: Link
  down: Link
  free: float = 0.0  # When it may start its next step (after any stall).
  steps: int = 0
  needed: dict = dataclasses.field(default_factory=dict)  # step k -> latest arrival it must wait for.


def _streaming(setup: Setup, scheme: Scheme) -> Result:
  """Decoupled streaming DiLoCo: each learner on its own clock, FIFO links, stalls only when late.

  A discrete-event merge over learners (the next step to end goes first) adds up tokens
  until the budget is met; that step's end is the wall time.
  """
  payloads = fragment_wire_bytes(setup, scheme)
  h, tau = scheme.inner_steps, scheme.overlap_steps
  syncs = [fragments.due(k, scheme.fragments, h) for k in range(1, h + 1)]  # Fragments after step k of a period.
  learners = [
      _Learner(r.step_seconds(setup.params), r.tokens_per_step, Link(r.gbps, r.latency_seconds),
               Link(r.gbps, r.latency_seconds)) for r in setup.regions]
  queue = [(l.step, m) for m, l in enumerate(learners)]
  heapq.heapify(queue)
  tokens = 0
  while True:
    end, m = heapq.heappop(queue)
    learner = learners[m]
    learner.steps += 1
    tokens += learner.tokens
    if tokens >= setup.token_budget:
      break
    k = learner.steps
    for p in syncs[(k - 1) % h]:
      at_syncer = learner.up.send(end, payloads[p])
      back = learner.down.send(at_syncer, payloads[p])
      learner.needed[k + tau] = max(learner.needed.get(k + tau, 0.0), back)
    learner.free = max(end, learner.needed.pop(k, end))  # A stall if a fragment it needs is late.
    heapq.heappush(queue, (learner.free + learner.step, m))
  wall = end
  compute = []
  for n, learner in enumerate(learners):  # The others are mid-step (or stalled) at the wall time.
    compute.append(learner.steps * learner.step + (0.0 if n == m else max(0.0, wall - learner.free)))
  chips = [r.hardware.chips for r in setup.regions]
  return Result(seconds=wall, utilization=sum(c * x for c, x in zip(chips, compute)) / (sum(chips) * wall),
                wan_bytes=sum(l.up.bytes + l.down.bytes for l in learners), peak_bytes=max(payloads),
                steps=tuple(l.steps for l in learners))


def simulate(setup: Setup, scheme: Scheme) -> Result:
  """Time to train the budget, utilization and WAN bytes of `scheme` on `setup` (deterministic)."""
  validate(setup, scheme)
  return _streaming(setup, scheme) if scheme.kind == "streaming" else _synchronous(setup, scheme)


def bandwidth_for_utilization(setup: Setup, scheme: Scheme, target: float, low: float = 1e-3, high: float = 1e5,
                              rel_tol: float = 1e-3) -> float:
  """Smallest per-link Gbit/s (all regions alike) at which `scheme` reaches `target` utilization.

  Bisection on log(bandwidth): faster links never lengthen the run (every transfer ends
  no later, so no step starts later), and utilization rises with them (exactly so for
  groups of one speed; unequal groups can shift a few tokens between them). Returns
  `low` if even that is enough and math.inf if `high` is not (latency or slow groups
  can cap utilization).
  """
  if not 0 < target <= 1:
    raise ConfigError(f"target utilization {target!r} must be in (0, 1]: pass e.g. 0.95")
  if not 0 < low < high or not rel_tol > 0:
    raise ConfigError(f"need 0 < low={low} < high={high} and rel_tol={rel_tol} > 0")
  reaches = lambda gbps: simulate(setup.with_gbps(gbps), scheme).utilization >= target
  if not reaches(high):
    return math.inf
  if reaches(low):
    return low
  while high > low * (1 + rel_tol):
    middle = math.sqrt(low * high)
    low, high = (low, middle) if reaches(middle) else (middle, high)
  return high

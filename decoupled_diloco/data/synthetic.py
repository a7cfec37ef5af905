"""The embedded default corpus: a seeded random order-k Markov chain with a KNOWN optimal loss.

Why: a training run needs data that exists offline and a yardstick. Text from a random
order-k chain over printable characters is generated in well under a second, and its
information content is computable exactly, so a run can report how far its eval loss is
from the best any model could do (`optimal_loss`), not just that the loss went down. The
corpus is many independent stationary chains aligned to the batcher's windows, so the
optimum of a window is exact (the chain and the alignment: docs/data.md).
"""

import math
import string

import numpy as np

from decoupled_diloco.errors import ConfigError

# Printable symbols in the order the alphabet grows: 'a'..'z', space, 'A'..'Z', digits, punctuation.
ALPHABET = (string.ascii_lowercase + " " + string.ascii_uppercase + string.digits + string.punctuation)
# Windows per generated chain: each chain is a few windows long, as required of a "segment".
WINDOWS_PER_CHAIN = 4
# Largest transition table (states x symbols) we build; bounds memory (float64) and mixing time.
_MAX_TABLE = 1 << 22
_TOLERANCE = 1e-13


def aligned_chain_length(seq_len: int, windows_per_chain: int = WINDOWS_PER_CHAIN) -> int:
  """Chain length that keeps windows of `seq_len + 1` inside one chain (see module docstring)."""
  return windows_per_chain * (seq_len + 1)


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
  """Shannon entropy in nats with 0 log 0 = 0, since Dirichlet draws may underflow to zero."""
  with np.errstate(divide="ignore", invalid="ignore"):
    terms = np.where(p > 0, -p * np.log(p), 0.0)
  return terms.sum(axis=axis)


class MarkovLanguage:
  """An order-k Markov chain over `alphabet`, with its exact stationary entropies."""

  def __init__(self, transitions: np.ndarray, alphabet: str | None = None):
    """Wraps a row-stochastic table `transitions[state, next_symbol]` of shape (A**k, A).

    Computing the stationary distribution here (once) is what makes `entropy_rate`,
    `optimal_loss` and stationary-start sampling exact and cheap afterwards.
    """
    transitions = np.asarray(transitions, dtype=np.float64)
    num_states, size = transitions.shape
    order = round(math.log(num_states, size)) if size > 1 else 0
    if size < 2 or size**order != num_states:
      raise ValueError(f"transitions must have shape (A**k, A) with A >= 2, got {transitions.shape}")
    if np.any(transitions < 0) or not np.allclose(transitions.sum(1), 1.0, atol=1e-9):
      raise ValueError("every row of transitions must be a probability distribution")
    alphabet = ALPHABET[:size] if alphabet is None else alphabet
    if len(alphabet) != size or len(set(alphabet)) != size or max(map(ord, alphabet)) > 127:
      raise ValueError(f"alphabet must be {size} distinct ASCII characters, got {alphabet!r}")
    self.transitions = transitions
    self.alphabet = alphabet
    self.order = order
    self.stationary = self._stationary_distribution()
    self.entropy_rate = float(self.stationary @ _entropy(transitions))
    # H(X_0..X_{n-1}) for n = 0..k from the stationary k-gram marginals.
    self._block_entropy = [float(_entropy(self.stationary.reshape(size**n, -1).sum(1))) for n in range(order + 1)]

  @classmethod
  def random(cls, alphabet_size: int, order: int, concentration: float, seed: int) -> "MarkovLanguage":
    """Draws each state's next-symbol row from Dirichlet(concentration); same seed, same language.

    Small concentration gives peaked, low-entropy rows (easy to learn); large gives near-uniform.
    """
    if not 2 <= alphabet_size <= len(ALPHABET):
      raise ConfigError(f"data.synthetic.alphabet_size={alphabet_size} is out of range: use 2..{len(ALPHABET)}")
    if order < 0:
      raise ConfigError(f"data.synthetic.order={order} is negative: use an order >= 0")
    if alphabet_size**(order + 1) > _MAX_TABLE:
      raise ConfigError(f"data.synthetic alphabet_size**(order+1) = {alphabet_size ** (order + 1)} exceeds "
                        f"{_MAX_TABLE}: lower data.synthetic.order or alphabet_size")
    if not concentration > 0:
      raise ConfigError(f"data.synthetic.concentration={concentration} must be > 0: use e.g. 0.5")
    rng = np.random.default_rng(seed)
    alpha = np.full(alphabet_size, float(concentration))
    return cls(rng.dirichlet(alpha, size=alphabet_size**order))

  @property
  def alphabet_size(self) -> int:
    """Distinct symbols the language emits."""
    return len(self.alphabet)

  def _next_states(self) -> np.ndarray:
    """next_state[s, a]: drop the oldest symbol of k-gram s and append a."""
    num_states, size = self.transitions.shape
    return (np.arange(num_states)[:, None] * size + np.arange(size)[None, :]) % num_states

  def _stationary_distribution(self) -> np.ndarray:
    """Stationary k-gram distribution by power iteration on the lazy chain (I + T) / 2.

    The lazy chain has the same stationary distributions but is aperiodic, so the iteration
    converges even for rows with exact zeros; sparse updates (bincount) keep it O(S * A).
    """
    num_states, size = self.transitions.shape
    next_states = self._next_states().ravel()
    pi = np.full(num_states, 1.0 / num_states)
    max_iters = max(2000, (1 << 31) // (num_states * size))
    for _ in range(max_iters):
      flow = np.bincount(next_states, weights=(pi[:, None] * self.transitions).ravel(), minlength=num_states)
      new = 0.5 * (pi + flow)
      new /= new.sum()
      if np.abs(new - pi).sum() < _TOLERANCE:
        return new
      pi = new
    raise ConfigError(f"the synthetic Markov chain did not mix within {max_iters} power iterations: "
                      "raise data.synthetic.concentration or lower data.synthetic.order")

  def conditional_entropy(self, context_len: int) -> float:
    """H(X_n | X_0..X_{n-1}) for n = context_len under the stationary process, in nats.

    Equals the entropy rate once the context covers the chain's order; below that it is the
    (larger) block-entropy difference H_{n+1} - H_n, which is what a model pays at the start
    of a window because it cannot see the text before the window.
    """
    if context_len >= self.order:
      return self.entropy_rate
    return self._block_entropy[context_len + 1] - self._block_entropy[context_len]

  def optimal_loss(self, seq_len: int) -> float:
    """Best achievable mean cross-entropy (nats/token) on a stationary window of seq_len + 1.

    Inputs are x[0:T] and targets x[1:T+1], so target t (1..T) has a context of t symbols.
    """
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return float(np.mean([self.conditional_entropy(t) for t in range(1, seq_len + 1)]))

  def sample(self, num_tokens: int, rng: np.random.Generator, chain_length: int) -> np.ndarray:
    """`num_tokens` bytes: independent stationary chains of `chain_length`, concatenated.

    All chains advance together (one vectorised step per position), so generation costs
    chain_length numpy steps regardless of num_tokens. The output is a pure function of the
    generator state and the arguments; the last chain is truncated to hit num_tokens exactly.
    """
    num_states, size = self.transitions.shape
    if chain_length <= self.order:
      raise ValueError(f"chain_length={chain_length} must exceed the order {self.order}")
    num_chains = -(-num_tokens // chain_length)
    cdf = np.cumsum(self.transitions, axis=1)
    cdf[:, -1] = 1.0
    start_cdf = np.cumsum(self.stationary)
    states = np.searchsorted(start_cdf, rng.random(num_chains) * start_cdf[-1], side="right")
    states = np.minimum(states, num_states - 1)
    symbols = np.empty((num_chains, chain_length), dtype=np.uint8)
    for j in range(self.order):  # The start state's k symbols, oldest first.
      symbols[:, j] = (states // size**(self.order - 1 - j)) % size
    for t in range(self.order, chain_length):
      # Inverse-CDF sampling: the symbol is the number of cumulative probabilities <= u.
      nxt = (rng.random(num_chains)[:, None] >= cdf[states]).sum(axis=1)
      symbols[:, t] = nxt
      states = (states * size + nxt) % num_states
    to_byte = np.frombuffer(self.alphabet.encode("ascii"), dtype=np.uint8)
    return to_byte[symbols.ravel()[:num_tokens]]

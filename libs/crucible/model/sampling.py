"""Drawing one token from a distribution over the vocabulary, fast on a CPU.

`torch.multinomial` over a 49k vocabulary takes about a millisecond per draw on one core here, more than
the grammar mask and the log-softmax together, and an episode draws one per sampled token on the
engine's thread. Inverse transform sampling draws the same distribution with one cumulative sum, one
uniform number and a binary search (about a tenth of the time). A token of probability 0 (masked by a
constraint) is never drawn: its cumulative sum does not rise, so no uniform number lands on it.
"""

from __future__ import annotations

import torch


def sample(logp: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from the distribution whose log-probabilities are `logp` [V] (fp32, -inf where
    masked; normalised or not)."""
    probs = torch.exp(logp)
    cdf = torch.cumsum(probs, dim=0)
    u = torch.rand((), generator=generator, dtype=cdf.dtype) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True))
    if token >= len(probs) or probs[token] <= 0:  # u rounded onto the total: draw exactly instead
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token

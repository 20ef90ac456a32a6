"""Token sampling in numpy: greedy, temperature, top-k, top-p, per-request seed.

Invariants:
- Greedy (``temperature == 0`` or ``top_k == 1``) is ``argmax`` of the logits: deterministic and
  equal to the torch reference's choice for the same logits.
- The top-p nucleus is the smallest prefix of the tokens sorted by probability whose mass
  reaches ``top_p`` (the token that crosses ``top_p`` is kept), as in the torch reference.
- With a seed, a request's token sequence depends only on its logits and the seed; the
  generator is seeded with the seed's 64-bit pattern (``seed mod 2**64``, as torch does on the
  cloud tier; see ``routing.sampling_limits``), so a negative seed is as good as any.
- Before ``min_tokens`` tokens were generated, the request's stop token ids are never sampled
  (their logits are taken as -inf, as vLLM does), so no stop token ends it early. A sampler
  counts its calls as the tokens generated: it is called once per generated token, in order,
  except for rows the loop takes the argmax of itself, which it does only while ``greedy``
  holds (and ``greedy`` is False while stop tokens are banned).
- A ``Sampler`` is made when its request is submitted (``edge_runtime.scheduler.SlotRequest``),
  on the submitting thread: parameters it could not sample with raise ``InvalidSampling``
  (an ``EngineError``) there, for that request alone, never later in the generation loop,
  where one row's error would abort every running request.
- With a grammar (``SamplingParams.grammar``), its state is made with the sampler and each
  call samples from the logits with the grammar's disallowed tokens at -inf, then advances the
  state with the chosen token; ``greedy`` is then False, so the loop never takes the argmax of
  an unmasked row itself.
"""

from __future__ import annotations

import numpy as np

from routing.engine import SamplingParams
from routing.sampling_limits import check_sampling, seed_u64

_FIRST_NUCLEUS = 256  # candidates examined first; widened until they hold top_p of the mass


class Sampler:
    """One request's token choice from its logits rows, one call per generated token."""

    def __init__(self, params: SamplingParams) -> None:
        check_sampling(params)  # raises InvalidSampling: this request fails alone, at once
        self.params = params
        self.rng = np.random.default_rng(None if params.seed is None else seed_u64(params.seed))
        self.generated = 0  # calls so far: the tokens generated before the next one
        self.grammar = params.grammar.start() if params.grammar is not None else None

    @property
    def greedy(self) -> bool:
        """True while a token is plain argmax(logits), whoever computes it."""
        return (
            self.params.greedy
            and self.grammar is None
            and not self.params.banned_stops(self.generated)
        )

    def __call__(self, logits: np.ndarray) -> int:
        """One token id from a ``[vocab]`` logits row (advancing the grammar, if any)."""
        if self.grammar is None:
            return self._choose(logits)
        token = self._choose(self.grammar.apply(logits))
        self.grammar.advance(token)
        return token

    def _choose(self, logits: np.ndarray) -> int:
        banned = self.params.banned_stops(self.generated)
        self.generated += 1
        if banned:
            logits = logits.copy()
            logits[[t for t in banned if 0 <= t < logits.size]] = -np.inf
        if self.params.greedy:
            return int(np.argmax(logits))
        p = self.params
        x = logits.astype(np.float64) / max(p.temperature, 1e-5)
        ids: np.ndarray | None = None
        if 0 < p.top_k < x.size:
            ids = np.argpartition(x, x.size - p.top_k)[x.size - p.top_k :]
            x = x[ids]
        if p.top_p < 1.0:
            keep, probs = _nucleus(x, p.top_p)
            choice = int(keep[self.rng.choice(keep.size, p=probs / probs.sum())])
        else:
            probs = np.exp(x - x.max())
            choice = int(self.rng.choice(x.size, p=probs / probs.sum()))
        return int(ids[choice]) if ids is not None else choice


def _nucleus(x: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Indices into ``x`` of the top-p nucleus (most probable first) and their probabilities.

    Only the top candidates are sorted: first 256, widened while they hold less than top_p.
    """
    n = x.size
    m = x.max()
    z = np.exp(x - m).sum()
    k = min(n, _FIRST_NUCLEUS)
    while True:
        part = np.argpartition(x, n - k)[n - k :] if k < n else np.arange(n)
        order = np.argsort(-x[part], kind="stable")
        part = part[order]
        probs = np.exp(x[part] - m) / z
        cum = np.cumsum(probs)
        if cum[-1] >= top_p or k == n:
            count = min(int(np.searchsorted(cum, top_p, side="left")) + 1, k)
            return part[:count], probs[:count]
        k = min(n, k * 8)

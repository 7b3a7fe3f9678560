"""Token sampling over a row of logits (csrc/engine/sampler.c).

    sp = qwencuda.Sampler(n_vocab, temperature=0.7, top_p=0.9, seed=1)
    token = sp.sample(logits_row); sp.accept(token)
    token = qwencuda.sample(logits_row, temperature=0.0)     # greedy: the first argmax

The chain follows llama.cpp: repetition penalty (on the last repeat_last_n accepted tokens:
positive logits divided by the penalty, negative ones multiplied, once per distinct token) ->
top-k -> top-p (the smallest set of the best tokens whose temperature-1 softmax mass reaches
top_p) -> min-p (tokens with probability >= min_p times the best one's) -> temperature -> one
draw with the sampler's own seeded RNG. temperature 0 is greedy (after the penalty); top_k=1 is
greedy too. The same seed and the same logits give the same tokens on every machine.

Arguments (checked once, in the C core, for Sampler, sample() and generate() alike):
temperature >= 0 and finite; top_k an int >= 0 (0: off); top_p in [0, 1] (1: off); min_p in
[0, 1]; repeat_penalty > 0 and finite (1: off); repeat_last_n an int >= 0 (the history grows
with the tokens accepted, so a large value costs nothing up front); seed an int in
[-2**63, 2**64) (negative ones wrap modulo 2**64).

Non-finite logits: NaN never wins (it counts as -inf); if some logits are +inf, the first of them
is chosen; if every logit is NaN or -inf, sample() raises ValueError.
"""
import numpy as np

from . import _core

__all__ = ["Sampler", "sample"]


class Sampler:
    """A sampler for rows of n_vocab logits, with its own RNG and repetition history."""

    def __init__(self, n_vocab, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                 repeat_penalty=1.0, repeat_last_n=64, seed=0):
        # passed as given: the C core checks each argument (type and range) in one place,
        # so 1.5 for top_k is a TypeError rather than 1
        self._s = _core.Sampler(n_vocab, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, repeat_penalty=repeat_penalty,
                                repeat_last_n=repeat_last_n, seed=seed)

    def sample(self, logits) -> int:
        """Pick a token from one row of n_vocab logits (the row is not modified)."""
        return self._s.sample(logits)

    def accept(self, token):
        """Record a token as generated (or as part of the prompt) for the repetition penalty."""
        self._s.accept(token)

    @property
    def n_vocab(self) -> int:
        return self._s.n_vocab

    @property
    def params(self) -> dict:
        s = self._s
        return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                    repeat_penalty=s.repeat_penalty, repeat_last_n=s.repeat_last_n, seed=s.seed)

    def __repr__(self):
        args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in self.params.items())
        return f"Sampler(n_vocab={self.n_vocab}, {args})"


def sample(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
           repeat_last_n=64, seed=0) -> int:
    """One draw from a 1-D row of logits with a fresh Sampler (no repetition history)."""
    row = np.asarray(logits, dtype=np.float32)
    if row.ndim == 2 and row.shape[0] == 1:
        row = row[0]
    return _core.sample(row, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)

"""The logit lens, lm_head projections and argmax choices: what each layer would say.

    lens = qwencuda.logit_lens("model.gguf", trace, k=5, tokenizer=tok)
    print(lens)              # per layer and position, the top token; where the answer forms
    lens.formed_at           # first layer whose top-1 is the final answer, per position
    qwencuda.lens.project("model.gguf", hidden)        # logits of any hidden vector(s)
    print(qwencuda.lens.argmax_report(trace))           # argmax, runner-up, and the gap

Pushing every layer's residual stream through the final norm and the lm_head shows where the
right answer forms: in a healthy model it appears in the last third of the layers and firms up;
in a broken engine it never does, or one token (the seeds' "coholic") wins at every layer and
position. The argmax report gives, per row, the winner, the runner-up and the gap between them:
a gap of 0.01 is a near-tie that fp16 rounding may flip, a gap of 10 from a token nobody expects
is a bug (the seeds' logits of 14 among real ones of -4..4).

Weights come from the GGUF through qwencuda.reference (float32, the gguf package), so none of
this needs the C engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["logit_lens", "LensResult", "project", "choices", "argmax_report", "Choices"]


# --------------------------------------------------------------------------------------------
# Weights

def _ref(model):
    """A reference.RefModel from a path, a RefModel, a GGUFFile or a qwencuda.Model (.path)."""
    from .. import reference

    if isinstance(model, reference.RefModel):
        return model
    cached = getattr(reference, "_model", None) or reference.load
    return cached(getattr(model, "path", model))


def _rmsnorm(x, w, eps):
    x64 = np.asarray(x, np.float64)
    ms = (x64 * x64).mean(-1, keepdims=True)
    return (x64 / np.sqrt(ms + eps) * np.asarray(w, np.float64)).astype(np.float32)


def project(model, hidden, norm=False):
    """The lm_head projection of hidden vector(s) (..., dim) -> logits (..., n_vocab) float32.

    norm=False takes hidden as already normalised (e.g. a capture of output_norm); norm=True
    applies the model's final RMSNorm first (e.g. for a layer's resid_out)."""
    ref = _ref(model)
    h = np.asarray(hidden, np.float32)
    if h.shape[-1] != ref.config.dim:
        raise ValueError(f"hidden has {h.shape[-1]} features, the model's dim is {ref.config.dim}")
    if norm:
        h = _rmsnorm(h, ref.weights["output_norm.weight"], ref.config.norm_eps)
    flat = h.reshape(-1, h.shape[-1])
    return (flat @ ref.lm_head.T).astype(np.float32).reshape(h.shape[:-1] + (ref.lm_head.shape[0],))


# --------------------------------------------------------------------------------------------
# Token text

def _token_text(tokenizer, tid):
    """Short printable text of one token id (repr-escaped), or the id when there is no tokenizer."""
    if tokenizer is None:
        return str(int(tid))
    try:
        if hasattr(tokenizer, "decode"):
            s = tokenizer.decode([int(tid)])
        else:
            s = tokenizer.token(int(tid))
    except Exception:
        return str(int(tid))
    return repr(s)[1:-1] if s else f"<{int(tid)}>"


# --------------------------------------------------------------------------------------------
# Argmax choices

@dataclass
class Choices:
    """Per logits row: the argmax, its logit, the runner-up and the gap between them.

    token, logit, runner_up, runner_up_logit, gap: arrays (rows,). positions: the context
    positions of the rows (or None). stored_argmax: the engine's own argmax buffer when known;
    disagree: rows where it is not the logits' argmax (an argmax/sampling bug)."""
    token: np.ndarray
    logit: np.ndarray
    runner_up: np.ndarray
    runner_up_logit: np.ndarray
    gap: np.ndarray
    positions: np.ndarray | None = None
    stored_argmax: np.ndarray | None = None
    tokenizer: object = None
    near_tie: float = 0.05

    @property
    def disagree(self):
        if self.stored_argmax is None:
            return np.zeros(len(self.token), bool)
        return np.asarray(self.stored_argmax).reshape(-1) != self.token

    def __len__(self):
        return len(self.token)

    def __str__(self):
        return self.table()

    def table(self, max_rows=None):
        """The rows as text; max_rows keeps the last ones."""
        tk = lambda t: _token_text(self.tokenizer, t)       # noqa: E731
        lines = [f"{'row':>4} {'pos':>5}  {'argmax':<22} {'logit':>9}  {'runner-up':<22} {'logit':>9} "
                 f"{'gap':>8}  note"]
        first = 0 if max_rows is None else max(0, len(self.token) - int(max_rows))
        for i in range(first, len(self.token)):
            pos = "" if self.positions is None else str(int(self.positions[i]))
            note = []
            if self.gap[i] < self.near_tie:
                note.append("near-tie")
            if self.disagree[i]:
                note.append(f"engine's argmax says {tk(self.stored_argmax[i])}: not the logits' maximum")
            a, b = (f"{int(t)} {tk(t)}" if self.tokenizer else tk(t)
                    for t in (self.token[i], self.runner_up[i]))
            lines.append(f"{i:>4} {pos:>5}  {a[:22]:<22} {self.logit[i]:9.4f}  {b[:22]:<22} "
                         f"{self.runner_up_logit[i]:9.4f} {self.gap[i]:8.4f}  {', '.join(note)}")
        return "\n".join(lines)


def choices(logits_rows, tokenizer=None, near_tie=0.05) -> Choices:
    """The argmax of each logits row with its runner-up and the gap (rows, n_vocab) or (n_vocab,).
    NaN never wins: it is treated as -inf."""
    lg = np.asarray(logits_rows, np.float32)
    if lg.ndim == 1:
        lg = lg[None]
    if lg.ndim != 2 or lg.shape[1] < 2:
        raise ValueError(f"logits rows must be (rows, n_vocab) with n_vocab >= 2, got {lg.shape}")
    clean = np.where(np.isnan(lg), -np.inf, lg)
    top2 = np.argpartition(-clean, 1, axis=1)[:, :2]
    v = np.take_along_axis(clean, top2, 1)
    first = np.argmax(clean, axis=1)                     # the first maximum, like every argmax
    second = np.where(top2[:, 0] == first, top2[:, 1], top2[:, 0])
    lf = clean[np.arange(len(lg)), first]
    ls = clean[np.arange(len(lg)), second]
    del v
    return Choices(token=first.astype(np.int64), logit=lf, runner_up=second.astype(np.int64),
                   runner_up_logit=ls, gap=(lf - ls).astype(np.float32), tokenizer=tokenizer,
                   near_tie=near_tie)


def argmax_report(trace, tokenizer=None, near_tie=0.05) -> Choices:
    """choices() of a Trace's logits, with its positions and the engine's own argmax buffer
    (rows where the two disagree are flagged)."""
    logits = getattr(trace, "logits", None)
    if logits is None:
        logits = trace["logits"]
    ch = choices(logits, tokenizer=tokenizer, near_tie=near_tie)
    pos = getattr(trace, "logit_positions", None)
    ch.positions = None if pos is None else np.asarray(pos).reshape(-1)
    stored = getattr(trace, "argmax", None)
    if stored is None and hasattr(trace, "get"):
        stored = trace.get("argmax")
    if stored is not None and np.asarray(stored).reshape(-1).shape == ch.token.shape:
        ch.stored_argmax = np.asarray(stored).reshape(-1)
    return ch


# --------------------------------------------------------------------------------------------
# Logit lens

@dataclass
class LensResult:
    """The lens of one trace. Arrays are indexed [layer, position(, rank)].

    layers       names of the residual streams read ("embed", "blk.0.resid_out", ...)
    positions    (n,) the positions of the tokens
    top_ids      (n_layers, n, k) the k best tokens at each layer and position
    top_logits   (n_layers, n, k)
    top_probs    (n_layers, n, k) softmax probabilities
    target       (n,) the token followed per position (default: the trace's final argmax)
    target_rank  (n_layers, n) its rank (0 = top-1) at each layer
    target_prob  (n_layers, n)
    formed_at    (n,) index into layers of the first layer from which target stays top-1, -1 never
    """
    layers: list
    positions: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray
    top_probs: np.ndarray
    target: np.ndarray
    target_rank: np.ndarray
    target_prob: np.ndarray
    formed_at: np.ndarray
    tokenizer: object = None

    def tokens(self, layer=None):
        """Decoded top tokens: [layer][position][rank] strings (one layer when given)."""
        idx = range(len(self.layers)) if layer is None else [self._layer_index(layer)]
        out = [[[_token_text(self.tokenizer, t) for t in pos] for pos in self.top_ids[i]] for i in idx]
        return out if layer is None else out[0]

    def _layer_index(self, layer):
        return self.layers.index(layer) if isinstance(layer, str) else int(layer)

    def table(self, max_positions=8):
        """Top-1 token and its probability per layer (rows) and position (columns, the last
        max_positions); a * marks the target."""
        n = len(self.positions)
        cols = list(range(max(0, n - max_positions), n))
        width = max(len(s) for s in self.layers)
        cell = 16
        head = f"{'layer':<{width}}  " + " ".join(f"{'pos ' + str(int(self.positions[c])):<{cell}}"
                                                   for c in cols)
        lines = [head, "-" * len(head)]
        for i, name in enumerate(self.layers):
            cells = []
            for c in cols:
                t = self.top_ids[i, c, 0]
                mark = "*" if t == self.target[c] else " "
                text = f"{mark}{_token_text(self.tokenizer, t)[:9]} {self.top_probs[i, c, 0]:.2f}"
                cells.append(text[:cell].ljust(cell))
            lines.append(f"{name:<{width}}  " + " ".join(cells))
        formed = " ".join(f"{(self.layers[f] if f >= 0 else 'never'):<{cell}}"[:cell]
                          for f in self.formed_at[cols])
        lines.append(f"{'formed at':<{width}}  " + formed)
        return "\n".join(lines)

    def __str__(self):
        return self.table()


def _top_k(lg, k):
    """Indices of the k largest logits per row, best first (ties: the lower id first)."""
    if k < lg.shape[1]:
        part = np.argpartition(-lg, k - 1, axis=1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(lg.shape[1]), lg.shape)
    vals = np.take_along_axis(lg, part, 1)
    order = np.lexsort((part, -vals), axis=1)
    return np.take_along_axis(part, order, 1)


def _residual_names(tensors, include_mid):
    names = [n for n in ("embed",) if n in tensors]
    layer = 0
    while f"blk.{layer}.resid_out" in tensors or f"blk.{layer}.resid_mid" in tensors:
        if include_mid and f"blk.{layer}.resid_mid" in tensors:
            names.append(f"blk.{layer}.resid_mid")
        if f"blk.{layer}.resid_out" in tensors:
            names.append(f"blk.{layer}.resid_out")
        layer += 1
    return names


def logit_lens(model_or_ref, trace, k=5, tokenizer=None, target=None, include_mid=False) -> LensResult:
    """Each layer's residual stream (embed, blk.L.resid_out; resid_mid too with include_mid)
    through the final RMSNorm and the lm_head, with the top-k tokens per position.

    model_or_ref: the GGUF path, a reference.RefModel or a qwencuda.Model (its .path).
    trace: a Trace (or dict) that captured the residual streams ("embed", "blk.*.resid_out").
    target: token ids (n,) to follow through the layers; default the trace's final argmax per
        position (what the model ends up predicting), else the last layer's top-1."""
    ref = _ref(model_or_ref)
    tensors = getattr(trace, "tensors", trace)
    names = _residual_names(tensors, include_mid)
    if not names:
        raise ValueError("the trace has no residual stream: capture 'embed' and 'blk.*.resid_out'")
    k = max(1, min(int(k), ref.config.n_vocab))
    n = np.asarray(tensors[names[0]]).shape[0]
    pos = getattr(trace, "positions", None)
    positions = np.arange(n) if pos is None or len(pos) != n else np.asarray(pos).reshape(-1)
    top_ids = np.zeros((len(names), n, k), np.int64)
    top_logits = np.zeros((len(names), n, k), np.float32)
    top_probs = np.zeros((len(names), n, k), np.float32)
    all_logits = []
    for i, name in enumerate(names):
        lg = project(ref, np.asarray(tensors[name], np.float32), norm=True)      # (n, V)
        order = _top_k(lg, k)
        p = np.exp(lg - lg.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        top_ids[i] = order
        top_logits[i] = np.take_along_axis(lg, order, 1)
        top_probs[i] = np.take_along_axis(p, order, 1)
        all_logits.append((lg, p))
    if target is None:
        am = getattr(trace, "argmax", None)
        target = np.asarray(am).reshape(-1) if am is not None and np.size(am) == n else top_ids[-1, :, 0]
    target = np.asarray(target, np.int64).reshape(-1)
    if target.shape != (n,):
        raise ValueError(f"target must hold one token per position ({n}), got {target.shape}")
    rank = np.zeros((len(names), n), np.int64)
    prob = np.zeros((len(names), n), np.float32)
    for i, (lg, p) in enumerate(all_logits):
        t_logit = lg[np.arange(n), target]
        rank[i] = (lg > t_logit[:, None]).sum(1)
        prob[i] = p[np.arange(n), target]
    formed = np.full(n, -1, np.int64)
    for c in range(n):
        top1 = rank[:, c] == 0
        if top1[-1]:
            j = len(names) - 1
            while j > 0 and top1[j - 1]:
                j -= 1
            formed[c] = j
    return LensResult(layers=names, positions=positions, top_ids=top_ids, top_logits=top_logits,
                      top_probs=top_probs, target=target, target_rank=rank, target_prob=prob,
                      formed_at=formed, tokenizer=tokenizer)

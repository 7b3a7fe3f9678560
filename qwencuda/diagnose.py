"""diagnose: which known engine bug explains a set of tensor dumps.

    d = qwencuda.diagnose(my_dumps, "model.gguf", ids)
    print(d)          # "your blk.0.q_rope matches interleaved RoPE pairs (GPT-J style); Qwen2
                      #  uses NEOX halves: pair i with i + head_dim/2" + every variant's score
    d.fault           # "rope_interleaved", or None when no known fault matches

compare() says WHERE a run leaves the correct engine; this says WHY, for the mistakes that the
seeds' engineers (and most engine authors) actually make. The reference engine can reproduce
each of them (qwencuda.reference.FAULTS); we run it on the same ids once correctly and once per
fault, find the first tensor where the user's dumps leave the correct run, and rank the faulty
runs by how closely they follow the user's tensors at that point and over the tensors after it.
A fault that is really there reproduces the user's numbers (up to their engine's rounding); any
other one does not.

The score of a variant is 0.5 x sim(divergence tensor) + 0.5 x mean sim(the next tensors), where
sim = 1 / (1 + (rel / 0.05)^2) and rel = ||user - variant|| / ||variant||: 1 for the same
numbers, 0.5 at 5 % relative error, near 0 for unrelated ones. A fault is named when its score
is at least 0.5 and it follows the user's divergence tensor better than the correct run does.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import sys as _sys
import types as _types

import numpy as np

from . import namemaps
from .compare import DIVERGED, OK, compare, compare_arrays, load_tensors

__all__ = ["diagnose", "variant", "Diagnosis", "VariantScore", "EXPLANATIONS", "FIXES", "REL_SCALE",
           "MIN_SCORE", "WINDOW"]

REL_SCALE = 0.05    # the relative error at which a tensor counts as half-matching
MIN_SCORE = 0.5     # the score a fault needs to be named
WINDOW = 12         # tensors after the divergence that take part in the score

# What the user's tensor looks like under each fault (completes "your X matches ..."), and the fix.
EXPLANATIONS = {
    "transposed_weights": "projection weights read in the wrong major order: the (out, in) "
                          "buffer taken as column-major, W.T for a square weight",
    "no_qkv_bias": "q/k/v projections without their biases",
    "kv_pos_stuck": "a KV cache position that never advances: every token at RoPE position 0, "
                    "written to cache slot 0 and attending only to itself",
    "rope_interleaved": "interleaved RoPE pairs (GPT-J style)",
    "rope_base_1e4": "RoPE with theta 10000",
    "rmsnorm_eps_1e-5": "RMSNorm with eps 1e-5",
    "rmsnorm_no_mean": "RMSNorm over the SUM of squares (no division by dim)",
    "gqa_wrong_mapping": "query heads mapped to KV heads by h % n_head_kv",
    "lm_head_wrong_ld": "an lm_head read with the wrong leading dimension: its (n_vocab, dim) "
                        "buffer taken as (dim, n_vocab)",
    "argmax_unwritten": "logits whose tail (ids from the first special/padding token on) was never "
                        "written: stale memory larger than every real logit, so argmax picks it",
}

FIXES = {
    "transposed_weights": "GGUF ne = [in, out] is a row-major (out, in) array and y = W @ x; in "
                          "cuBLAS (column-major) that memory is W^T with leading dimension in: "
                          "cublasGemmEx(OP_T, OP_N, m=out, n=n_tokens, k=in, A=W, lda=in, B=X, "
                          "ldb=in, C=Y, ldc=out). Test each GEMM against NumPy on non-square shapes",
    "no_qkv_bias": "Qwen2 HAS q/k/v biases (no o_proj bias): add blk.L.attn_q/k/v.bias right after "
                   "each projection, before RoPE; values of tens are normal",
    "kv_pos_stuck": "advance the position after every forward: token t gets RoPE position t, is "
                    "written to cache slot t and attends to slots 0..t",
    "rope_interleaved": "Qwen2 uses NEOX halves: pair i with i + head_dim/2",
    "rope_base_1e4": "read theta from qwen2.rope.freq_base (1e6 for Qwen2.5), not the LLaMA default",
    "rmsnorm_eps_1e-5": "read eps from qwen2.attention.layer_norm_rms_epsilon (1e-6) and compute "
                        "the statistics in fp32",
    "rmsnorm_no_mean": "x / sqrt(mean(x^2) + eps) * w: divide the sum of squares by dim",
    "gqa_wrong_mapping": "query head h reads KV head h // (n_head / n_head_kv): consecutive query "
                         "heads share a KV head",
    "lm_head_wrong_ld": "output.weight (ne = [dim, n_vocab]) is row-major (n_vocab, dim): logits = "
                        "W @ h; in cuBLAS that is OP_T with lda = dim, not OP_N with lda = n_vocab",
    "argmax_unwritten": "write every logit row in full (n_vocab from the embedding tensor, 151936 "
                        "for Qwen2.5) and never let argmax read memory the GEMM did not write",
}


@dataclass
class VariantScore:
    """How well one reference variant (a fault, or None for the correct run) follows the user."""
    fault: str | None
    score: float
    rel_at_divergence: float | None
    cos_at_divergence: float | None
    matched: int                     # tensors from the divergence on within REL_SCALE
    compared: int                    # tensors from the divergence on that both have
    first_affected: str | None


@dataclass
class Diagnosis:
    """The answer: .fault (a name of reference.FAULTS or None), .sentence, .divergence (the first
    tensor that leaves the correct run), .scores (fault -> score), .variants (VariantScore, best
    first, the correct run included as fault None), .report (the user vs the correct run)."""
    fault: str | None
    sentence: str
    divergence: str | None
    explanation: str = ""
    fix: str = ""
    scores: dict = field(default_factory=dict)
    variants: list = field(default_factory=list)
    report: object = None

    @property
    def matched(self):
        return self.fault is not None

    def to_dict(self):
        return {"fault": self.fault, "sentence": self.sentence, "divergence": self.divergence,
                "explanation": self.explanation, "fix": self.fix, "scores": dict(self.scores),
                "variants": [asdict(v) for v in self.variants]}

    def __str__(self):
        lines = [self.sentence]
        if self.variants:
            lines += ["", f"{'variant':<20} {'score':>6} {'rel@div':>9} {'cos@div':>9} "
                          f"{'matched':>8}  first affected"]
            for v in self.variants:
                rel = "" if v.rel_at_divergence is None else f"{v.rel_at_divergence:.2e}"
                cos = "" if v.cos_at_divergence is None else f"{v.cos_at_divergence:.4f}"
                lines.append(f"{v.fault or '(correct engine)':<20} {v.score:6.3f} {rel:>9} {cos:>9} "
                             f"{v.matched:>3}/{v.compared:<4}  {v.first_affected or ''}")
        return "\n".join(lines)

    def __repr__(self):
        return f"<Diagnosis fault={self.fault!r} divergence={self.divergence!r}>"


def _sim(rel):
    if rel is None or not np.isfinite(rel):
        return 0.0
    return 1.0 / (1.0 + (rel / REL_SCALE) ** 2)


def _rel_cos(name, user, expected):
    """(rel, cos) of user against variant for one tensor; (inf, None) when they cannot be lined up."""
    row = compare_arrays(name, user, expected, rtol=0.0, atol=0.0, detail=False)
    if row.status in (OK, DIVERGED):
        if row.rel is None:                   # integers (argmax): the fraction that differ
            return float(row.frac_fail or 0.0), None
        bad = (row.nan_a + row.inf_a) != (row.nan_b + row.inf_b)
        return (np.inf if bad else row.rel), row.cosine
    return np.inf, None


def _unwritten_rel(user_logits, correct_logits, n_written):
    """argmax_unwritten at the logits: the stale tail holds whatever was in memory, so judge the
    written part against the correct logits and ask whether the tail beats every written logit."""
    u = np.asarray(user_logits, np.float64)
    c = np.asarray(correct_logits, np.float64)
    if u.ndim == 2 and c.ndim == 2 and u.shape[1] == c.shape[1] and len(u) <= len(c):
        c = c[len(c) - len(u):]                  # logits of the last rows only
    if u.shape != c.shape or u.ndim != 2 or not 0 < n_written < u.shape[1]:
        return np.inf, None
    head_rel, cos = _rel_cos("logits", u[:, :n_written], c[:, :n_written])
    tail_wins = np.mean(np.nanmax(u[:, n_written:], 1) > np.nanmax(u[:, :n_written], 1))
    return head_rel + (1.0 - tail_wins), cos


_RUNS: dict = {}       # (id(ref), ids, fault) -> (ref, trace): the last few reference runs
_RUNS_MAX = 32


def variant(model, ids, fault=None):
    """The reference run of ids (from position 0, everything captured, logits of every row) with
    one fault of reference.FAULTS, or the correct run for fault None. Recent runs are kept, so
    diagnosing several dumps of one prompt runs each variant once."""
    from . import reference

    ref = _model(model)
    key = (id(ref), tuple(int(t) for t in np.asarray(ids).reshape(-1)), fault)
    hit = _RUNS.get(key)
    if hit is not None and hit[0] is ref:
        return hit[1]
    tr = reference.forward(ref, list(key[1]), capture="*", logits="all",
                           faults=() if fault is None else (fault,))
    if len(_RUNS) >= _RUNS_MAX:
        _RUNS.pop(next(iter(_RUNS)))
    _RUNS[key] = (ref, tr)
    return tr


def _model(model, progress=None):
    from . import reference

    if isinstance(model, reference.RefModel):
        return model
    return reference._model(getattr(model, "path", model), progress=progress)


def diagnose(dumps, model, ids=None, name_map=None, rtol=1e-3, atol=1e-4, faults=None,
             progress=None) -> Diagnosis:
    """Name the known fault that explains dumps (a Trace, dict, .npz, folder: as compare takes).

    model: the GGUF path, a reference.RefModel or anything with .path (a qwencuda.Model).
    ids: the token ids of the dumped pass, run from position 0 (default: dumps.ids of a Trace).
    name_map: as for compare ("hf", "llama.cpp", a dict). faults: the names to try (default all
    of reference.FAULTS). rtol/atol decide where the user leaves the correct run.
    progress: bars on stderr for loading the reference and for its runs of each fault (None:
    only when stderr is a terminal; False: never; see qwencuda.progress).
    """
    from . import reference
    from .progress import bar

    ref = _model(model, progress)
    if ids is None:
        ids = getattr(dumps, "ids", None)
        if ids is None:
            raise ValueError("diagnose needs the token ids of the dumped pass")
    ids = [int(t) for t in np.asarray(ids).reshape(-1)]
    faults = list(reference.FAULTS) if faults is None else list(faults)
    for f in faults:
        if f not in reference.FAULTS:
            raise ValueError(f"unknown fault {f!r}; known: {', '.join(reference.FAULTS)}")

    pairs, _ = load_tensors(dumps)
    cfg = ref.config
    user = namemaps.translate(pairs, name_map, n_layer=cfg.n_layer, head_dim=cfg.head_dim,
                              positions=np.arange(len(ids))).tensors
    correct = variant(ref, ids)
    report = compare(user, correct, rtol=rtol, atol=atol)
    report.label_a, report.label_b = "your dumps", "reference (correct)"
    div = report.first_divergence
    if not report.compared:
        return Diagnosis(fault=None, divergence=None, report=report,
                         sentence="nothing to compare: none of your tensors has a qwencuda capture "
                                  "name (pass name_map='hf' or 'llama.cpp', or a dict)")
    if div is None:
        return Diagnosis(fault=None, divergence=None, report=report,
                         sentence=f"no divergence: your {len(report.compared)} tensors match the "
                                  f"correct engine within rtol={rtol:g} atol={atol:g}")

    order = report.names()
    after = [n for n in order[order.index(div) + 1:] if n in user][:WINDOW]
    variants = [(None, correct)]
    with bar(len(faults), "diagnose: reference runs", progress, unit="fault") as b:
        for f in faults:
            variants.append((f, variant(ref, ids, f)))
            b.update(1)
    scored = []
    for fault, tr in variants:
        have = dict(tr.tensors)
        if fault == "argmax_unwritten" and div == "logits":
            rel_d, cos_d = _unwritten_rel(user["logits"], correct.tensors["logits"], ref.n_written)
        elif div in have:
            rel_d, cos_d = _rel_cos(div, user[div], have[div])
        else:
            rel_d, cos_d = np.inf, None
        sims, matched = [], int(_sim(rel_d) >= 0.5)
        for name in after:
            if name not in have:
                continue
            if fault == "argmax_unwritten" and name == "argmax":
                in_tail = np.asarray(user[name]).reshape(-1) >= ref.n_written
                s = _sim(1.0 - float(in_tail.mean()) if in_tail.size else np.inf)
            else:
                s = _sim(_rel_cos(name, user[name], have[name])[0])
            sims.append(s)
            matched += s >= 0.5
        score = 0.5 * _sim(rel_d) + 0.5 * (float(np.mean(sims)) if sims else _sim(rel_d))
        scored.append(VariantScore(
            fault=fault, score=round(float(score), 6),
            rel_at_divergence=None if not np.isfinite(rel_d) else float(rel_d),
            cos_at_divergence=cos_d, matched=int(matched), compared=1 + len(sims),
            first_affected=None if fault is None else reference.FIRST_AFFECTED.get(fault)))
    scored.sort(key=lambda v: (-v.score, v.fault or ""))
    baseline = next(v for v in scored if v.fault is None)
    best = next((v for v in scored if v.fault is not None), None)
    scores = {v.fault: v.score for v in scored if v.fault is not None}

    def rel_text(v):
        return "cannot be lined up" if v.rel_at_divergence is None else f"rel {v.rel_at_divergence:.2e}"

    follows_better = best is not None and _sim(best.rel_at_divergence) > _sim(baseline.rel_at_divergence)
    if follows_better and best.score >= MIN_SCORE:
        f = best.fault
        expl = EXPLANATIONS.get(f) or f"the fault {f!r}: {reference.FAULTS[f]}"
        fix = FIXES.get(f, "")
        verb = "match" if div.endswith("s") else "matches"     # logits, attn_scores, attn_probs
        sentence = f"your {div} {verb} {expl}" + (f"; {fix}" if fix else "")
        return Diagnosis(fault=f, sentence=sentence, divergence=div, explanation=expl, fix=fix,
                         scores=scores, variants=scored, report=report)
    row = report[div]
    if best is not None and baseline.score >= best.score and row.rel is not None and row.rel < REL_SCALE:
        sentence = (f"no known fault matches: your {div} leaves the correct engine by only "
                    f"rel {row.rel:.2e} (precision? a tolerance too tight?), and no faulty "
                    f"variant is closer")
    else:
        near = f"; the nearest is {best.fault} (score {best.score:.2f}, {rel_text(best)})" if best else ""
        sentence = f"no known fault matches: your tensors leave the correct engine at {div}{near}"
    return Diagnosis(fault=None, sentence=sentence, divergence=div, scores=scores,
                     variants=scored, report=report)


class _CallableModule(_types.ModuleType):
    """`qwencuda.diagnose` may be bound to this module or to the function depending on import
    order (see compare.py): the module forwards calls to diagnose()."""

    def __call__(self, *args, **kwargs):
        return diagnose(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule

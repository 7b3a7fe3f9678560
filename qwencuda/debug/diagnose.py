"""diagnose: which known engine bug explains a set of tensor dumps, and where your engine goes wrong.

    d = qwencuda.diagnose(my_dumps, "model.gguf", ids)
    print(d)          # "your blk.0.q_rope matches interleaved RoPE pairs (GPT-J style); Qwen2
                      #  uses NEOX halves: pair i with i + head_dim/2" + every variant's score
    d.fault           # "rope_interleaved", or None when no known fault matches
    loc = qwencuda.diagnose.localise(my_dumps, "model.gguf", ids)
    print(loc)        # "your engine goes wrong between blk.0.v and blk.0.q_rope: ..."

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
is at least 0.5 and it follows the user's divergence tensor more closely than the correct run.

Half-precision dumps (precision "fp16" / "bf16": read off the values, detect_precision, or given)
carry rounding noise from the first tensor on, and it grows along the pass (the tiny test model's
attention turns bf16 rounding of the scores into 11 % on the probabilities, 8 % on the logits),
so a cumulative tolerance either passes real bugs of a few percent or fails a correct engine.
They are judged tensor by tensor instead (the precision model, precision_model()):
  - local error: the reference computes each tensor X from YOUR tensors before it (teacher
    forcing: reference patch= puts each of your tensors in place of its own, teacher_forced());
    local(X) = ||yours - that|| / ||that||. Your engine's drift before X is in both, so it cancels;
    only what the step producing X does wrong (or rounds) remains.
  - what rounding explains: the same teacher-forced run with the correct run's tensors rounded to
    your precision in place of yours: null(X) = the local error of a correct engine whose every
    dumped tensor is rounded (the rounding of X's inputs, amplified by the step, plus X's own),
    estimated from the reference run itself; and round(X) = ||round(X) - X|| / ||X||.
  - allowance(X) = KAPPA (3) x max(null(X), round(X), unit roundoff of the format): KAPPA covers
    what a real engine's arithmetic adds to the rounding of what it stores (accumulation order,
    fused steps that round elsewhere).
The first tensor whose local error exceeds its allowance (or that cannot be lined up) is the
divergence; faults are scored as above but on local errors (each variant teacher-forced with your
tensors) and sim's unit is the tensor's allowance instead of 5 %. Float32 dumps keep rtol/atol
(compare's rule); there the "precision?" hint is given only when the local error at the
divergence is within the bf16 allowance, so a bug of a few percent that the step itself makes
(GELU for SiLU, a dropped residual, a constant 3 % off) is never called precision.

Causal localisation (localise(), Diagnosis.localisation): substitute your tensors into the correct
run in forward order; the first tensor Y whose substitution changes the logits (against the run
with your tensors before it: rel > tolerance) is where your engine goes wrong, "between X and Y"
with X your tensor before it. Only the tensors whose local error exceeds the tolerance (rtol for
float32, the allowance for half precision) are probed, each with two or three runs; the
tolerance on the logits is rtol, or for half precision KAPPA_OUTPUT (2) x what rounding the
reference's own Y to your precision does to them. Any subset of tensors works (partial dumps,
some layers, llama.cpp's last rows): the reference fills in the rest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import sys as _sys
import types as _types

import numpy as np

from . import namemaps
from .compare import DIVERGED, DTYPE, ERROR, OK, SHAPE, _align, compare, compare_arrays, load_tensors

__all__ = ["diagnose", "localise", "variant", "teacher_forced", "precision_model", "detect_precision",
           "round_to", "Diagnosis", "Localisation", "Precision", "VariantScore", "EXPLANATIONS",
           "FIXES", "REL_SCALE", "MIN_SCORE", "WINDOW", "KAPPA", "KAPPA_OUTPUT", "PRECISIONS"]

REL_SCALE = 0.05    # the relative error at which a tensor counts as half-matching
MIN_SCORE = 0.5     # the score a fault needs to be named
WINDOW = 12         # tensors after the divergence that take part in the score
KAPPA = 3.0         # how many times what rounding explains a local error may be (precision model)
KAPPA_OUTPUT = 2.0  # how many times what rounding a tensor does to the logits its substitution may
PRECISIONS = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}   # unit roundoff

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
    precision: str = "fp32"
    local: dict = field(default_factory=dict)        # half precision: name -> (local rel, allowance)
    localisation: object = None                      # a Localisation, or None when not run

    @property
    def matched(self):
        return self.fault is not None

    def to_dict(self):
        return {"fault": self.fault, "sentence": self.sentence, "divergence": self.divergence,
                "explanation": self.explanation, "fix": self.fix, "scores": dict(self.scores),
                "variants": [asdict(v) for v in self.variants], "precision": self.precision,
                "local": {n: list(v) for n, v in self.local.items()},
                "localisation": None if self.localisation is None else self.localisation.to_dict()}

    def __str__(self):
        lines = [self.sentence]
        if self.localisation is not None:
            lines.append(self.localisation.sentence)
        if self.precision != "fp32":
            lines.append(f"({self.precision} dumps: each tensor judged against what the reference computes "
                         f"from your tensors before it, allowing {KAPPA:g} x what {self.precision} "
                         f"rounding explains there)")
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
    from .. import reference

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
    from .. import reference

    if isinstance(model, reference.RefModel):
        return model
    return reference._model(getattr(model, "path", model), progress=progress)


def _inputs(dumps, model, ids, name_map, progress):
    """(RefModel, ids as a list, the user's tensors under qwencuda's names)."""
    ref = _model(model, progress)
    if ids is None:
        ids = getattr(dumps, "ids", None)
        if ids is None:
            raise ValueError("diagnose needs the token ids of the dumped pass")
    ids = [int(t) for t in np.asarray(ids).reshape(-1)]
    pairs, _ = load_tensors(dumps)
    cfg = ref.config
    user = namemaps.translate(pairs, name_map, n_layer=cfg.n_layer, head_dim=cfg.head_dim,
                              positions=np.arange(len(ids))).tensors
    return ref, ids, dict(user)


# --------------------------------------------------------------------------------------------
# Precision: what rounding to fp16 / bf16 explains, tensor by tensor

def round_to(a, precision):
    """a rounded to precision ("fp16", "bf16"; "fp32" leaves it) and back to float32, to nearest
    even; infinities stay."""
    a = np.asarray(a, np.float32)
    if precision == "fp32":
        return a.copy()
    if precision == "fp16":
        with np.errstate(over="ignore"):
            return a.astype(np.float16).astype(np.float32)
    if precision == "bf16":
        b = a.view(np.uint32).astype(np.uint64)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        out = b.astype(np.uint32).view(np.float32)
        return np.where(np.isfinite(a), out, a)
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def detect_precision(tensors) -> str:
    """The coarsest format that a dumped tensor's values all lie on: "bf16", "fp16" or "fp32".
    Only tensors with at least 16 distinct finite values count (all-ones attention of one key,
    zeros and integers lie on every grid). The coarsest wins: an engine that stores one tensor
    in bf16 carries bf16 noise into everything computed from it."""
    found = "fp32"
    for name, a in dict(tensors).items():
        a = np.asarray(a)
        if a.dtype.kind != "f" or name == "argmax":
            continue
        if a.dtype == np.float16:
            found = "fp16" if found == "fp32" else found
            continue
        v = a[np.isfinite(a)].astype(np.float32)
        if len(np.unique(v[:4096])) < 16:
            continue
        if np.array_equal(round_to(v, "bf16"), v):
            return "bf16"
        if np.array_equal(round_to(v, "fp16"), v):
            found = "fp16"
    return found


def _fit(name, user, computed):
    """The user's tensor in the shape of the reference's `computed` (a float32 array to put in
    its place), or None when it cannot be lined up. Fewer rows (llama.cpp's output rows,
    logits of the last row) replace the last rows only; the rest stays the reference's."""
    u = np.asarray(user)
    if u.dtype.kind != "f" or computed.dtype.kind != "f":
        return None
    u = u.astype(np.float32)
    if u.shape == computed.shape:
        return u
    try:
        a, _, _ = _align(name, u, computed)
    except ValueError:
        return None
    if a.shape == computed.shape:
        return np.ascontiguousarray(a, np.float32)
    if a.ndim == computed.ndim and a.shape[1:] == computed.shape[1:] and len(a) < len(computed):
        out = np.array(computed, np.float32, copy=True)
        out[len(out) - len(a):] = a
        return out
    return None


def teacher_forced(model, ids, tensors, fault=None, upto=None, logits="all"):
    """Run the reference on ids (from position 0) with `tensors` (capture name -> array, e.g. your
    dumps) put in place of its own, each right where it is computed (reference patch=): every
    tensor after the first is then computed from YOUR tensors before it.

    -> (computed, logits): computed[name] is what the reference (with `fault`, when given)
    computed at `name` from the given tensors before it (before any substitution of that name),
    for every capture name but argmax; logits are the run's output (after substitution).
    upto: substitute only the names before this one in forward order (and it, when upto is a
    pair (name, True))."""
    from .. import reference

    ref = _model(model)
    names = [n for n in ref.capture_names() if n != "argmax"]
    stop, inclusive = (upto if isinstance(upto, tuple) else (upto, False))
    use = set(tensors)
    if stop is not None:
        use = {n for n in names[:names.index(stop) + int(inclusive)] if n in tensors}
    computed = {}

    def hook(name):
        def put(value):
            computed[name] = value
            return _fit(name, tensors[name], value) if name in use else None
        return put

    tr = reference.forward(ref, ids, capture=None, logits=logits,
                           faults=() if fault is None else (fault,),
                           patch={n: hook(n) for n in names})
    return computed, tr.logits


@dataclass
class Precision:
    """The tolerance model of one set of dumps: precision ("fp16", "bf16"), and per tensor name
    the local error (your tensor against what the reference computes from your tensors before
    it) and the allowance (KAPPA x what rounding explains there, see the module docstring)."""
    precision: str
    local: dict = field(default_factory=dict)
    allowed: dict = field(default_factory=dict)
    computed: dict = field(default_factory=dict, repr=False)

    def beyond(self, name):
        return self.local.get(name, 0.0) > self.allowed.get(name, np.inf)

    def first_divergence(self, order):
        return next((n for n in order if n in self.local and self.beyond(n)), None)


def precision_model(model, ids, user, precision, correct=None) -> Precision:
    """Local errors and their allowances for the user's tensors (two reference runs)."""
    ref = _model(model)
    correct = correct if correct is not None else variant(ref, ids)
    have = [n for n in ref.capture_names() if n in user and n != "argmax" and n in correct.tensors]
    rounded = {n: round_to(correct[n], precision) for n in have}
    null, _ = teacher_forced(ref, ids, rounded)              # the correct engine, rounded
    computed, _ = teacher_forced(ref, ids, user)
    pm = Precision(precision=precision, computed=computed)
    unit = PRECISIONS[precision]
    for n in have:
        explained = max(_rel_cos(n, rounded[n], correct[n])[0], _rel_cos(n, rounded[n], null[n])[0], unit)
        pm.allowed[n] = KAPPA * explained
        pm.local[n] = _rel_cos(n, user[n], computed[n])[0]
    return pm


def _sim_local(rel, allowed):
    """sim for local errors of half-precision dumps: the unit is the tensor's allowance."""
    if rel is None or not np.isfinite(rel):
        return 0.0
    return 1.0 / (1.0 + (rel / allowed) ** 2)


# --------------------------------------------------------------------------------------------
# diagnose

def diagnose(dumps, model, ids=None, name_map=None, rtol=1e-3, atol=1e-4, faults=None,
             progress=None, precision=None, localise=None) -> Diagnosis:
    """Name the known fault that explains dumps (a Trace, dict, .npz, folder: as compare takes).

    model: the GGUF path, a reference.RefModel or anything with .path (a qwencuda.Model).
    ids: the token ids of the dumped pass, run from position 0 (default: dumps.ids of a Trace).
    name_map: as for compare ("hf", "llama.cpp", a dict). faults: the names to try (default all
    of reference.FAULTS). rtol/atol decide where float32 dumps leave the correct run (and make
    .report, the table against the correct run, for every precision).
    precision: "fp32", "fp16", "bf16", or None to read it off the dumps (detect_precision):
    half-precision dumps are judged tensor by tensor against what rounding explains.
    localise: substitute your tensors into the correct run (localise()) and attach the answer as
    .localisation: True always, False never, None (default) when no known fault matches.
    progress: bars on stderr for loading the reference and for its runs of each fault (None:
    only when stderr is a terminal; False: never; see qwencuda.progress).
    """
    from .. import reference
    from ..progress import bar

    ref, ids, user = _inputs(dumps, model, ids, name_map, progress)
    faults = list(reference.FAULTS) if faults is None else list(faults)
    for f in faults:
        if f not in reference.FAULTS:
            raise ValueError(f"unknown fault {f!r}; known: {', '.join(reference.FAULTS)}")
    prec = detect_precision(user) if precision is None else precision
    if prec not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or None, got {precision!r}")

    correct = variant(ref, ids)
    report = compare(user, correct, rtol=rtol, atol=atol)
    report.label_a, report.label_b = "your dumps", "reference (correct)"
    if not report.compared:
        return Diagnosis(fault=None, divergence=None, report=report, precision=prec,
                         sentence="nothing to compare: none of your tensors has a qwencuda capture "
                                  "name (pass name_map='hf' or 'llama.cpp', or a dict)")
    order = report.names()
    half = prec != "fp32"
    pm = precision_model(ref, ids, user, prec, correct) if half else None
    if half:
        div = pm.first_divergence(order)
        if div is None:     # argmax: a shape or dtype mismatch still counts (a flip may be a near-tie)
            div = next((r.name for r in report.rows if r.status in (SHAPE, DTYPE, ERROR)
                        and r.name not in pm.local), None)
    else:
        div = report.first_divergence

    def finish(d):
        if localise or (localise is None and d.divergence is not None and d.fault is None):
            d.localisation = _localise(ref, ids, user, prec, correct, pm, rtol)
        return d

    if div is None:
        within = (f"what {prec} rounding explains, tensor by tensor (KAPPA={KAPPA:g})" if half
                  else f"rtol={rtol:g} atol={atol:g}")
        return finish(Diagnosis(fault=None, divergence=None, report=report, precision=prec,
                                local=_local_rows(pm), sentence=f"no divergence: your "
                                f"{len(report.compared)} tensors match the correct engine within {within}"))

    after = [n for n in order[order.index(div) + 1:] if n in user and not (half and n == "argmax")][:WINDOW]
    runs = [None] + faults
    scored = []
    with bar(len(faults), "diagnose: reference runs", progress, unit="fault") as b:
        for fault in runs:
            if half:      # what this variant computes from YOUR tensors before each one
                have = teacher_forced(ref, ids, user, fault=fault)[0] if fault else pm.computed
            else:
                have = dict(variant(ref, ids, fault).tensors)

            def sim(name, rel):
                return _sim_local(rel, pm.allowed[name]) if half and name in pm.allowed else _sim(rel)

            if fault == "argmax_unwritten" and div == "logits":
                rel_d, cos_d = _unwritten_rel(user["logits"], have["logits"] if half else correct.tensors["logits"],
                                              ref.n_written)
            elif div in have:
                rel_d, cos_d = _rel_cos(div, user[div], have[div])
            else:
                rel_d, cos_d = np.inf, None
            sims, matched = [], int(sim(div, rel_d) >= 0.5)
            for name in after:
                if name not in have:
                    continue
                if fault == "argmax_unwritten" and name == "argmax":
                    in_tail = np.asarray(user[name]).reshape(-1) >= ref.n_written
                    s = _sim(1.0 - float(in_tail.mean()) if in_tail.size else np.inf)
                else:
                    s = sim(name, _rel_cos(name, user[name], have[name])[0])
                sims.append(s)
                matched += s >= 0.5
            score = 0.5 * sim(div, rel_d) + 0.5 * (float(np.mean(sims)) if sims else sim(div, rel_d))
            scored.append(VariantScore(
                fault=fault, score=round(float(score), 6),
                rel_at_divergence=None if not np.isfinite(rel_d) else float(rel_d),
                cos_at_divergence=cos_d, matched=int(matched), compared=1 + len(sims),
                first_affected=None if fault is None else reference.FIRST_AFFECTED.get(fault)))
            if fault is not None:
                b.update(1)
    scored.sort(key=lambda v: (-v.score, v.fault or ""))
    baseline = next(v for v in scored if v.fault is None)
    best = next((v for v in scored if v.fault is not None), None)
    scores = {v.fault: v.score for v in scored if v.fault is not None}
    common = dict(divergence=div, scores=scores, variants=scored, report=report, precision=prec,
                  local=_local_rows(pm))

    def rel_text(v):
        return "cannot be lined up" if v.rel_at_divergence is None else f"rel {v.rel_at_divergence:.2e}"

    def rel_of(v):
        return np.inf if v is None or v.rel_at_divergence is None else v.rel_at_divergence

    follows_better = best is not None and rel_of(best) < rel_of(baseline)
    if follows_better and best.score >= MIN_SCORE:
        f = best.fault
        expl = EXPLANATIONS.get(f) or f"the fault {f!r}: {reference.FAULTS[f]}"
        fix = FIXES.get(f, "")
        verb = "match" if div.endswith("s") else "matches"     # logits, attn_scores, attn_probs
        sentence = f"your {div} {verb} {expl}" + (f"; {fix}" if fix else "")
        return finish(Diagnosis(fault=f, sentence=sentence, explanation=expl, fix=fix, **common))
    near = f"; the nearest is {best.fault} (score {best.score:.2f}, {rel_text(best)})" if best else ""
    if half:
        sentence = (f"no known fault matches: your {div} leaves the correct engine beyond what "
                    f"{prec} rounding explains (the reference computes it from your tensors before "
                    f"it to within rel {pm.local[div]:.2e}, against an allowance of "
                    f"{pm.allowed[div]:.2e}){near}" if div in pm.local else
                    f"no known fault matches: your {div} cannot be lined up with the correct "
                    f"engine's ({report[div].note}){near}")
        return finish(Diagnosis(fault=None, sentence=sentence, **common))
    row = report[div]
    hint = None
    if best is None or baseline.score >= best.score:
        hint = _rounding_hint(ref, ids, user, div, correct)
    if hint:
        sentence = (f"no known fault matches: your {div} leaves the correct engine by only "
                    f"rel {row.rel:.2e}, {hint} (precision? a tolerance too tight? pass "
                    f"precision='bf16' or 'fp16'), and no faulty variant is closer")
    else:
        sentence = f"no known fault matches: your tensors leave the correct engine at {div}{near}"
    return finish(Diagnosis(fault=None, sentence=sentence, **common))


def _local_rows(pm):
    if pm is None:
        return {}
    return {n: (float(pm.local[n]), float(pm.allowed[n])) for n in pm.local}


def _rounding_hint(ref, ids, user, div, correct):
    """For float32 dumps that leave the correct run at div: a phrase when your error there is
    within what bf16 rounding would explain (the coarser half format), else None. Judged
    locally, so that an error grown over many tensors is not taken for a bug, nor a bug of a few
    percent for precision."""
    if div not in correct.tensors or div == "argmax":
        return None
    pm = precision_model(ref, ids, user, "bf16", correct)
    if div in pm.local and not pm.beyond(div):
        return (f"within what bf16 rounding of its inputs explains (local rel "
                f"{pm.local[div]:.2e} <= {pm.allowed[div]:.2e})")
    return None


# --------------------------------------------------------------------------------------------
# Causal localisation: substitute your tensors into the correct run, in forward order

@dataclass
class Localisation:
    """Where substituting your tensors into the correct run first changes its output.

    good: the tensor before `bad` among yours (None when bad is your first tensor); bad: the
    first of your tensors whose substitution changes the logits beyond tolerance (None: none
    does); flagged: your tensors that the reference does not reproduce from your tensors before
    them (local error beyond tolerance), in forward order: the candidates, each probed;
    probes: name -> (output rel, tolerance, rows whose argmax changed); sentence."""
    good: str | None
    bad: str | None
    sentence: str
    precision: str = "fp32"
    flagged: list = field(default_factory=list)
    probes: dict = field(default_factory=dict)
    candidates: list = field(default_factory=list)

    def to_dict(self):
        return asdict(self)

    def __str__(self):
        return self.sentence


def localise(dumps, model, ids=None, name_map=None, precision=None, rtol=1e-3,
             progress=None) -> Localisation:
    """Substitute your tensors into the correct (reference) run in forward order and name the
    first whose substitution changes the output: "your engine goes wrong between X and Y".
    Arguments as for diagnose; rtol: the smallest relative change of the logits that counts
    (float32 dumps). Works with any subset of the capture names (partial dumps)."""
    ref, ids, user = _inputs(dumps, model, ids, name_map, progress)
    prec = detect_precision(user) if precision is None else precision
    if prec not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or None, got {precision!r}")
    correct = variant(ref, ids)
    pm = precision_model(ref, ids, user, prec, correct) if prec != "fp32" else None
    return _localise(ref, ids, user, prec, correct, pm, rtol)


def _localise(ref, ids, user, prec, correct, pm, rtol):
    names = [n for n in ref.capture_names() if n != "argmax"]
    computed = pm.computed if pm is not None else teacher_forced(ref, ids, user)[0]
    cands = [n for n in names if n in user and _fit(n, user[n], computed[n]) is not None]
    loc = Localisation(good=None, bad=None, sentence="", precision=prec, candidates=cands)
    if not cands:
        loc.sentence = "nothing to substitute: none of your tensors lines up with a capture of the reference"
        return loc

    def local_bad(n):
        if pm is not None:
            return pm.beyond(n)
        return _rel_cos(n, user[n], computed[n])[0] > rtol
    loc.flagged = [n for n in cands if local_bad(n)]
    for n in loc.flagged:
        # your tensors before n in place; then n as the reference computes it, yours, and (the
        # null) the reference's rounded to your precision
        _, before = teacher_forced(ref, ids, user, upto=n)
        _, mine = teacher_forced(ref, ids, user, upto=(n, True))
        tol = rtol
        if prec != "fp32":
            _, null = teacher_forced(ref, ids, dict(user, **{n: round_to(computed[n], prec)}), upto=(n, True))
            tol = max(tol, KAPPA_OUTPUT * _rel_cos("logits", null, before)[0])
        rel = _rel_cos("logits", mine, before)[0]
        flips = int(np.sum(np.argmax(mine, -1) != np.argmax(before, -1)))
        loc.probes[n] = (float(rel), float(tol), flips)
        if rel > tol:
            i = cands.index(n)
            loc.good, loc.bad = (cands[i - 1] if i else None), n
            break
    within = f"what {prec} rounding of it explains" if prec != "fp32" else f"rtol={rtol:g}"
    if loc.bad is not None:
        rel, tol, flips = loc.probes[loc.bad]
        where = (f"between {loc.good} and {loc.bad}" if loc.good else
                 f"before {loc.bad} (it is the first of your tensors)")
        arg = f"; the argmax of {flips} of {len(ids)} rows" if flips else ""
        loc.sentence = (f"your engine goes wrong {where}: substituting your tensors into the correct "
                        f"run in forward order, your {loc.bad} is the first that changes its logits "
                        f"(rel {rel:.2e} against the run with your tensors before it, tolerance "
                        f"{tol:.2e}{arg})")
    elif loc.flagged:
        loc.sentence = (f"no substitution changes the output beyond {within}; the first of your "
                        f"tensors that the reference does not reproduce from yours before it is "
                        f"{loc.flagged[0]}, but its effect on the logits stays within tolerance")
    else:
        loc.sentence = (f"no substitution changes the output: the reference reproduces each of your "
                        f"{len(cands)} tensors from yours before it (within {within})")
    return loc


class _CallableModule(_types.ModuleType):
    """`qwencuda.diagnose` is this module (qwencuda/__init__.py), and it forwards calls to
    diagnose(): `qwencuda.diagnose(dumps, model, ids)` and `qwencuda.diagnose.localise` both work."""

    def __call__(self, *args, **kwargs):
        return diagnose(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule

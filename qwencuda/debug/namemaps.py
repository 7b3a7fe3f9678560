"""Name maps: other engines' tensor names and layouts -> qwencuda's capture names and layouts.

A user who debugs an engine usually already has dumps from a second one: Hugging Face
transformers (forward hooks, `output_hidden_states`, `output_attentions`) or llama.cpp (the
eval-callback, which names every graph node "Qcur-0", "kq_soft_max-0", ...). Those dumps use other
names, other layouts (a batch axis, flat heads, ggml's ne order) and sometimes other quantities
(llama.cpp's `kq` is unscaled and unmasked). `translate()` turns them into qwencuda's names and
layouts so that `qwencuda.compare` can line them up; `to_hf()` / `to_llamacpp()` go the other
way (they fabricate dumps in those conventions from a Trace: the round-trip tests use them, and
they show exactly what each convention looks like). docs/debugging.md has the full table.

llama.cpp layout: a ggml tensor with ne = [ne0, ne1, ne2, ne3] (ne0 fastest) is, read as a
C-order NumPy array, `np.frombuffer(buf, np.float32).reshape(ne3, ne2, ne1, ne0)`, i.e. the ne list
reversed (`from_ggml`). In that view every llama.cpp tensor that we map is already in our
(rows, features) layout: Qcur before RoPE is (n_tokens, n_embd) = our q, flat; after RoPE it is
(n_tokens, n_head, head_dim) = our q_rope; kq/kq_soft_max are (n_head, n_tokens, n_kv) = our
attn_scores/attn_probs (n_kv may be padded, to 256 cells in recent versions: compare crops the
padding); kqv_out is (n_tokens, n_embd) = our attn_out.

Names llama.cpp gives twice: the qwen2 graph names Qcur-L, Kcur-L and Vcur-L once after the
projection (+ bias, a flat 2-D tensor) and again after RoPE (Q, K) or the reshape (V) (a 3-D
tensor). We tell them apart by an explicit occurrence suffix ("Qcur-0#1" is the second one) when
the dump has one, else by the order in which a list of (name, array) pairs gives them, else by
the number of dimensions (2-D: before RoPE, 3-D: after). Keep at least three dimensions of a
rope'd tensor when you dump it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..trace import LAYER_NAMES

__all__ = ["MAPS", "DERIVED", "HF_LAYER", "HF_LAYER_INPUTS", "LLAMACPP_LAYER", "Translated", "resolve",
           "translate", "to_hf", "to_llamacpp", "from_ggml", "mapping_table"]

MAPS = ("hf", "llama.cpp")
_ALIASES = {"hf": "hf", "huggingface": "hf", "transformers": "hf",
            "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama_cpp": "llama.cpp",
            "ggml": "llama.cpp"}

# Quantities that other engines expose and qwencuda does not capture, but compare can compute
# from a capture of ours: derived name (per layer) -> (source capture, description).
DERIVED = {
    "gate_silu": ("gate", "silu(blk.L.gate): HF's mlp.act_fn output, llama.cpp's ffn_silu"),
}

# HF module path after "model.layers.L." -> our per-layer name ("" = the decoder layer itself).
HF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "attn_proj",
    "self_attn": "attn_proj",              # the attention module's output[0]
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.act_fn": "gate_silu",             # silu(gate) only: HF multiplies by up afterwards
    "mlp.down_proj": "ffn_out",
    "mlp": "ffn_out",
    "": "resid_out",
}
# The INPUT of a module (a forward pre-hook), dumped as "<module path>.input".
HF_LAYER_INPUTS = {
    "self_attn.o_proj": "attn_out",        # heads concatenated, before o_proj
    "mlp.down_proj": "ffn_act",            # silu(gate) * up
}
_HF_GLOBAL = {"embed_tokens": "embed", "norm": "output_norm", "lm_head": "logits",
              "logits": "logits"}

# llama.cpp eval-callback base name (before "-L") -> our per-layer name. A tuple names the
# first and the second occurrence.
LLAMACPP_LAYER = {
    "attn_norm": "attn_norm",
    "Qcur": ("q", "q_rope"),
    "Kcur": ("k", "k_rope"),
    "Vcur": ("v", "v"),
    "kq": "attn_scores",                   # raw Q.K: scaled and masked on the way in
    "kq_soft_max": "attn_probs",
    "kq_soft_max_ext": "attn_probs",       # older llama.cpp
    "kqv": "attn_out",                     # per head (n_head, n, head_dim); kqv_out preferred
    "__fattn__": "attn_out",               # flash attention output (n, n_head, head_dim)
    "kqv_out": "attn_out",
    "attn_out": "attn_proj",               # graphs that name the o_proj output (qwen2's does not)
    "kqv_wo": "attn_proj",                 # older llama.cpp, models with an o_proj bias
    "ffn_inp": "resid_mid",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_silu": "gate_silu",               # older llama.cpp: silu(gate) before the product
    "ffn_swiglu": "ffn_act",               # fused silu(gate) * up
    "ffn_gate_par": "ffn_act",             # older llama.cpp: silu(gate) * up
    "ffn_out": "ffn_out",
    "l_out": "resid_out",
}
_LLAMACPP_GLOBAL = {"inp_embd": "embed", "result_norm": "output_norm", "result_output": "logits"}

# Number of dimensions of each capture in our layout (the rest are 2-D).
_NDIM = {"q_rope": 3, "k_rope": 3, "attn_scores": 3, "attn_probs": 3, "argmax": 1}

_OURS = re.compile(r"^(embed|output_norm|logits|argmax|blk\.\d+\.[a-z_]+)$")


def _ndim(our_name):
    return _NDIM.get(our_name.rsplit(".", 1)[-1], 2)


@dataclass
class Translated:
    """The result of translate(): tensors under our names (unmapped ones under their own).

    tensors  name -> ndarray, in the order the dump gave them
    sources  our name -> the name it came from
    notes    name -> what was done to it (layout change, scaling, dropped duplicate)
    unknown  names that no rule mapped (kept in tensors as they were)
    """
    tensors: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)
    unknown: list = field(default_factory=list)


def resolve(name_map):
    """None, "hf", "llama.cpp" (and aliases), a dict or a callable -> a normalised name map;
    an unknown map name raises ValueError listing the known ones."""
    if name_map is None or callable(name_map) or isinstance(name_map, dict):
        return name_map
    if isinstance(name_map, str):
        key = _ALIASES.get(name_map.strip().lower())
        if key is None:
            raise ValueError(f"unknown name map {name_map!r}; known: {', '.join(MAPS)} "
                             "(or a dict of their name -> qwencuda name, '{L}' for the layer)")
        return key
    raise TypeError(f"name_map must be None, 'hf', 'llama.cpp', a dict or a callable, "
                    f"not {type(name_map).__name__}")


def _pairs(tensors):
    if hasattr(tensors, "items"):
        return list(tensors.items())
    return [(str(n), a) for n, a in tensors]


def translate(tensors, name_map, n_layer=None, head_dim=None, positions=None) -> Translated:
    """Rename (and re-lay-out) a dump into qwencuda's capture names.

    tensors: a dict name -> array, or a list of (name, array) pairs (keeps llama.cpp's repeated
        names in order). Names that are already qwencuda capture names pass through unchanged.
    name_map: None (nothing to do), "hf", "llama.cpp", a dict {their name: our name} where "{L}"
        in both stands for the layer number, or a callable their name -> our name or None.
    n_layer: the model's layer count; HF's hidden_states[n_layer] is after the final norm, so it
        is needed to place the last hidden state (default: the highest index given).
    head_dim: to scale llama.cpp's raw kq (default: read off a 3-D Qcur/Kcur in the dump).
    positions: the positions of the dumped tokens, to mask llama.cpp's kq (default 0..n-1).
    """
    name_map = resolve(name_map)
    pairs = _pairs(tensors)
    if name_map is None:
        out = Translated()
        for name, arr in pairs:
            _put(out, name, arr, name, None)
        return out
    if name_map == "hf":
        return _from_hf(pairs, n_layer)
    if name_map == "llama.cpp":
        return _from_llamacpp(pairs, head_dim, positions)
    return _from_custom(pairs, name_map)


def _put(out, ours, arr, theirs, note):
    """Store arr under ours unless that name is taken (then keep it under its own name)."""
    if ours in out.tensors:
        key, i = theirs, 1
        while key in out.tensors:
            key, i = f"{theirs}#{i}", i + 1
        out.tensors[key] = arr
        out.notes[key] = f"{ours} already came from {out.sources.get(ours, ours)}; kept under its own name"
        out.unknown.append(key)
        return
    out.tensors[ours] = arr
    if ours != theirs:
        out.sources[ours] = theirs
    if note:
        out.notes[ours] = note


def _keep_unknown(out, name, arr):
    if name in out.tensors:
        return
    out.tensors[name] = arr
    if not _OURS.match(name):
        out.unknown.append(name)


# --------------------------------------------------------------------------------------------
# Custom maps

def _from_custom(pairs, name_map):
    out = Translated()
    if callable(name_map):
        for name, arr in pairs:
            ours = name_map(name)
            if ours:
                _put(out, str(ours), arr, name, None)
            else:
                _keep_unknown(out, name, arr)
        return out
    rules = []
    for theirs, ours in name_map.items():
        if "{L}" in theirs:
            pat = re.escape(theirs).replace(re.escape("{L}"), r"(?P<L>\d+)")
            rules.append((re.compile(pat + r"\Z"), ours))
        else:
            rules.append((theirs, ours))
    for name, arr in pairs:
        for rule, ours in rules:
            if isinstance(rule, str):
                if name == rule:
                    _put(out, ours, arr, name, None)
                    break
            else:
                m = rule.match(name)
                if m:
                    _put(out, ours.replace("{L}", m.group("L")), arr, name, None)
                    break
        else:
            _keep_unknown(out, name, arr)
    return out


# --------------------------------------------------------------------------------------------
# Hugging Face transformers

_HF_MODULE = re.compile(r"^(?:.*\.)?layers\.(\d+)(?:\.(.+))?$")
_HF_INDEXED = re.compile(r"^(?:outputs?\.)?(hidden_states|attentions)(?:\.|_|\[)(\d+)\]?$")


def _squeeze_batch(arr, ndim):
    """Drop leading axes of length 1 (HF's batch axis, ggml's ne3 = 1) down to ndim."""
    a = np.asarray(arr)
    while a.ndim > ndim and a.shape[0] == 1:
        a = a[0]
    return a


def _hf_target(name):
    """An HF module/output name -> our name (None: not mapped); hidden_states are handled apart."""
    m = _HF_MODULE.match(name)
    if m:
        path = m.group(2) or ""
        if path.endswith(".input"):
            sub = HF_LAYER_INPUTS.get(path[:-len(".input")])
        else:
            sub = HF_LAYER.get(path)
        return None if sub is None else f"blk.{m.group(1)}.{sub}"
    base = name[len("model."):] if name.startswith("model.") else name
    return _HF_GLOBAL.get(base)


def _from_hf(pairs, n_layer):
    out = Translated()
    expanded = []
    for name, arr in pairs:                         # split stacked hidden_states / attentions
        if name in ("hidden_states", "attentions"):
            for i, a in enumerate(arr if isinstance(arr, (list, tuple)) else np.asarray(arr)):
                expanded.append((f"{name}.{i}", a))
        else:
            expanded.append((name, arr))
    hidden = [int(m.group(2)) for m in (_HF_INDEXED.match(n) for n, _ in expanded)
              if m and m.group(1) == "hidden_states"]
    last = int(n_layer) if n_layer is not None else (max(hidden) if hidden else None)
    for name, arr in expanded:
        m = _HF_INDEXED.match(name)
        if m:
            i = int(m.group(2))
            if m.group(1) == "attentions":
                ours, note = f"blk.{i}.attn_probs", None
            elif i == 0:
                ours, note = "embed", None
            elif last is not None and i == last:
                ours, note = "output_norm", "HF's last hidden state is after the final norm"
            elif last is not None and i > last:
                _keep_unknown(out, name, arr)
                continue
            else:
                ours, note = f"blk.{i - 1}.resid_out", None
        else:
            ours, note = _hf_target(name), None
            if ours is None:
                _keep_unknown(out, name, arr)
                continue
        a = _squeeze_batch(arr, 3 if ours.endswith("attn_probs") else 2)
        _put(out, ours, a, name, note)
    return out


def to_hf(trace, n_layer=None):
    """Fabricate the dumps HF transformers would give for the same pass (batch axis 1, flat q/k/v,
    forward-hook module names, hidden_states.i with the last one after the final norm,
    attentions.L): the conventions that translate(.., "hf") undoes."""
    t = _tensors_of(trace)
    n_layer = _n_layer(t) if n_layer is None else int(n_layer)
    out = {}

    def put(name, a):
        out[name] = np.asarray(a)[None]

    if "embed" in t:
        put("model.embed_tokens", t["embed"])
        put("hidden_states.0", t["embed"])
    for L in range(n_layer):
        p, m = f"blk.{L}.", f"model.layers.{L}."
        get = lambda s: t.get(p + s)              # noqa: E731
        if get("attn_norm") is not None:
            put(m + "input_layernorm", get("attn_norm"))
        for s, mod in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            if get(s) is not None:
                a = np.asarray(get(s))
                put(m + "self_attn." + mod, a.reshape(a.shape[0], -1))
        if get("attn_probs") is not None:
            put(f"attentions.{L}", get("attn_probs"))
        if get("attn_out") is not None:
            put(m + "self_attn.o_proj.input", get("attn_out"))
        if get("attn_proj") is not None:
            put(m + "self_attn.o_proj", get("attn_proj"))
        if get("ffn_norm") is not None:
            put(m + "post_attention_layernorm", get("ffn_norm"))
        if get("gate") is not None:
            g = np.asarray(get("gate"), np.float32)
            put(m + "mlp.gate_proj", g)
            put(m + "mlp.act_fn", g / (np.float32(1) + np.exp(-g)))
        if get("up") is not None:
            put(m + "mlp.up_proj", get("up"))
        if get("ffn_act") is not None:
            put(m + "mlp.down_proj.input", get("ffn_act"))
        if get("ffn_out") is not None:
            put(m + "mlp.down_proj", get("ffn_out"))
        if get("resid_out") is not None:
            put(m.rstrip("."), get("resid_out"))
            if L < n_layer - 1:
                put(f"hidden_states.{L + 1}", get("resid_out"))
    if "output_norm" in t:
        put("model.norm", t["output_norm"])
        put(f"hidden_states.{n_layer}", t["output_norm"])
    if "logits" in t:
        put("lm_head", t["logits"])
    return out


# --------------------------------------------------------------------------------------------
# llama.cpp

_LLAMA_NAME = re.compile(r"^(?P<base>.+?)(?:-(?P<L>\d+))?(?:#(?P<occ>\d+))?$")


def from_ggml(data, ne, dtype=np.float32):
    """A ggml tensor's contiguous data (bytes, buffer or flat array) with ne = [ne0, ne1, ...]
    (ne0 fastest, as ggml and the eval-callback print it) -> the NumPy array in C order, shape
    ne reversed, trailing ne of 1 dropped first (so ne [896, 5, 1, 1] gives (5, 896))."""
    ne = [int(x) for x in ne]
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    if isinstance(data, (bytes, bytearray, memoryview)):
        flat = np.frombuffer(data, dtype=dtype)
    else:
        flat = np.asarray(data).reshape(-1)
    size = int(np.prod(ne))
    if flat.size != size:
        raise ValueError(f"{flat.size} elements do not fill ne {ne} ({size})")
    return flat.reshape(tuple(reversed(ne)))


def _from_llamacpp(pairs, head_dim, positions):
    out = Translated()
    parsed = []
    seen = {}
    for name, arr in pairs:
        m = _LLAMA_NAME.match(name)
        base, layer, occ = m.group("base"), m.group("L"), m.group("occ")
        key = (base, layer)
        count = seen.get(key, 0)
        seen[key] = count + 1
        parsed.append((name, arr, base, layer, int(occ) if occ is not None else None, count))
    if head_dim is None:                      # read it off a rope'd Q or K
        for name, arr, base, layer, occ, count in parsed:
            a = np.asarray(arr)
            if base in ("Qcur", "Kcur") and _squeeze_batch(a, 3).ndim == 3:
                head_dim = a.shape[-1]
                break
    present = {(base, layer) for _, _, base, layer, _, _ in parsed}
    for name, arr, base, layer, occ, count in parsed:
        if layer is None:
            ours = _LLAMACPP_GLOBAL.get(base)
            if ours is None:
                _keep_unknown(out, name, arr)
            else:
                _put(out, ours, _squeeze_batch(arr, _ndim(ours)), name, None)
            continue
        rule = LLAMACPP_LAYER.get(base)
        if rule is None:
            _keep_unknown(out, name, arr)
            continue
        a = np.asarray(arr)
        note = None
        if isinstance(rule, tuple):           # Qcur / Kcur / Vcur, named twice
            if base == "Vcur":
                sub = "v"
                a = _squeeze_batch(a, 3)
                if a.ndim == 3:
                    a = a.reshape(a.shape[0], -1)
            else:
                if occ is None:
                    # a list keeps both: the order tells; a dict keeps one: its shape tells
                    n_same = sum(1 for p in parsed if p[2] == base and p[3] == layer)
                    occ = count if n_same > 1 else (1 if _squeeze_batch(a, 3).ndim == 3 else 0)
                sub = rule[min(occ, 1)]
                a = _squeeze_batch(a, 3 if sub.endswith("_rope") else 2)
                note = f"{name} ({'after' if sub.endswith('_rope') else 'before'} RoPE)"
            ours = f"blk.{layer}.{sub}"
            if ours in out.tensors and sub == "v":
                continue                      # the second Vcur is the same data, reshaped
            _put(out, ours, a, name, note)
            continue
        ours = f"blk.{layer}.{rule}"
        if base == "kq":
            if head_dim is None:
                _keep_unknown(out, name, arr)
                out.notes[name] = "raw Q.K: pass head_dim to scale and mask it into attn_scores"
                continue
            a = _scale_and_mask(_squeeze_batch(a, 3), int(head_dim), positions)
            note = f"{name} x 1/sqrt({head_dim}), causal mask applied"
        elif base == "kqv":
            if (("kqv_out", layer) in present) or (("__fattn__", layer) in present):
                _keep_unknown(out, name, arr)
                continue
            a = _squeeze_batch(a, 3)
            a = a.transpose(1, 0, 2).reshape(a.shape[1], -1)
            note = f"{name} heads concatenated"
        elif base == "__fattn__":
            a = _squeeze_batch(a, 3)
            a = a.reshape(a.shape[0], -1)
            note = f"{name} heads concatenated"
        else:
            a = _squeeze_batch(a, _ndim(ours))
        _put(out, ours, a, name, note)
    return out


def _scale_and_mask(kq, head_dim, positions):
    """llama.cpp's kq (n_head, n_q, n_kv), unscaled and unmasked -> our attn_scores."""
    kq = np.asarray(kq, np.float32)
    n_q, n_kv = kq.shape[-2], kq.shape[-1]
    pos = np.arange(n_q) if positions is None else np.asarray(positions).reshape(-1)[-n_q:]
    scores = kq * np.float32(1.0 / math.sqrt(head_dim))
    mask = np.arange(n_kv)[None, :] > pos[:, None]
    return np.where(mask[None], np.float32(-np.inf), scores).astype(np.float32)


def to_llamacpp(trace, n_layer=None, kv_pad=None, last_row_only=False):
    """Fabricate llama.cpp eval-callback dumps for the same pass: a list of (name, array) in
    graph order, each array in the NumPy view of ggml memory (ne reversed). Qcur/Kcur/Vcur come
    twice (flat, then rope'd / reshaped), kq is raw (attn_scores unscaled, the masked cells
    filled with q_rope . k_rope), kv_pad pads the key axis to a multiple of kv_pad (garbage in kq, zeros in
    kq_soft_max) like llama.cpp's KV cells, and last_row_only keeps only the last token from the
    last layer's ffn_inp on (llama.cpp's inp_out_ids when only the last logits are wanted)."""
    t = _tensors_of(trace)
    n_layer = _n_layer(t) if n_layer is None else int(n_layer)
    out = []

    def put(name, a, last=False):
        a = np.asarray(a)
        out.append((name, a[-1:] if (last and last_row_only) else a))

    def pad(a, fill):
        if not kv_pad:
            return a
        n_kv = a.shape[-1]
        total = -(-n_kv // kv_pad) * kv_pad
        extra = np.full(a.shape[:-1] + (total - n_kv,), fill, np.float32)
        return np.concatenate([a, extra], -1)

    if "embed" in t:
        put("inp_embd", t["embed"])
    for L in range(n_layer):
        p = f"blk.{L}."
        g = lambda s: t.get(p + s)            # noqa: E731
        last = L == n_layer - 1
        if g("attn_norm") is not None:
            put(f"attn_norm-{L}", g("attn_norm"))
        for s, base in (("q", "Qcur"), ("k", "Kcur"), ("v", "Vcur")):
            if g(s) is not None:
                a = np.asarray(g(s))
                put(f"{base}-{L}", a.reshape(a.shape[0], -1))
        for s, base in (("q_rope", "Qcur"), ("k_rope", "Kcur"), ("v", "Vcur")):
            if g(s) is not None:
                put(f"{base}-{L}", g(s))
        if g("attn_scores") is not None and g("q_rope") is not None:
            # unscale the scores; the masked cells get the plain q.k product (llama.cpp masks
            # later, inside the softmax), computed with the standard head mapping
            scores = np.asarray(g("attn_scores"), np.float64)
            q, k = np.asarray(g("q_rope"), np.float64), np.asarray(g("k_rope"), np.float64)
            raw = scores * math.sqrt(q.shape[-1])
            kh = k[:, np.arange(q.shape[1]) // (q.shape[1] // k.shape[1]), :]
            qk = np.einsum("nhd,thd->hnt", q, kh)
            fill = qk if qk.shape == raw.shape else np.zeros_like(raw)
            kq = np.where(np.isfinite(raw), raw, fill).astype(np.float32)
            put(f"kq-{L}", pad(kq, 1e3))
        if g("attn_probs") is not None:
            put(f"kq_soft_max-{L}", pad(np.asarray(g("attn_probs"), np.float32), 0.0))
        if g("attn_out") is not None:
            put(f"kqv_out-{L}", g("attn_out"))
        for s, base in (("resid_mid", "ffn_inp"), ("ffn_norm", "ffn_norm"), ("gate", "ffn_gate"),
                        ("up", "ffn_up"), ("ffn_act", "ffn_swiglu"), ("ffn_out", "ffn_out"),
                        ("resid_out", "l_out")):
            if g(s) is not None:
                put(f"{base}-{L}", g(s), last)
    if "output_norm" in t:
        put("result_norm", t["output_norm"], True)
    if "logits" in t:
        put("result_output", t["logits"], True)
    return out


# --------------------------------------------------------------------------------------------
# Helpers and the documentation table

def _tensors_of(trace):
    tensors = dict(getattr(trace, "tensors", trace))
    logits = getattr(trace, "logits", None)
    if "logits" not in tensors and logits is not None:
        tensors["logits"] = logits
    return tensors


def _n_layer(names):
    layers = [int(m.group(1)) for m in (re.match(r"blk\.(\d+)\.", n) for n in names) if m]
    return max(layers) + 1 if layers else 0


def mapping_table():
    """(our name, HF name, llama.cpp name) for every mapped capture, per layer with L."""
    hf = {v: k for k, v in reversed(list(HF_LAYER.items()))}
    ll = {}
    for k, v in LLAMACPP_LAYER.items():
        for i, sub in enumerate(v if isinstance(v, tuple) else (v,)):
            which = f" ({'2nd' if i else '1st'})" if isinstance(v, tuple) and sub != "v" else ""
            ll.setdefault(sub, f"{k}-L{which}")
    rows = [("embed", "model.embed_tokens, hidden_states[0]", "inp_embd")]
    for sub in LAYER_NAMES + ("gate_silu",):
        h = hf.get(sub)
        h = f"model.layers.L.{h}" if h else ("model.layers.L, hidden_states[L+1]" if sub == "resid_out" else
                                             "attentions[L]" if sub == "attn_probs" else "")
        rows.append((f"blk.L.{sub}", h, ll.get(sub, "")))
    rows += [("output_norm", "model.norm, hidden_states[n_layer]", "result_norm"),
             ("logits", "lm_head", "result_output"), ("argmax", "", "")]
    return rows

"""Every backend op on NumPy arrays, on the CPU or a CUDA GPU.

    import numpy as np, qwencuda as qc
    from qwencuda import kernels as K
    y = K.rmsnorm(x, w, eps=1e-6, device="cuda")
    W = K.Weight(raw, "Q4_K", (rows, cols))            # the stored bytes, as in a GGUF file
    W = K.Weight.from_gguf(f, "blk.0.attn_q.weight")   # or straight from a GGUFFile
    out = K.matmul(W, x, bias=b, device="cuda")         # x (n, cols) -> (n, rows)

Each function runs the very op that the forward pass runs (csrc/engine/backend.h): the CPU engine's C
function for device="cpu", the CUDA kernel (kernels/*.cu) for "cuda" / "cuda:N". A backend is
created once per device and cached (release() frees it); every call uploads its inputs,
runs the op, downloads the outputs and frees its buffers, with the GIL released.

Inputs are converted to float32 / int32 C-contiguous arrays; shapes are checked and a mismatch
raises ValueError naming the argument. Outputs are new arrays owned by the caller.

Numerics of the CUDA backend (tests/test_kernels.py states the tolerances):
  - embed / dequantize decode blocks bit-exactly like gguf.quants.dequantize;
  - matmul with n <= 8 tokens reads the stored blocks (fp32 math); above that it uses cuBLAS
    on tensor cores with f16 inputs (activations rounded to f16) and fp32 accumulation, except
    F32 weights (fp32 GEMM) and BF16 weights (decoded to f32, fp32 GEMM);
  - rope computes angles, sines and cosines in double, like qwencuda.reference;
  - sample follows csrc/engine/sampler.c's chain with the same float/double choices (masses and
    running sums in double), selecting by radix threshold where the host sorts;
  - everything else is fp32.

The fused ops (matmul_add, matmul_multi, matmul_swiglu, rope_kv_store, matmul_qkv_rope, qkv_attention)
compute what their unfused sequences compute, with the same float operations: bit-identical on the CPU, and on CUDA
wherever the GEMV runs (n <= GEMV_MAX_TOKENS); matmul_add's cuBLAS path adds the residual inside
the GEMM (beta = 1), which may round differently from a separate add. matmul_add_swiglu runs the
decode step's o projection and gate/up as the forward pass does: its act may round differently
from matmul_swiglu's on CUDA (the norm's scale applied after the dot products), within the 8-bit
activation error.
"""
from __future__ import annotations

import numpy as np

from . import _core

__all__ = [
    "Weight", "embed", "dequantize", "rmsnorm", "matmul", "rope", "kv_store", "attention",
    "swiglu", "add", "argmax", "sample", "matmul_add", "matmul_add_swiglu", "matmul_multi", "matmul_swiglu",
    "swiglu_down", "rope_kv_store", "matmul_qkv_rope", "qkv_attention", "release", "cuda_mem_info", "cuda_device_info",
    "time_matmul", "GEMV_MAX_TOKENS", "MATMUL_MULTI_MAX",
]

# matmul reads the stored blocks directly (GEMV) up to this many tokens; above, dequant + cuBLAS
GEMV_MAX_TOKENS = _core.GEMV_MAX_TOKENS
# most weights one matmul_multi call takes (q, k and v)
MATMUL_MULTI_MAX = _core.MATMUL_MULTI_MAX

_TYPES = None


def _types():
    global _TYPES
    if _TYPES is None:
        _TYPES = {t["name"]: t for t in _core.type_info()}
    return _TYPES


def _type_entry(type_):
    types = _types()
    if isinstance(type_, (int, np.integer)) and not isinstance(type_, bool):
        for t in types.values():
            if t["value"] == int(type_):
                return t
        raise ValueError(f"unknown weight type value {int(type_)}")
    if not isinstance(type_, str):
        raise TypeError(f"weight type must be a name like 'Q4_K' or its integer value, not {type(type_).__name__}")
    t = types.get(type_.upper())
    if t is None:
        raise ValueError(f"unknown weight type {type_!r} (known: {', '.join(sorted(types))})")
    return t


def _device(device):
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {type(device).__name__}")
    return device


class Weight:
    """A weight matrix as stored in a GGUF file: raw bytes of a block format, shape (rows, cols)
    in NumPy order (rows = output features, cols = input features), y = W @ x.

    raw: the stored bytes: a NumPy array (uint8 rows of blocks, or float32 / float16 / uint16
    (BF16 bits) for the plain types, any shape) or a bytes-like object; type: "Q4_K" or its
    GGML value; shape: (rows, cols). Nothing is decoded or copied beyond making raw contiguous.
    """

    __slots__ = ("raw", "type", "type_value", "shape")

    def __init__(self, raw, type, shape):
        t = _type_entry(type)
        if not t["supported"]:
            raise ValueError(f"weight type {t['name']} is not supported by qwencuda's engines")
        try:
            rows, cols = (int(s) for s in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shape must be (rows, cols), got {shape!r}") from None
        if rows < 1 or cols < 1:
            raise ValueError(f"shape must be positive, got {(rows, cols)}")
        if cols % t["block_size"]:
            raise ValueError(f"{t['name']} rows must be a multiple of {t['block_size']} values, got {cols} columns")
        if isinstance(raw, np.ndarray):
            arr = np.ascontiguousarray(raw)
        else:
            arr = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
        need = rows * (cols // t["block_size"]) * t["type_size"]
        if arr.nbytes != need:
            raise ValueError(f"a {t['name']} weight of shape {(rows, cols)} has {need} bytes, raw has {arr.nbytes}")
        self.raw = arr
        self.type = t["name"]
        self.type_value = t["value"]
        self.shape = (rows, cols)

    @classmethod
    def from_gguf(cls, f, name):
        """The stored tensor `name` of a GGUFFile (zero-copy view of the file)."""
        info = f.tensors[name]
        if len(info.shape) != 2:
            raise ValueError(f"{name} has shape {info.shape}: a weight must be 2-D")
        return cls(f.raw(name), info.type, info.shape)

    @classmethod
    def from_float(cls, w, type):
        """Quantize a float (rows, cols) array into `type` (needs the gguf package; K formats use
        qwencuda.testing's simple quantizer)."""
        from .testing import quantize

        w = np.asarray(w, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"w must be 2-D (rows, cols), got shape {w.shape}")
        name = _type_entry(type)["name"]
        return cls(np.asarray(quantize(w, name)), name, w.shape)

    @property
    def nbytes(self):
        return self.raw.nbytes

    def _arg(self):
        return (self.raw, self.type_value, self.shape[0], self.shape[1])

    def __repr__(self):
        return f"Weight({self.type}, shape={self.shape}, {self.nbytes} bytes)"


def _weight(w):
    if isinstance(w, Weight):
        return w
    if isinstance(w, tuple) and len(w) == 2 and hasattr(w[0], "tensors"):
        return Weight.from_gguf(*w)
    raise TypeError("weight must be a qwencuda.kernels.Weight or a (GGUFFile, tensor name) pair")


def _f32(x, name, ndim=None):
    a = np.ascontiguousarray(x, dtype=np.float32)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    return a


def _cache(x, name):
    """A KV cache argument: float16 stays float16 (an F16 cache), anything else is float32."""
    if isinstance(x, np.ndarray) and x.dtype == np.float16:
        a = np.ascontiguousarray(x)
    else:
        a = np.ascontiguousarray(x, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D (max_ctx, n_head_kv * head_dim), got shape {a.shape}")
    return a


def _i32(x, name, n=None):
    a = np.asarray(x)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be integers, got {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} values do not fit int32")
    a = np.ascontiguousarray(a, dtype=np.int32)
    if n is not None and a.shape[0] != n:
        raise ValueError(f"{name} has {a.shape[0]} values, expected {n}")
    return a


# --------------------------------------------------------------------------------------------
# the ops of csrc/engine/backend.h


def embed(table, ids, device="cpu"):
    """Rows `ids` of the weight table, decoded to float32: (len(ids), cols)."""
    w = _weight(table)
    ids = _i32(ids, "ids")
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError(f"ids must be in [0, {w.shape[0]}), got range [{ids.min()}, {ids.max()}]")
    return _core.kernel_embed(_device(device), w._arg(), ids)


def dequantize(weight, device="cpu"):
    """The whole weight decoded to float32 (rows, cols), by the backend's embed op."""
    return _core.kernel_dequantize(_device(device), _weight(weight)._arg())


def rmsnorm(x, w, eps=1e-6, device="cpu"):
    """x / sqrt(mean(x^2) + eps) * w over the last axis of x (any leading shape)."""
    x = _f32(x, "x")
    w = _f32(w, "w", 1)
    if x.ndim == 0 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"rmsnorm: x's last axis ({x.shape}) must match w ({w.shape[0]})")
    if w.shape[0] == 0:
        raise ValueError(f"rmsnorm: the normalised axis of x {x.shape} is empty (mean of no values)")
    out = _core.kernel_rmsnorm(_device(device), x.reshape(-1, w.shape[0]), w, float(eps))
    return out.reshape(x.shape)


def matmul(weight, x, bias=None, device="cpu"):
    """x @ W.T (+ bias): x (cols,) or (..., cols) -> (rows,) or (..., rows)."""
    w = _weight(weight)
    rows, cols = w.shape
    x = _f32(x, "x")
    if x.ndim == 0 or x.shape[-1] != cols:
        raise ValueError(f"matmul: x's last axis must be the weight's {cols} columns, got shape {x.shape}")
    if bias is not None:
        bias = _f32(bias, "bias", 1)
        if bias.shape[0] != rows:
            raise ValueError(f"matmul: bias has {bias.shape[0]} values, the weight {rows} rows")
    out = _core.kernel_matmul(_device(device), w._arg(), x.reshape(-1, cols), bias)
    return out.reshape(*x.shape[:-1], rows)


def rope(x, pos, theta=1e6, device="cpu"):
    """NEOX rotary embedding of x (tokens, heads, head_dim) at positions pos (tokens,): pairs
    (i, i + head_dim/2) rotated by pos * theta^(-2i/head_dim). Returns a new array."""
    x = _f32(x, "x", 3)
    if x.shape[2] % 2:
        raise ValueError(f"rope: head_dim {x.shape[2]} must be even")
    pos = _i32(pos, "pos", x.shape[0])
    return _core.kernel_rope(_device(device), x, pos, float(theta))


def kv_store(k, v, pos, k_cache, v_cache, device="cpu"):
    """Copies of the caches (max_ctx, kv_dim) with rows pos[t] set to k[t] and v[t]. float16
    caches are F16 caches (the values rounded to nearest even, as numpy's astype), else float32."""
    k = _f32(k, "k", 2)
    v = _f32(v, "v", 2)
    k_cache = _cache(k_cache, "k_cache")
    v_cache = _cache(v_cache, "v_cache")
    if k.shape != v.shape:
        raise ValueError(f"kv_store: k {k.shape} and v {v.shape} differ")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != k.shape[1]:
        raise ValueError(f"kv_store: caches {k_cache.shape}, {v_cache.shape} must be (max_ctx, {k.shape[1]})")
    pos = _i32(pos, "pos", k.shape[0])
    if pos.size and (pos.min() < 0 or pos.max() >= k_cache.shape[0]):
        raise ValueError(f"kv_store: positions must be in [0, {k_cache.shape[0]})")
    return _core.kernel_kv_store(_device(device), k, v, pos, k_cache, v_cache)


def attention(q, k_cache, v_cache, pos, n_head_kv, n_kv=None, scores=False, device="cpu"):
    """Causal GQA attention of q (tokens, n_head, head_dim) over the caches
    (max_ctx, n_head_kv * head_dim): query t attends keys 0..pos[t]; query head h reads KV head
    h // (n_head // n_head_kv); scale 1/sqrt(head_dim). n_kv defaults to max(pos) + 1.

    Returns out (tokens, n_head * head_dim), or with scores=True the tuple (out, scores, probs),
    both (n_head, tokens, n_kv): scaled scores with -inf where masked, and the softmax.

    float16 caches are F16 caches: on CUDA, without scores and for head_dim 64 or 128, the
    tensor-core flash kernels run (q and the probabilities rounded to f16, fp32 accumulation;
    key-split blocks for up to GEMV_MAX_TOKENS queries); with scores, and on the CPU, the exact
    fp32 path over the cache's values."""
    q = _f32(q, "q", 3)
    k_cache = _cache(k_cache, "k_cache")
    v_cache = _cache(v_cache, "v_cache")
    n, n_head, hd = q.shape
    n_head_kv = int(n_head_kv)
    if n_head_kv < 1 or n_head % n_head_kv:
        raise ValueError(f"attention: n_head {n_head} must be a multiple of n_head_kv {n_head_kv}")
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != n_head_kv * hd:
        raise ValueError(f"attention: caches {k_cache.shape}, {v_cache.shape} must be (max_ctx, {n_head_kv * hd})")
    pos = _i32(pos, "pos", n)
    if n and pos.min() < 0:
        raise ValueError("attention: positions must be >= 0")
    if n_kv is None:
        n_kv = int(pos.max()) + 1 if n else 1
    n_kv = int(n_kv)
    if not 1 <= n_kv <= k_cache.shape[0]:
        raise ValueError(f"attention: n_kv {n_kv} must be in [1, {k_cache.shape[0]}] (the cache rows)")
    if n and pos.max() >= n_kv:
        raise ValueError(f"attention: positions must be < n_kv = {n_kv}")
    out, s, p = _core.kernel_attention(_device(device), q, k_cache, v_cache, pos, n_kv, n_head_kv, bool(scores))
    return (out, s, p) if scores else out


def swiglu(gate, up, device="cpu"):
    """silu(gate) * up elementwise, silu(g) = g / (1 + exp(-g)); the result has their shape."""
    shape, up_shape = np.shape(gate), np.shape(up)   # before _f32, which makes 0-d inputs 1-D
    gate = _f32(gate, "gate")
    up = _f32(up, "up")
    if shape != up_shape:
        raise ValueError(f"swiglu: gate {shape} and up {up_shape} differ")
    return _core.kernel_swiglu(_device(device), gate, up).reshape(shape)


def add(a, b, device="cpu"):
    """a + b elementwise (same shapes); the result has their shape."""
    shape, b_shape = np.shape(a), np.shape(b)   # before _f32, which makes 0-d inputs 1-D
    a = _f32(a, "a")
    b = _f32(b, "b")
    if shape != b_shape:
        raise ValueError(f"add: shapes {shape} and {b_shape} differ")
    return _core.kernel_add(_device(device), a, b).reshape(shape)


def argmax(x, device="cpu"):
    """Index of the first largest value of each row: x (cols,) -> int, (n, cols) -> int32 (n,)."""
    x = _f32(x, "x")
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(f"argmax: x must be (cols,) or (rows, cols) with cols > 0, got {x.shape}")
    out = _core.kernel_argmax(_device(device), x.reshape(-1, x.shape[-1]))
    return int(out[0]) if x.ndim == 1 else out


def sample(logits, sampler, device="cpu"):
    """The next token of `sampler` (a qwencuda.Sampler) drawn from one row of logits by the
    backend's sample op: the op a Session runs when it draws on the device. It follows the
    sampler's chain (penalty, top-k, top-p, min-p, temperature) with the sampler's RNG and
    recent tokens, and advances its RNG as sampler.sample(logits) would; the same state gives
    the same token on "cpu" and "cuda" (barring a uniform number within rounding of a boundary).
    Accepting the token (sampler.accept) is up to the caller, as with sampler.sample."""
    x = _f32(logits, "logits")
    if x.ndim == 2 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 1:
        raise ValueError(f"sample: logits must be one row (n_vocab,), got {x.shape}")
    core_sampler = getattr(sampler, "_s", sampler)
    return _core.kernel_sample(_device(device), x, core_sampler)


# --------------------------------------------------------------------------------------------
# fused ops: one pass for what the forward pass would otherwise do in several


def _matmul_x(x, cols, op):
    x = _f32(x, "x")
    if x.ndim == 0 or x.shape[-1] != cols:
        raise ValueError(f"{op}: x's last axis must be the weight's {cols} columns, got shape {x.shape}")
    return x


def _residual_arg(residual, x, rows, op):
    """The residual stream of a matmul_add of x (..., cols) by a weight of rows rows."""
    residual = _f32(residual, "residual")
    if residual.shape != x.shape[:-1] + (rows,):
        raise ValueError(f"{op}: residual must have shape {x.shape[:-1] + (rows,)}, got {residual.shape}")
    return residual


def matmul_add(weight, x, residual, device="cpu", in_place=True):
    """residual + x @ W.T (matmul then add, in one op): x (..., cols), residual (..., rows).

    in_place: the op writes over the residual's backend buffer, as the forward pass does with the
    residual stream (the NumPy residual is never modified); False gives it a separate output."""
    w = _weight(weight)
    rows, cols = w.shape
    x = _matmul_x(x, cols, "matmul_add")
    residual = _residual_arg(residual, x, rows, "matmul_add")
    out = _core.kernel_matmul_add(_device(device), w._arg(), x.reshape(-1, cols), residual.reshape(-1, rows),
                                  bool(in_place))
    return out.reshape(residual.shape)


def matmul_multi(weights, x, biases=None, device="cpu", norm=None, eps=1e-6):
    """(x @ W_i.T + b_i for each weight) in one op: up to MATMUL_MULTI_MAX weights with the same
    columns, each of its own type and rows (q, k and v). biases: None, or one bias (or None) per
    weight. norm: an RMSNorm weight (cols,): x is normalised first with it and eps, exactly as
    rmsnorm(x, norm, eps) would (the attention norm folded into the op). Returns a tuple of
    arrays (..., rows_i)."""
    ws = [_weight(w) for w in weights]
    if not 1 <= len(ws) <= MATMUL_MULTI_MAX:
        raise ValueError(f"matmul_multi: 1 to {MATMUL_MULTI_MAX} weights, got {len(ws)}")
    cols = ws[0].shape[1]
    if any(w.shape[1] != cols for w in ws):
        raise ValueError(f"matmul_multi: the weights' columns differ: {[w.shape for w in ws]}")
    x = _matmul_x(x, cols, "matmul_multi")
    outs = _core.kernel_matmul_multi(_device(device), tuple(w._arg() for w in ws), x.reshape(-1, cols),
                                     _biases(biases, ws, "matmul_multi"), _norm_arg(norm, cols, "matmul_multi"),
                                     float(eps))
    return tuple(o.reshape(*x.shape[:-1], w.shape[0]) for o, w in zip(outs, ws))


def _biases(biases, ws, op):
    """One float32 bias (rows,) or None per weight of ws, as a tuple (None: no biases)."""
    biases = [None] * len(ws) if biases is None else list(biases)
    if len(biases) != len(ws):
        raise ValueError(f"{op}: {len(biases)} biases for {len(ws)} weights")
    for i, (w, b) in enumerate(zip(ws, biases)):
        if b is not None:
            b = biases[i] = _f32(b, f"biases[{i}]", 1)
            if b.shape[0] != w.shape[0]:
                raise ValueError(f"{op}: bias {i} has {b.shape[0]} values, its weight {w.shape[0]} rows")
    return tuple(biases)


def _norm_arg(norm, cols, op):
    if norm is None:
        return None
    norm = _f32(norm, "norm", 1)
    if norm.shape[0] != cols:
        raise ValueError(f"{op}: norm has {norm.shape[0]} values, x rows {cols}")
    return norm


def matmul_swiglu(w_gate, w_up, x, device="cpu", norm=None, eps=1e-6):
    """silu(x @ Wg.T) * (x @ Wu.T) (matmul, matmul, swiglu in one op): gate and up weights of one
    shape (rows, cols), types may differ; x (..., cols) -> (..., rows). norm, eps: as in
    matmul_multi (the feed-forward norm folded into the op)."""
    g, u = _weight(w_gate), _weight(w_up)
    if g.shape != u.shape:
        raise ValueError(f"matmul_swiglu: gate {g.shape} and up {u.shape} differ in shape")
    rows, cols = g.shape
    x = _matmul_x(x, cols, "matmul_swiglu")
    out = _core.kernel_matmul_swiglu(_device(device), g._arg(), u._arg(), x.reshape(-1, cols),
                                     _norm_arg(norm, cols, "matmul_swiglu"), float(eps))
    return out.reshape(*x.shape[:-1], rows)


def matmul_add_swiglu(weight, x, residual, w_gate, w_up, norm, eps=1e-6, device="cpu"):
    """The forward pass's o projection and feed-forward of one layer, as a decode step runs them:
    out = matmul_add(weight, x, residual), told that matmul_swiglu(w_gate, w_up, out, norm=norm)
    comes next (backend.h's norm_next), then that op. Returns (out, act). On CUDA a one-token
    call of a 32-element 8-bit type hands out's normalised 8-bit form from the first op to the
    second, which applies the norm's scale after its dot products: out is matmul_add's, bit for
    bit; act may round differently from matmul_swiglu's, within the 8-bit activation error."""
    w, g, u = _weight(weight), _weight(w_gate), _weight(w_up)
    rows, cols = w.shape
    x = _matmul_x(x, cols, "matmul_add_swiglu")
    residual = _residual_arg(residual, x, rows, "matmul_add_swiglu")
    if g.shape != u.shape or g.shape[1] != rows:
        raise ValueError(f"matmul_add_swiglu: gate {g.shape} and up {u.shape} must be (ffn, {rows})")
    out, act = _core.kernel_matmul_add_swiglu(_device(device), w._arg(), x.reshape(-1, cols),
                                              residual.reshape(-1, rows), g._arg(), u._arg(),
                                              _norm_arg(norm, rows, "matmul_add_swiglu"), float(eps))
    return out.reshape(residual.shape), act.reshape(*x.shape[:-1], g.shape[0])


def swiglu_down(w_gate, w_up, w_down, x, norm=None, eps=1e-6, device="cuda"):
    """The gate/up op of one token with the down projection folded in, as a decode step that
    captures nothing runs it on CUDA (backend.h's swiglu_down; kernels/matmul_swiglu.cu): returns
    (act, down), act = matmul_swiglu(w_gate, w_up, x, norm=norm) (rows,) and down = act @ w_down.T
    (cols,) as the fold adds it up: each block of 32 act values, in 8 bits, times its 32 columns of
    w_down, added in 64-bit fixed point (2^-32) and converted to float32 once. x (cols,) or
    (1, cols). Only where the backend folds these weights (CUDA: gate and up of one of Q4_0, Q5_0,
    Q8_0, a down weight with the 8-bit GEMV, QWENCUDA_DOWN_FOLD not 0 when the kernels' backend was
    made); elsewhere ValueError."""
    g, u, d = _weight(w_gate), _weight(w_up), _weight(w_down)
    rows, cols = g.shape
    x = _matmul_x(x, cols, "swiglu_down")
    act, sums = _core.kernel_swiglu_down(_device(device), g._arg(), u._arg(), d._arg(), x.reshape(-1, cols),
                                         _norm_arg(norm, cols, "swiglu_down"), float(eps))
    return act.reshape(rows), sums.astype(np.float32) * np.float32(2.0 ** -32)


def rope_kv_store(q, k, v, pos, k_cache, v_cache, theta=1e6, device="cpu"):
    """rope of q (tokens, n_head, head_dim) and k (tokens, n_head_kv, head_dim) at pos, then
    kv_store of the rotated k and of v (tokens, n_head_kv, head_dim) into the caches
    (max_ctx, n_head_kv * head_dim), in one op. Returns new arrays (q_rope, k_rope, k_cache,
    v_cache); the inputs are not modified."""
    q = _f32(q, "q", 3)
    k = _f32(k, "k", 3)
    v = _f32(v, "v", 3)
    k_cache = _cache(k_cache, "k_cache")
    v_cache = _cache(v_cache, "v_cache")
    n, _, hd = q.shape
    if hd % 2:
        raise ValueError(f"rope_kv_store: head_dim {hd} must be even")
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != hd:
        raise ValueError(f"rope_kv_store: k {k.shape} and v {v.shape} must be ({n}, n_head_kv, {hd})")
    kv_dim = k.shape[1] * hd
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != kv_dim:
        raise ValueError(f"rope_kv_store: caches {k_cache.shape}, {v_cache.shape} must be (max_ctx, {kv_dim})")
    pos = _i32(pos, "pos", n)
    if pos.size and (pos.min() < 0 or pos.max() >= k_cache.shape[0]):
        raise ValueError(f"rope_kv_store: positions must be in [0, {k_cache.shape[0]})")
    return _core.kernel_rope_kv_store(_device(device), q, k, v, pos, k_cache, v_cache, float(theta))


def matmul_qkv_rope(weights, x, biases, pos, k_cache, v_cache, head_dim, theta=1e6, device="cpu", norm=None,
                    eps=1e-6):
    """matmul_multi of x (tokens, cols) by (wq, wk, wv) with their biases (or None), then
    rope_kv_store of the three outputs at pos, in one op (a decode step's q, k, v, RoPE and cache
    write: one launch on CUDA for one token). norm, eps: as in matmul_multi. Returns new arrays
    (q_rope (tokens, n_head, head_dim), k_rope (tokens, n_head_kv, head_dim), v (same), k_cache,
    v_cache); the inputs are not modified."""
    return _qkv_rope(weights, x, biases, pos, k_cache, v_cache, head_dim, theta, device, norm, eps, 0,
                     "matmul_qkv_rope")


def qkv_attention(weights, x, biases, pos, k_cache, v_cache, head_dim, theta=1e6, device="cpu", norm=None,
                  eps=1e-6, n_kv=None):
    """matmul_qkv_rope, then attention (no scores) of its q over the caches it wrote, n_kv as in
    attention (default max(pos) + 1), in one op: on CUDA, one token whose weights take the 8-bit
    GEMV (head_dim 64 or 128, the split-K attention's contexts) runs one launch, each query head's
    cluster of blocks computing its own q, k and v rows; the same bits as the two ops. Returns
    matmul_qkv_rope's five arrays and att (tokens, n_head * head_dim)."""
    if n_kv is None:
        n_kv = int(np.max(pos)) + 1 if np.size(pos) else 1
    n_kv = int(n_kv)
    if n_kv < 1:
        raise ValueError(f"qkv_attention: n_kv {n_kv} must be positive")
    return _qkv_rope(weights, x, biases, pos, k_cache, v_cache, head_dim, theta, device, norm, eps, n_kv,
                     "qkv_attention")


def _qkv_rope(weights, x, biases, pos, k_cache, v_cache, head_dim, theta, device, norm, eps, n_kv, op):
    """The checks and the call of matmul_qkv_rope and qkv_attention (n_kv > 0)."""
    ws = [_weight(w) for w in weights]
    if len(ws) != 3:
        raise ValueError(f"{op}: three weights (q, k, v), got {len(ws)}")
    cols = ws[0].shape[1]
    hd = int(head_dim)
    if hd <= 0 or hd % 2:
        raise ValueError(f"{op}: head_dim {hd} must be even and positive")
    if any(w.shape[1] != cols for w in ws) or ws[1].shape != ws[2].shape or ws[0].shape[0] % hd or ws[1].shape[0] % hd:
        raise ValueError(f"{op}: weights {[w.shape for w in ws]} must share columns, k and v one shape, "
                         f"rows whole heads of {hd}")
    x = _matmul_x(x, cols, op).reshape(-1, cols)
    biases = _biases(biases, ws, op)
    k_cache = _cache(k_cache, "k_cache")
    v_cache = _cache(v_cache, "v_cache")
    kv_dim = ws[1].shape[0]
    if k_cache.shape != v_cache.shape or k_cache.shape[1] != kv_dim:
        raise ValueError(f"{op}: caches {k_cache.shape}, {v_cache.shape} must be (max_ctx, {kv_dim})")
    n = x.shape[0]
    pos = _i32(pos, "pos", n)
    if pos.size and (pos.min() < 0 or pos.max() >= k_cache.shape[0]):
        raise ValueError(f"{op}: positions must be in [0, {k_cache.shape[0]})")
    if n_kv and not (n_kv <= k_cache.shape[0] and (not pos.size or pos.max() < n_kv)):
        raise ValueError(f"{op}: n_kv {n_kv} must be at most the cache rows {k_cache.shape[0]} and above every "
                         f"position")
    res = _core.kernel_matmul_qkv_rope(_device(device), tuple(w._arg() for w in ws), x, biases, pos, k_cache,
                                       v_cache, hd, float(theta), _norm_arg(norm, cols, op), float(eps), n_kv)
    q, k, v = (a.reshape(n, -1, hd) for a in res[:3])
    return (q, k, v) + tuple(res[3:])


def time_matmul(weight, x, iters=100, device="cpu"):
    """Seconds per call of the backend's matmul on x (n, cols), timed in C between two
    synchronizations after 3 warm-up calls (inputs already on the device; no Python per call).
    Bytes moved per call are at least weight.nbytes, so weight.nbytes / seconds is the
    weight-read bandwidth of a GEMV."""
    w = _weight(weight)
    x = _f32(x, "x")
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"time_matmul: x must be (n, {w.shape[1]}), got {x.shape}")
    return _core.kernel_time_matmul(_device(device), w._arg(), x, int(iters))


def release(device=None):
    """Free the cached backend of `device` (all when None): its stream, cuBLAS handle, scratch."""
    _core.kernel_release(None if device is None else _device(device))


def cuda_mem_info(device=0):
    """(free_bytes, total_bytes) of CUDA device `device` (cudaMemGetInfo); CudaError without one."""
    return _core.cuda_mem_info(int(device))


def cuda_device_info(device=0):
    """dict of CUDA device `device`: mem_clock_khz and bus_width_bits (its peak memory clock and
    bus), peak_bandwidth (bytes/s: 2 transfers a clock over the bus), sm_count and
    compute_capability; CudaError without one."""
    return _core.cuda_device_info(int(device))

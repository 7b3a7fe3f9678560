"""Synthetic Qwen2.5 GGUF files of the real sizes, written at disk speed (benchmarks, memory tests).

    path = qwencuda.synthetic.write_random_model("/tmp/7b.gguf", shape="7B", weight_type="f16")
    qwencuda.synthetic.plan_random_model("14B", "q4_k_m")       # (name, NumPy shape, type) per tensor
    qwencuda.synthetic.memory_needed("72B", "q4_k_m", n_ctx=32768)   # bytes of weights + KV cache

qwencuda.testing.write_model draws float weights and quantizes them in Python: right for tests
(a q8_0 file is a quantization of the f32 one) and for the 0.5B shape, far too slow for 7B F16
(15 GB) or 14B Q4_K_M (9 GB). write_random_model writes well-formed blocks directly instead:

- Quantized matrices: the block's quantized fields are random bytes; its fp16 scale fields are set
  per block to base * u (u uniform in [0.5, 1.5)), and its offset fields (dmin of Q2_K/Q4_K/Q5_K,
  m of Q4_1/Q5_1) to the value that centres the block's values on zero in expectation. base is
  calibrated per type (by dequantizing sample blocks with the gguf package) so that the dequantized
  weights have the std write_model uses: 0.02 for token_embd/output, 1/sqrt(in) for projections.
- F16/BF16/F32 matrices: normal values of that std.
- Norms and q/k/v biases: exactly write_model's values (writer._values: the large Qwen2.5-like
  biases included), F32.
- Metadata and tokenizer: write_model's (testing.write_metadata), vocabulary padded to n_vocab.

Speed: a tensor up to _FRESH_BYTES is drawn fresh from its own RNG stream (seeded by seed and
its name). Larger tensors are cut, chunk by chunk, from a 64 MiB pool of random bytes (or of
normal values of the tensor's std) at offsets drawn from that stream, the scale fields still drawn
per block: random enough for a benchmark or a memory test, and the writing is bound by the disk
(one chunk in memory at a time). The same (shape, weight_type, seed) always gives the same file.

Tensor types: "q4_k_m" follows llama.cpp's Q4_K_M mix (llama-quant.cpp, llama_tensor_get_type):
Q4_K everywhere except output.weight (and token_embd.weight when tied) Q6_K, attn_v and ffn_down
Q6_K in the layers of use_more_bits (the first and last eighth and every third in between), and
llama.cpp's fallback where a row is not whole 256-blocks (Q4_K -> Q5_0, Q6_K -> Q8_0; output Q8_0).
(qwencuda.testing.plan_model instead copies the layer pattern of the real 0.5B file.) Every other
weight type is uniform (llama-quantize --pure), with the same fallbacks.
"""
from __future__ import annotations

import os
import zlib

import numpy as np

from .configs import CONFIGS, WEIGHT_TYPES, _FILE_TYPE, resolve_config
from .writer import _EMBED_STD, _FALLBACK, _block_size, _values, plan_model, write_metadata

__all__ = ["SHAPES", "write_random_model", "plan_random_model", "resolve_shape", "model_bytes",
           "memory_needed"]

# The Qwen2.5 family (config.json of each Qwen/Qwen2.5-*B model). The vocabulary is the embedding's
# row count: 151936 up to 3B, 152064 from 7B on.
_FAMILY = dict(n_ctx_train=32768, rope_theta=1_000_000.0, norm_eps=1e-6)
SHAPES: dict[str, dict] = {
    "0.5B": dict(_FAMILY, n_vocab=151936, dim=896, n_layer=24, n_head=14, n_head_kv=2, ffn_dim=4864, tied=True),
    "1.5B": dict(_FAMILY, n_vocab=151936, dim=1536, n_layer=28, n_head=12, n_head_kv=2, ffn_dim=8960, tied=True),
    "3B": dict(_FAMILY, n_vocab=151936, dim=2048, n_layer=36, n_head=16, n_head_kv=2, ffn_dim=11008, tied=True),
    "7B": dict(_FAMILY, n_vocab=152064, dim=3584, n_layer=28, n_head=28, n_head_kv=4, ffn_dim=18944, tied=False),
    "14B": dict(_FAMILY, n_vocab=152064, dim=5120, n_layer=48, n_head=40, n_head_kv=8, ffn_dim=13824, tied=False),
    "32B": dict(_FAMILY, n_vocab=152064, dim=5120, n_layer=64, n_head=40, n_head_kv=8, ffn_dim=27648, tied=False),
    "72B": dict(_FAMILY, n_vocab=152064, dim=8192, n_layer=80, n_head=64, n_head_kv=8, ffn_dim=29568, tied=False),
}

_FRESH_BYTES = 4 << 20      # tensors up to this size: every byte drawn fresh
_POOL_BYTES = 64 << 20      # the pool larger tensors are cut from
_CHUNK_BYTES = 16 << 20     # bytes generated and written at a time (<= _POOL_BYTES)

# Block layouts (ggml-common.h): bytes per block and its fp16 scale fields as (byte offset,
# factor): the field is set to base * u * factor. Factor 1: a scale d; a positive factor c: a
# dmin (w = d*sc*q - dmin*m) and a negative one -c: an m (w = d*q + m), where c is half the
# largest quant (the midpoint of q), so that each block's values centre on zero in expectation.
_BLOCKS = {
    "Q4_0": (18, ((0, 1.0),)),                      # d, qs[16]
    "Q4_1": (20, ((0, 1.0), (2, -7.5))),            # d, m, qs[16]
    "Q5_0": (22, ((0, 1.0),)),                      # d, qh[4], qs[16]
    "Q5_1": (24, ((0, 1.0), (2, -15.5))),           # d, m, qh[4], qs[16]
    "Q8_0": (34, ((0, 1.0),)),                      # d, qs[32]
    "Q2_K": (84, ((80, 1.0), (82, 1.5))),           # scales[16], qs[64], d, dmin
    "Q3_K": (110, ((108, 1.0),)),                   # hmask[32], qs[64], scales[12], d
    "Q4_K": (144, ((0, 1.0), (2, 7.5))),            # d, dmin, scales[12], qs[128]
    "Q5_K": (176, ((0, 1.0), (2, 15.5))),           # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (210, ((208, 1.0),)),                   # ql[128], qh[64], scales[16], d
}
_FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}   # BF16: the upper float32 half


def resolve_shape(shape) -> dict:
    """A name of SHAPES ("7B"), a name of qwencuda.testing.CONFIGS ("tiny-hd64") or a config dict
    -> resolve_config's complete dict."""
    if isinstance(shape, str) and shape.upper() in SHAPES:
        return resolve_config(SHAPES[shape.upper()])
    if isinstance(shape, str) and shape not in CONFIGS:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)} and the test configs "
                         f"{', '.join(CONFIGS)}")
    return resolve_config(shape)


def _use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's layers that get more bits in the _M mixes."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _fallback(t: str, row: int) -> str:
    while row % _block_size(t):
        t = _FALLBACK[t]
    return t


def _q4_k_m_type(name: str, layer, n_layer: int, tied: bool, row: int) -> str:
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K" if row % 256 == 0 else "Q8_0"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, n_layer):
        return _fallback("Q6_K", row)
    return _fallback("Q4_K", row)


def plan_random_model(shape="7B", weight_type="q4_k_m", tied=None) -> list[tuple[str, tuple, str]]:
    """The tensors write_random_model writes, in file order: (name, NumPy shape, GGML type)."""
    cfg = resolve_shape(shape)
    tied = cfg["tied"] if tied is None else bool(tied)
    plan = plan_model(cfg, "f32", tied)          # names and shapes, in llama.cpp's file order
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r}; known: {', '.join(WEIGHT_TYPES)}")
    out = []
    for name, np_shape, _ in plan:
        if len(np_shape) == 1:
            out.append((name, np_shape, "F32"))
            continue
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        row = np_shape[-1]
        t = _q4_k_m_type(name, layer, cfg["n_layer"], tied, row) if weight_type == "q4_k_m" else \
            _fallback(weight_type.upper(), row)
        out.append((name, np_shape, t))
    return out


def _nbytes(np_shape, t: str) -> int:
    n = int(np.prod(np_shape))
    if t in _FLOATS:
        return n * np.dtype(_FLOATS[t]).itemsize
    return n // _block_size(t) * _BLOCKS[t][0]


def model_bytes(shape="7B", weight_type="q4_k_m", tied=None) -> int:
    """Bytes of tensor data in the file (= the weights' device memory on CUDA, which keeps matrices
    as stored and norms/biases as float32)."""
    return sum(_nbytes(s, t) for _, s, t in plan_random_model(shape, weight_type, tied))


def memory_needed(shape="7B", weight_type="q4_k_m", n_ctx=32768, kv_type="f16", tied=None) -> dict:
    """GPU memory of a model: {"weights", "kv_cache", "total"} in bytes; kv_cache: K and V of every
    layer for n_ctx positions (n_head_kv * head_dim values each) of kv_type ("f16" or "f32").
    Activations and scratch (tens to hundreds of MB) are not counted."""
    cfg = resolve_shape(shape)
    kv = 2 * cfg["n_layer"] * int(n_ctx) * cfg["n_head_kv"] * cfg["head_dim"] * {"f16": 2, "f32": 4}[kv_type]
    w = model_bytes(cfg, weight_type, tied)
    return {"weights": w, "kv_cache": kv, "total": w + kv}


# --------------------------------------------------------------------------------------------
# Generation

def _std(name: str, row: int) -> float:
    """write_model's std of a matrix (writer._values)."""
    base = name.rsplit(".", 1)[0]
    return _EMBED_STD if base in ("token_embd", "output") else 1.0 / np.sqrt(row)


def _random_bytes(rng, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _set_scales(blocks: np.ndarray, t: str, base: float, rng) -> np.ndarray:
    """Overwrite the scale fields of blocks (n, block_bytes) uint8 in place; returns blocks."""
    u = rng.uniform(0.5, 1.5, blocks.shape[0]).astype(np.float32) * np.float32(base)
    for off, factor in _BLOCKS[t][1]:
        blocks[:, off:off + 2] = (u * np.float32(factor)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks


_RMS1: dict[str, float] = {}


def _rms_at_base_1(t: str) -> float:
    """RMS of the dequantized values of random blocks of type t generated with base 1."""
    if t not in _RMS1:
        import gguf
        rng = np.random.Generator(np.random.PCG64(zlib.crc32(t.encode())))
        bs = _BLOCKS[t][0]
        blocks = _set_scales(_random_bytes(rng, 4096 * bs).reshape(-1, bs).copy(), t, 1.0, rng)
        w = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, t))
        _RMS1[t] = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
    return _RMS1[t]


def _floats(rng, n: int, t: str, std: float) -> np.ndarray:
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.float32(std)
    if t == "BF16":   # round to nearest even on the upper half
        u = x.view(np.uint32)
        return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return x.astype(_FLOATS[t])


class _Pools:
    """The 64 MiB pools large tensors are cut from: random bytes, and normal values per (type, std)."""

    def __init__(self, seed: int):
        self.seed = int(seed) & 0xFFFFFFFF
        self.pools = {}

    def get(self, t: str, std: float) -> np.ndarray:
        key = ("bytes",) if t not in _FLOATS else (t, float(std))
        if key not in self.pools:
            rng = np.random.Generator(np.random.PCG64([self.seed, zlib.crc32(repr(key).encode())]))
            if t in _FLOATS:
                n = _POOL_BYTES // np.dtype(_FLOATS[t]).itemsize
                self.pools[key] = _floats(rng, n, t, std)
            else:
                self.pools[key] = _random_bytes(rng, _POOL_BYTES)
        return self.pools[key]


def _tensor_chunks(name: str, np_shape: tuple, t: str, cfg: dict, seed: int, pools: _Pools):
    """The bytes of one tensor, as a sequence of uint8 / float arrays of at most _CHUNK_BYTES."""
    rng = np.random.Generator(np.random.PCG64([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())]))
    nbytes = _nbytes(np_shape, t)
    if len(np_shape) == 1:
        yield _values(name, np_shape, cfg, seed).astype(np.float32)
        return
    std = _std(name, np_shape[-1])
    fresh = nbytes <= _FRESH_BYTES
    if t in _FLOATS:
        item = np.dtype(_FLOATS[t]).itemsize
        n, step = nbytes // item, _CHUNK_BYTES // item
        pool = None if fresh else pools.get(t, std)
        for i in range(0, n, step):
            m = min(step, n - i)
            if fresh:
                yield _floats(rng, m, t, std)
            else:
                off = int(rng.integers(0, pool.size - m + 1))
                yield pool[off:off + m]
        return
    bs = _BLOCKS[t][0]
    base = std / _rms_at_base_1(t)
    n, step = nbytes // bs, _CHUNK_BYTES // bs
    pool = None if fresh else pools.get(t, std)
    for i in range(0, n, step):
        m = min(step, n - i)
        if fresh:
            raw = _random_bytes(rng, m * bs).copy()
        else:
            off = int(rng.integers(0, pool.size - m * bs + 1))
            raw = pool[off:off + m * bs].copy()
        yield _set_scales(raw.reshape(m, bs), t, base, rng)


def write_random_model(path, shape="7B", weight_type="q4_k_m", seed=0, tied=None, vocab=None,
                       progress=None):
    """Write a Qwen2 GGUF file of the given shape with random well-formed weights; returns path.

    shape: a name of SHAPES ("0.5B" .. "72B"), of qwencuda.testing.CONFIGS, or a config dict.
    weight_type: one of qwencuda.testing.WEIGHT_TYPES; see plan_random_model for each tensor's type.
    tied: as in write_model (None: the shape's own: tied up to 3B).
    vocab: as in write_model (None: make_vocab(n_vocab); False: no tokenizer).
    progress: None, or a callable progress(bytes_written, total_bytes) called after every chunk.
    A failed write removes the partial file.
    """
    import gguf

    cfg = resolve_shape(shape)
    tied = cfg["tied"] if tied is None else bool(tied)
    plan = plan_random_model(cfg, weight_type, tied)
    path = os.fspath(path)
    label = shape if isinstance(shape, str) else "custom"
    w = gguf.GGUFWriter(path, "qwen2")
    write_metadata(w, cfg, f"qwencuda random {label} {weight_type}", _FILE_TYPE[weight_type],
                      seed=seed, vocab=vocab)
    for name, np_shape, t in plan:
        nbytes = _nbytes(np_shape, t)
        qt = getattr(gguf.GGMLQuantizationType, t)
        if t in ("F32", "F16"):
            w.add_tensor_info(name, np_shape, np.dtype(_FLOATS[t]), nbytes)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = (*np_shape[:-1], np_shape[-1] // block * type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    total = sum(_nbytes(s, t) for _, s, t in plan)
    done = 0
    pools = _Pools(seed)
    ok = False
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0] if isinstance(w.fout, list) else w.fout
        for name, np_shape, t in plan:
            w.write_padding(fout, fout.tell())     # each tensor starts aligned
            written = 0
            for chunk in _tensor_chunks(name, np_shape, t, cfg, seed, pools):
                fout.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                written += chunk.nbytes
                done += chunk.nbytes
                if progress is not None:
                    progress(done, total)
            assert written == _nbytes(np_shape, t), (name, written)
            w.write_padding(fout, written)
        ok = True
    finally:
        w.close()
        if not ok:
            try:
                os.remove(path)
            except OSError:
                pass
    return path

"""Quantization of float weights into GGUF block formats: the `gguf` package's quantizers for BF16
and the legacy formats; the K-quants by a simple min/max quantizer per sub-block whose output
round-trips through `gguf.quants.dequantize`."""
from __future__ import annotations


import numpy as np

# Quantization

_QK_K = 256


def _qtype(name: str):
    return getattr(_gguf().GGMLQuantizationType, name.upper())


def _gguf():
    import gguf
    return gguf


def _f16(a):
    """Round to float16 and back to float32 (scales stored in fp16)."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _div(a, b):
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(np.shape(a), np.shape(b)), np.float32),
                     where=(b != 0))


def _asym(blocks, sub, qmax, smax):
    """Per sub-block min/max quantization x ~ d*sc*q - dmin*m with q in 0..qmax, sc, m in 0..smax."""
    xs = blocks.reshape(blocks.shape[0], -1, sub)
    lo = np.minimum(xs.min(-1), 0.0)
    scale = (xs.max(-1) - lo) / qmax
    mn = -lo
    d = _f16(scale.max(-1) / smax)
    dmin = _f16(mn.max(-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, smax)
    m = np.clip(np.rint(_div(mn, dmin[:, None])), 0, smax)
    q = np.clip(np.rint(_div(xs + (dmin[:, None] * m)[..., None], (d[:, None] * sc)[..., None])), 0, qmax)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _sym(blocks, sub, nneg, smax):
    """Per sub-block symmetric quantization x ~ d*sc*q with q in -nneg..nneg-1, sc in -smax..smax;
    the value of largest magnitude maps to -nneg."""
    xs = blocks.reshape(blocks.shape[0], -1, sub)
    idx = np.abs(xs).argmax(-1)[..., None]
    scale = -np.take_along_axis(xs, idx, -1)[..., 0] / nneg
    d = _f16(np.abs(scale).max(-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -smax, smax)
    q = np.clip(np.rint(_div(xs, (d[:, None] * sc)[..., None])), -nneg, nneg - 1)
    return d, sc.astype(np.int8), q.astype(np.int16)


def _pack_shifted(q, shape, bits):
    """OR the 'bits'-bit fields q (n, groups, k, w) shifted by bits*k -> (n, groups*w) bytes."""
    q = q.reshape(shape).astype(np.uint8)
    out = np.zeros((shape[0], shape[1], shape[3]), np.uint8)
    for k in range(shape[2]):
        out |= q[:, :, k, :] << np.uint8(bits * k)
    return out.reshape(shape[0], -1)


def _pack_scale_min_k4(sc, m):
    """Q4_K/Q5_K's 12-byte packing of eight 6-bit scales and eight 6-bit mins."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _h(d):
    return d.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _quant_k(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Encode (n, 256) float32 blocks as K-quant blocks (n, type_size) uint8."""
    n = blocks.shape[0]
    if kind == "Q2_K":  # scales[16] qs[64] d dmin
        d, dmin, sc, m, q = _asym(blocks, 16, 3, 15)
        return np.concatenate([sc | (m << 4), _pack_shifted(q, (n, 2, 4, 32), 2), _h(d), _h(dmin)], 1)
    if kind == "Q3_K":  # hmask[32] qs[64] scales[12] d
        d, sc, q = _sym(blocks, 16, 4, 31)
        u = (q + 4).astype(np.uint8)
        s6 = (sc.astype(np.int16) + 32).astype(np.uint8)
        scales = np.zeros((n, 12), np.uint8)
        scales[:, 0:8] = (s6[:, 0:8] & 0xF) | ((s6[:, 8:16] & 0xF) << 4)
        scales[:, 8:12] = _pack_shifted((s6 >> 4) & 3, (n, 1, 4, 4), 2)
        return np.concatenate([_pack_shifted(u >> 2, (n, 1, 8, 32), 1),
                               _pack_shifted(u & 3, (n, 2, 4, 32), 2), scales, _h(d)], 1)
    if kind == "Q4_K":  # d dmin scales[12] qs[128]
        d, dmin, sc, m, q = _asym(blocks, 32, 15, 63)
        return np.concatenate([_h(d), _h(dmin), _pack_scale_min_k4(sc, m),
                               _pack_shifted(q, (n, 4, 2, 32), 4)], 1)
    if kind == "Q5_K":  # d dmin scales[12] qh[32] qs[128]
        d, dmin, sc, m, q = _asym(blocks, 32, 31, 63)
        return np.concatenate([_h(d), _h(dmin), _pack_scale_min_k4(sc, m),
                               _pack_shifted(q >> 4, (n, 1, 8, 32), 1),
                               _pack_shifted(q & 15, (n, 4, 2, 32), 4)], 1)
    if kind == "Q6_K":  # ql[128] qh[64] scales[16] d
        d, sc, q = _sym(blocks, 16, 32, 127)
        u = (q + 32).astype(np.uint8)
        return np.concatenate([_pack_shifted(u & 15, (n, 2, 2, 64), 4),
                               _pack_shifted(u >> 4, (n, 2, 4, 32), 2),
                               sc.view(np.uint8), _h(d)], 1)
    raise ValueError(kind)


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Encode a float32 array (..., row) in a GGML type ("F32", "Q4_K", ...): float32/float16
    arrays for F32/F16, else uint8 (..., bytes_per_row) as GGUFWriter.add_tensor(raw_dtype=) wants."""
    gguf = _gguf()
    type_name = type_name.upper()
    x = np.ascontiguousarray(x, np.float32)
    if type_name == "F32":
        return x
    if type_name == "F16":
        return x.astype(np.float16)
    if type_name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        if x.shape[-1] % _QK_K:
            raise ValueError(f"{type_name} needs rows that are a multiple of {_QK_K}, got {x.shape[-1]}")
        out = _quant_k(x.reshape(-1, _QK_K), type_name)
        return out.reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x, _qtype(type_name))

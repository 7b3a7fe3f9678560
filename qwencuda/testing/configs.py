"""Model configurations of the synthetic files (tiny test shapes, Qwen2.5-0.5B) and the weight types."""
from __future__ import annotations


# Configurations

_BASE = dict(n_ctx_train=4096, rope_theta=1_000_000.0, norm_eps=1e-6, tied=False)

CONFIGS: dict[str, dict] = {
    # CI-sized. dim 64 is not a multiple of 256, ffn 256 is: like the real 0.5B (896 / 4864), K-quant
    # types fall back to legacy types everywhere except ffn_down.
    "tiny": dict(_BASE, n_vocab=400, dim=64, n_layer=2, n_head=4, n_head_kv=2, ffn_dim=256),
    # n_head == n_head_kv (plain multi-head attention)
    "tiny-gqa1": dict(_BASE, n_vocab=400, dim=64, n_layer=2, n_head=4, n_head_kv=4, ffn_dim=256),
    # 7 query heads per KV head, 14 heads and 2 KV heads, as in Qwen2.5-0.5B
    "tiny-gqa7": dict(_BASE, n_vocab=400, dim=224, n_layer=2, n_head=14, n_head_kv=2, ffn_dim=256),
    # head_dim 64 (Qwen2.5-0.5B's); every dimension a multiple of 256: all weight types, no fallback
    "tiny-hd64": dict(_BASE, n_vocab=400, dim=256, n_layer=2, n_head=4, n_head_kv=2, ffn_dim=512),
    # head_dim 128 (Qwen2.5-1.5B/7B); also free of fallbacks
    "tiny-hd128": dict(_BASE, n_vocab=400, dim=256, n_layer=2, n_head=2, n_head_kv=1, ffn_dim=512),
    # an odd (prime) vocabulary size, three layers
    "tiny-oddvocab": dict(_BASE, n_vocab=389, dim=64, n_layer=3, n_head=4, n_head_kv=2, ffn_dim=256),
    # the exact shapes of Qwen2.5-0.5B(-Instruct/-Coder), tied embeddings like the original
    "qwen2.5-0.5b": dict(n_vocab=151936, dim=896, n_layer=24, n_head=14, n_head_kv=2, ffn_dim=4864,
                         n_ctx_train=32768, rope_theta=1_000_000.0, norm_eps=1e-6, tied=True),
}

_CONFIG_KEYS = ("n_vocab", "dim", "n_layer", "n_head", "n_head_kv", "ffn_dim", "n_ctx_train",
                "rope_theta", "norm_eps", "tied")

WEIGHT_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m")

# llama.cpp's general.file_type (LLAMA_FTYPE_*) for each weight type
_FILE_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
              "q2_k": 10, "q3_k": 12, "q4_k": 14, "q4_k_m": 15, "q5_k": 17, "q6_k": 18, "bf16": 32}


def resolve_config(config) -> dict:
    """A config name of CONFIGS or a dict (missing keys from "tiny") -> a complete, checked dict
    with head_dim added."""
    if isinstance(config, str):
        try:
            cfg = dict(CONFIGS[config])
        except KeyError:
            raise ValueError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}") from None
    elif isinstance(config, dict):
        unknown = set(config) - set(_CONFIG_KEYS) - {"head_dim"}
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        cfg = dict(CONFIGS["tiny"], **config)
    else:
        raise TypeError(f"config must be a name or a dict, not {type(config).__name__}")
    for k in ("n_vocab", "dim", "n_layer", "n_head", "n_head_kv", "ffn_dim", "n_ctx_train"):
        cfg[k] = int(cfg[k])
        if cfg[k] <= 0:
            raise ValueError(f"config {k} must be positive, got {cfg[k]}")
    if cfg["dim"] % cfg["n_head"]:
        raise ValueError(f"dim {cfg['dim']} is not a multiple of n_head {cfg['n_head']}")
    if cfg["n_head"] % cfg["n_head_kv"]:
        raise ValueError(f"n_head {cfg['n_head']} is not a multiple of n_head_kv {cfg['n_head_kv']}")
    head_dim = cfg["dim"] // cfg["n_head"]
    if cfg.get("head_dim", head_dim) != head_dim:
        raise ValueError("head_dim must equal dim // n_head in Qwen2")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even (RoPE)")
    cfg["head_dim"] = head_dim
    cfg["rope_theta"] = float(cfg["rope_theta"])
    cfg["norm_eps"] = float(cfg["norm_eps"])
    cfg["tied"] = bool(cfg["tied"])
    if cfg["n_vocab"] < 256 + 3:
        raise ValueError("n_vocab must hold the 256 byte tokens and 3 special tokens")
    return cfg

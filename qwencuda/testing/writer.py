"""The GGUF writer of synthetic models: the tensor plan (types, llama.cpp's fallbacks), random
weights with realistic scales and Qwen2.5-like large q/k biases, the metadata and tokenizer, and
the Qwen2.5 chat template."""
from __future__ import annotations

import os
import zlib

import numpy as np

from .configs import WEIGHT_TYPES, _FILE_TYPE, resolve_config
from .vocab import make_vocab
from .quantize import _gguf, _qtype, quantize

# Chat template: the Qwen2.5 ChatML template, as stored in tokenizer.chat_template of
# Qwen2.5-Coder-0.5B-Instruct's GGUF (written down once from that file).

CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


# --------------------------------------------------------------------------------------------
# Model plan and writer

# llama.cpp's fallback when a row is not a multiple of the block size
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
             "Q4_0": "F16", "Q4_1": "F16", "Q5_0": "F16", "Q5_1": "F16", "Q8_0": "F16", "BF16": "BF16",
             "F16": "F16", "F32": "F32"}

# Q4_K_M: layers whose attn_v and ffn_down get Q6_K instead of Q4_K, as in the real
# Qwen2.5-Coder-0.5B-Instruct Q4_K_M file (24 layers); other depths map onto this pattern.
_Q4KM_MORE_BITS_24 = frozenset({0, 1, 3, 6, 7, 8, 9, 10, 13, 16, 19, 21})


def _block_size(type_name):
    return {"F32": 1, "F16": 1, "BF16": 1}.get(type_name, 256 if type_name.endswith("_K") else 32)


def _type_for(name: str, layer: int | None, n_layer: int, weight_type: str, row: int) -> str:
    """GGML type of a 2-D weight in a file of weight_type; row = ne[0] (in features)."""
    if weight_type == "q4_k_m":
        if name == "output.weight":
            t = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and \
                (layer * 24 // n_layer) in _Q4KM_MORE_BITS_24:
            t = "Q6_K"
        else:
            t = "Q4_K"
    else:
        t = weight_type.upper()
    while row % _block_size(t):
        t = _FALLBACK[t]
    return t


def plan_model(config="tiny", weight_type="f32", tied=None) -> list[tuple[str, tuple, str]]:
    """The tensors write_model writes, in file order: (name, NumPy shape, GGML type name)."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r}; known: {', '.join(WEIGHT_TYPES)}")
    cfg = resolve_config(config)
    tied = cfg["tied"] if tied is None else bool(tied)
    V, D, F, L = cfg["n_vocab"], cfg["dim"], cfg["ffn_dim"], cfg["n_layer"]
    kv = cfg["n_head_kv"] * cfg["head_dim"]

    def w(name, shape, layer=None):
        return (name, shape, _type_for(name, layer, L, weight_type, shape[-1]))

    plan = [w("token_embd.weight", (V, D))]
    for i in range(L):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (D,), "F32"),
            w(p + "attn_q.weight", (D, D), i), (p + "attn_q.bias", (D,), "F32"),
            w(p + "attn_k.weight", (kv, D), i), (p + "attn_k.bias", (kv,), "F32"),
            w(p + "attn_v.weight", (kv, D), i), (p + "attn_v.bias", (kv,), "F32"),
            w(p + "attn_output.weight", (D, D), i),
            (p + "ffn_norm.weight", (D,), "F32"),
            w(p + "ffn_gate.weight", (F, D), i),
            w(p + "ffn_up.weight", (F, D), i),
            w(p + "ffn_down.weight", (D, F), i),
        ]
    plan.append(("output_norm.weight", (D,), "F32"))
    if not tied:
        plan.append(w("output.weight", (V, D)))
    return plan


_EMBED_STD = 0.02
_LOGIT_STD = 2.5  # target std of the logits (the real 0.5B: about 3)


def _values(name: str, shape: tuple, cfg: dict, seed: int) -> np.ndarray:
    """The float32 values of one tensor; its own RNG stream, independent of the weight type."""
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])
    hd = cfg["head_dim"]
    kind = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
    if name.endswith(".bias"):
        heads = shape[0] // hd
        b = rng.standard_normal((heads, hd), dtype=np.float32)

        def big(lo, hi, size):  # magnitudes in [lo, hi), random signs
            return (rng.uniform(lo, hi, size) * rng.choice([-1.0, 1.0], size)).astype(np.float32)
        if kind == "attn_k":
            # large in the two lowest-frequency NEOX pairs of every head, like Qwen2.5
            cols = [hd // 2 - 2, hd // 2 - 1, hd - 2, hd - 1]
            b[:, cols] = big(20, 50, (heads, len(cols)))
        elif kind == "attn_q":
            # tens in two random dimensions per head
            for h in range(heads):
                cols = rng.choice(hd, 2, replace=False)
                b[h, cols] = big(10, 25, 2)
        else:
            # v: small, with one dimension of a few units per head (a large constant v bias would
            # add the same vector to every token's residual and drown the token identity)
            b *= np.float32(0.2)
            for h in range(heads):
                b[h, rng.integers(hd)] = big(2, 4, 1)[0]
        return b.reshape(shape)
    if kind in ("attn_norm", "ffn_norm"):
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if kind == "output_norm":
        scale = _LOGIT_STD / (_EMBED_STD * np.sqrt(cfg["dim"]))
        return (scale * (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))).astype(np.float32)
    if kind in ("token_embd", "output"):
        std = _EMBED_STD
    else:
        std = 1.0 / np.sqrt(shape[-1])
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    return x


def write_metadata(w, cfg: dict, name: str, file_type: int, seed=0, vocab=None, alignment=None):
    """Add the qwen2 metadata of config cfg (resolve_config's dict) and, unless vocab is False,
    the tokenizer and chat template to the gguf.GGUFWriter w (before its header is written).
    file_type: general.file_type (LLAMA_FTYPE_*); seed, vocab, alignment: as in write_model.
    Shared by write_model and qwencuda.synthetic.write_random_model."""
    gguf = _gguf()
    w.add_type("model")
    w.add_name(name)
    w.add_context_length(cfg["n_ctx_train"])
    w.add_embedding_length(cfg["dim"])
    w.add_block_count(cfg["n_layer"])
    w.add_feed_forward_length(cfg["ffn_dim"])
    w.add_head_count(cfg["n_head"])
    w.add_head_count_kv(cfg["n_head_kv"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_file_type(file_type)
    if alignment is not None:
        w.add_custom_alignment(int(alignment))
    if vocab is not False:
        tokens, types, merges, special = make_vocab(cfg["n_vocab"], seed) if vocab is None else vocab
        if len(tokens) != cfg["n_vocab"] or len(types) != len(tokens):
            raise ValueError(f"vocab has {len(tokens)} tokens / {len(types)} types, "
                             f"config n_vocab is {cfg['n_vocab']}")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(list(tokens))
        w.add_token_types(list(types))
        w.add_token_merges(list(merges))
        w.add_eos_token_id(special["<|im_end|>"])
        w.add_pad_token_id(special["<|endoftext|>"])
        w.add_bos_token_id(special["<|endoftext|>"])
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_model(path, config="tiny", weight_type="f32", seed=0, tied=None, vocab=None, alignment=None):
    """Write a synthetic Qwen2 GGUF file and return its path.

    config: a name of CONFIGS or a dict of config keys (missing ones from "tiny").
    weight_type: one of WEIGHT_TYPES (the type of the 2-D weights; see plan_model for the
        per-tensor result including fallbacks). Norms and biases are F32.
    seed: selects the random weights; the same seed gives the same model in every weight type.
    tied: omit output.weight (token_embd.weight is then the lm_head); None: the config's default
        (False for the tiny configs, True for "qwen2.5-0.5b").
    vocab: None for make_vocab(n_vocab, seed), or a (tokens, token_types, merges, special_ids)
        tuple as make_vocab returns it (tokens must have n_vocab entries; special_ids needs
        "<|endoftext|>" and "<|im_end|>"), or False to write no tokenizer metadata.
    alignment: None for GGUF's default 32, or a power of two written as general.alignment
        (1 or 2 put tensor data at odd addresses: readers must not assume aligned blocks).
    """
    gguf = _gguf()
    cfg = resolve_config(config)
    tied = cfg["tied"] if tied is None else bool(tied)
    plan = plan_model(cfg, weight_type, tied)
    path = os.fspath(path)

    w = gguf.GGUFWriter(path, "qwen2")
    write_metadata(w, cfg, f"qwencuda synthetic {config if isinstance(config, str) else 'custom'} {weight_type}",
                   _FILE_TYPE[weight_type], seed=seed, vocab=vocab, alignment=alignment)

    # tensor infos first, then the data one tensor at a time (the 0.5B shapes never sit in memory
    # all at once)
    sizes = {}
    for name, shape, t in plan:
        qt = _qtype(t)
        block, type_size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = int(np.prod(shape)) // block * type_size
        sizes[name] = nbytes
        if t == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        elif t == "F16":
            w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block * type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shape, t in plan:
            data = quantize(_values(name, shape, cfg, seed), t)
            assert data.nbytes == sizes[name], (name, data.nbytes, sizes[name])
            w.write_tensor_data(data)
    finally:
        w.close()
    return path

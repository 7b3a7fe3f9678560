"""Synthetic Qwen2 GGUF models for tests and benchmarks (one job per module: configs, vocab,
quantize, writer, synthetic, asserts; everything public is re-exported here).

    path = qwencuda.testing.write_model("/tmp/tiny.gguf", config="tiny", weight_type="q8_0")

The files are laid out exactly as llama.cpp's converter lays out a Qwen2 model (metadata keys,
tensor names, GGUF shape convention: a weight with NumPy shape (out, in) has ne = [in, out]),
with a working byte-level BPE vocabulary (256 byte tokens, merges learned by a small
deterministic trainer over an embedded English + Python corpus, ChatML special tokens, padding
up to the config's n_vocab) and the Qwen2.5 chat template. Only the `gguf` package and NumPy are
used; nothing here touches qwencuda's C code.

Weights are random with realistic scales (embedding std 0.02, projections std 1/sqrt(in),
RMSNorm weights near 1, output_norm scaled so that logits have a std of a few units like the real
model) and q/k biases that are LARGE (tens) in a few dimensions per head, like Qwen2.5, so a
dropped bias cannot hide: the k bias in the lowest-frequency RoPE dimensions, as in the real
model, the q bias in two random dimensions per head; the v bias is smaller (one dimension of a
few units per head; the real model's are 0.1 to 3). Every tensor draws from its own RNG stream
seeded by (seed, tensor name), so the same seed gives the same underlying model in every weight
type: a q8_0 file is a quantization of the f32 one.

Quantization: the `gguf` package's vectorised quantizers for BF16 and the legacy formats
(Q4_0 .. Q8_0); the K-quants (Q2_K .. Q6_K), which the package can only dequantize, are encoded
here by a simple min/max quantizer per sub-block (not llama.cpp's optimising search) whose output
round-trips through `gguf.quants.dequantize`. Rows whose length is not a multiple of a type's block
size fall back per tensor the way llama.cpp does (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0, legacy -> F16); `plan_model` shows the resulting types. Norms and biases stay F32.

Files of the real Qwen2.5 sizes (0.5B .. 72B) are written at disk speed by
qwencuda.testing.synthetic.write_random_model (random well-formed blocks instead of quantized floats).
"""

from .asserts import assert_matches
from .configs import CONFIGS, WEIGHT_TYPES, _FILE_TYPE, resolve_config
from .vocab import CORPUS, QWEN2_PRETOKENIZER_REGEX, SPECIAL_TOKENS, bytes_to_unicode, hf_tokenizer, make_vocab, pretokenize, train_bpe
from .quantize import quantize
from .writer import CHAT_TEMPLATE, plan_model, write_metadata, write_model

__all__ = ['CONFIGS', 'WEIGHT_TYPES', 'CHAT_TEMPLATE', 'CORPUS', 'write_model', 'make_vocab', 'plan_model', 'resolve_config', 'train_bpe', 'pretokenize', 'bytes_to_unicode', 'quantize', 'hf_tokenizer', 'QWEN2_PRETOKENIZER_REGEX', 'assert_matches', 'write_metadata']

#!/usr/bin/env python3
"""Record llama.cpp's own intermediate tensors on the real model: the outside oracle of
tests/test_llamacpp_layers.py (issue 19). Not run in CI: its output, tests/data/llamacpp_layers.npz
(+ .json), is committed; llama.cpp itself never is.

Recipe (what made the committed files):

    # llama.cpp, CPU build, outside this repository (commit 0c1e570, from llama_cpp_python 0.3.36's
    # vendor/llama.cpp; cmake -B build-cpu -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON; Release)
    python scripts/record_llamacpp_dumps.py \
        --llama-cpp /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        --model ~/.cache/qwencuda/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

What it does:
1. Writes a small C++ program (below, our own code, written to a temporary folder) and compiles it
   against the llama.cpp build: it loads the model on the CPU, tokenizes the prompt with
   llama.cpp's tokenizer, decodes it in ONE batch (positions 0..n-1, logits at every position) with
   an eval callback (ggml_backend_sched_eval_callback, the mechanism of llama.cpp's
   llama-eval-callback tool, which prints only a few values per tensor) that writes EVERY value of
   every graph node of the first and last layers (names "<name>-0", "<name>-<L>") and result_norm,
   as float32, with the node's op, in graph order; and the full logits rows.
   Settings: llama.cpp's defaults (8-bit activations in the quantized matmuls) except flash attention
   off (so that the softmax, kq_soft_max, is a node of its own), an F32 KV cache (its default F16
   cache rounds K, whose values reach tens in layer 0, and moves layer 0's probabilities by up to
   0.09: measured) and 2 threads.
2. Keeps, per prompt, the nodes named in KEEP below (llama.cpp name + op -> qwencuda capture name),
   as float16 (values below 65504, checked; float16's rounding, about 2.3e-4 relative per row as
   measured on attn_norm, sets the floor of the comparisons: 4x below the tightest tolerance of
   tests/test_llamacpp_layers.py and 80x below the effect of the bugs it must catch), and the top
   TOP_K logits (float32 values and ids) at every position.
3. Prints llama.cpp's own noise: each kept node recomputed in float64 from llama.cpp's own recorded
   input of that op and the float32 weights (dequantized by the `gguf` package, the reference's
   loader): the error of one llama.cpp op alone (8-bit activations in its quantized matmuls).
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

PROMPTS = {
    # short code prompt; a sentence; a ChatML prompt with special tokens (larger positions)
    "fibonacci": "def fibonacci(n):\n",
    "france": "The capital of France is",
    "haiku-chat": "<|im_start|>user\nWrite a haiku about GPUs<|im_end|>\n<|im_start|>assistant\n",
}
TOP_K = 32

# (llama.cpp node name pattern, op, occurrence among nodes of that name and op) -> capture name.
# "{L}" is the layer. Occurrence -1: the last one (Qcur-L is named after the matmul, after the bias,
# after the reshape and after RoPE: the ADD is q with bias, the ROPE is q_rope).
KEEP = [
    ("attn_norm-{L}", "MUL", -1, "blk.{L}.attn_norm"),
    ("Qcur-{L}", "ADD", -1, "blk.{L}.q"),
    ("Kcur-{L}", "ADD", -1, "blk.{L}.k"),
    ("Vcur-{L}", "ADD", -1, "blk.{L}.v"),
    ("Qcur-{L}", "ROPE", -1, "blk.{L}.q_rope"),
    ("Kcur-{L}", "ROPE", -1, "blk.{L}.k_rope"),
    ("kq_soft_max-{L}", "SOFT_MAX", -1, "blk.{L}.attn_probs"),
    ("kqv_out-{L}", "CONT", -1, "blk.{L}.attn_out"),
    ("ffn_inp-{L}", "ADD", -1, "blk.{L}.resid_mid"),
    ("ffn_norm-{L}", "MUL", -1, "blk.{L}.ffn_norm"),
    ("ffn_out-{L}", "MUL_MAT", -1, "blk.{L}.ffn_out"),
    ("l_out-{L}", "ADD", -1, "blk.{L}.resid_out"),
]
KEEP_GLOBAL = [("result_norm", "MUL", -1, "output_norm")]
# What is committed (about 400 KB): the whole first layer but ffn_norm (RMSNorm is seen in
# attn_norm), and of the last layer the attention probabilities and the FFN output; the rest of
# KEEP is used only for the noise table.
SAVE = ["blk.0.attn_norm", "blk.0.q", "blk.0.k", "blk.0.v", "blk.0.q_rope", "blk.0.k_rope",
        "blk.0.attn_probs", "blk.0.attn_out", "blk.0.resid_mid", "blk.0.ffn_out", "blk.0.resid_out",
        "blk.{last}.attn_probs", "blk.{last}.ffn_out", "output_norm"]

DUMP_CPP = r'''
// Our own small program against libllama (not llama.cpp code): decode one prompt in one batch and
// write every value of the first and last layers' graph nodes through the eval callback.
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

struct dump_state {
    FILE *f;
    std::string last;                 // "-<n_layer-1>"
    std::map<std::string, int> seen;  // name -> nodes of that name so far
    std::vector<uint8_t> buf;
};

static bool wanted(const dump_state *st, const char *name) {
    if (strcmp(name, "result_norm") == 0) return true;
    const char *dash = strrchr(name, '-');
    return dash && (strcmp(dash, "-0") == 0 || st->last == dash);
}

static bool cb(struct ggml_tensor *t, bool ask, void *ud) {
    dump_state *st = (dump_state *)ud;
    if (ask) return wanted(st, t->name);
    if (!wanted(st, t->name) || (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16)) return true;
    const size_t nbytes = ggml_nbytes(t);
    const uint8_t *data = (const uint8_t *)t->data;
    if (!ggml_backend_buffer_is_host(t->buffer)) {
        st->buf.resize(nbytes);
        ggml_backend_tensor_get(t, st->buf.data(), 0, nbytes);
        data = st->buf.data();
    }
    const int occ = st->seen[t->name]++;
    const char *op = ggml_op_desc(t);
    int32_t hdr[3] = {(int32_t)strlen(t->name), (int32_t)strlen(op), occ};
    fwrite(hdr, sizeof hdr, 1, st->f);
    fwrite(t->name, 1, hdr[0], st->f);
    fwrite(op, 1, hdr[1], st->f);
    int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
    fwrite(ne, sizeof ne, 1, st->f);
    for (int64_t i3 = 0; i3 < ne[3]; i3++)
        for (int64_t i2 = 0; i2 < ne[2]; i2++)
            for (int64_t i1 = 0; i1 < ne[1]; i1++)
                for (int64_t i0 = 0; i0 < ne[0]; i0++) {
                    const size_t o = i3 * t->nb[3] + i2 * t->nb[2] + i1 * t->nb[1] + i0 * t->nb[0];
                    float v = t->type == GGML_TYPE_F16 ? ggml_fp16_to_fp32(*(const ggml_fp16_t *)(data + o))
                                                       : *(const float *)(data + o);
                    fwrite(&v, sizeof v, 1, st->f);
                }
    return true;
}

static void quiet(enum ggml_log_level level, const char *text, void *ud) {
    (void)ud;
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: dump MODEL OUT_PREFIX THREADS PROMPT\n"); return 2; }
    const std::string out = argv[2];
    const int threads = atoi(argv[3]);
    llama_log_set(quiet, NULL);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab *vocab = llama_model_get_vocab(model);
    std::vector<llama_token> ids(4096);
    int n = llama_tokenize(vocab, argv[4], (int)strlen(argv[4]), ids.data(), (int)ids.size(), false, true);
    if (n <= 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
    ids.resize(n);

    dump_state st;
    st.f = fopen((out + ".nodes").c_str(), "wb");
    st.last = "-" + std::to_string(llama_model_n_layer(model) - 1);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512; cp.n_batch = 512; cp.n_ubatch = 512;
    cp.n_threads = threads; cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32; cp.type_v = GGML_TYPE_F32;
    cp.cb_eval = cb; cp.cb_eval_user_data = &st;
    cp.no_perf = true;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx || !st.f) { fprintf(stderr, "cannot create the context\n"); return 1; }

    llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = ids[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0; b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    fclose(st.f);

    const int n_vocab = llama_vocab_n_tokens(vocab);
    FILE *fl = fopen((out + ".logits").c_str(), "wb");
    FILE *fi = fopen((out + ".ids").c_str(), "w");
    for (int i = 0; i < n; i++) {
        fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, fl);
        fprintf(fi, "%d\n", ids[i]);
    }
    fclose(fl); fclose(fi);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
'''


def build(llama_cpp, build_dir, work):
    src = os.path.join(work, "dump.cpp")
    exe = os.path.join(work, "dump")
    with open(src, "w") as f:
        f.write(DUMP_CPP)
    lib = os.path.join(build_dir, "bin")
    cmd = ["g++", "-O2", "-std=c++17", src, "-o", exe,
           "-I", os.path.join(llama_cpp, "include"), "-I", os.path.join(llama_cpp, "ggml", "include"),
           "-L", lib, "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    return exe


def read_nodes(path):
    """-> list of (name, op, occurrence, array in NumPy order (ne reversed))."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    o = 0
    while o < len(data):
        ln, lo, occ = struct.unpack_from("<iii", data, o); o += 12
        name = data[o:o + ln].decode(); o += ln
        op = data[o:o + lo].decode(); o += lo
        ne = struct.unpack_from("<4q", data, o); o += 32
        count = int(np.prod(ne))
        a = np.frombuffer(data, np.float32, count, o).reshape(tuple(reversed(ne))); o += 4 * count
        out.append((name, op, occ, a))
    return out


def squeeze(a, n):
    """llama.cpp node (ne reversed, 4-d) -> the capture's shape for n tokens."""
    a = a.reshape(a.shape[-3:]) if a.shape[0] == 1 else a
    if a.shape[0] == 1:
        a = a[0]
    return a


def select(nodes, n_layer, head_dim, n):
    out = {}
    specs = [(p.format(L=L), op, occ, cap.format(L=L)) for L in (0, n_layer - 1) for p, op, occ, cap in KEEP]
    specs += KEEP_GLOBAL
    for pat, op, occ, cap in specs:
        hits = [a for name, o, _, a in nodes if name == pat and o == op]
        if not hits:
            raise SystemExit(f"no node {pat} with op {op}: the graph changed; nodes: "
                             f"{sorted({(nm, o) for nm, o, _, _ in nodes})}")
        a = squeeze(hits[occ], n)
        if cap.rsplit(".", 1)[-1] in ("q", "k", "v"):     # the bias ADD is (n, heads * head_dim)
            a = a.reshape(n, -1, head_dim)
        if cap.endswith("attn_probs"):          # (n_head, n, n_kv padded) -> the n visible keys
            a = a[:, :n, :n]
        out[cap] = np.ascontiguousarray(a)
    return out


def noise_table(ref, cases, n_layer):
    """llama.cpp's error per op, each op recomputed in float64 from llama.cpp's own recorded input of
    that op (weights: float32, dequantized by the gguf package through qwencuda.reference.load)."""
    W = {k: v.astype(np.float64) for k, v in ref.weights.items()
         if k.startswith(("blk.0.", f"blk.{n_layer - 1}.", "output_norm", "token_embd"))}
    c = ref.config
    eps, hd, grp = c.norm_eps, c.head_dim, c.n_head // c.n_head_kv
    rows = []

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, n):                       # NEOX pairs (i, i + hd/2), theta from the file
        half = hd // 2
        ang = np.arange(n)[:, None] * c.rope_theta ** (-np.arange(half) * 2.0 / hd)
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    for name, case in cases.items():
        d = case["tensors"]
        n = len(case["ids"])
        for L in (0, n_layer - 1):
            p = f"blk.{L}."
            x = {k[len(p):]: v.astype(np.float64) for k, v in d.items() if k.startswith(p)}
            if L == 0:
                emb = W["token_embd.weight"][case["ids"]]
                rows.append((name, p + "attn_norm", rel(x["attn_norm"], rms(emb, W[p + "attn_norm.weight"]))))
            for t in "qkv":
                want = x["attn_norm"] @ W[p + f"attn_{t}.weight"].T + W[p + f"attn_{t}.bias"]
                rows.append((name, p + t, rel(x[t].reshape(n, -1), want)))
            rows.append((name, p + "q_rope", rel(x["q_rope"], rope(x["q"], n))))
            rows.append((name, p + "k_rope", rel(x["k_rope"], rope(x["k"], n))))
            k = np.repeat(x["k_rope"], grp, axis=1)                    # (n, n_head, hd)
            s = np.einsum("ihd,jhd->hij", x["q_rope"], k) / np.sqrt(hd)
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            rows.append((name, p + "attn_probs", float(np.abs(x["attn_probs"] - pr).max())))
            v = np.repeat(x["v"], grp, axis=1)
            ao = np.einsum("hij,jhd->ihd", x["attn_probs"], v).reshape(n, -1)
            rows.append((name, p + "attn_out", rel(x["attn_out"], ao)))
            if L == 0:
                rows.append((name, p + "resid_mid", rel(x["resid_mid"], emb + x["attn_out"] @ W[p + "attn_output.weight"].T)))
            rows.append((name, p + "ffn_norm", rel(x["ffn_norm"], rms(x["resid_mid"], W[p + "ffn_norm.weight"]))))
            gate = x["ffn_norm"] @ W[p + "ffn_gate.weight"].T
            up = x["ffn_norm"] @ W[p + "ffn_up.weight"].T
            down = (gate / (1 + np.exp(-gate)) * up) @ W[p + "ffn_down.weight"].T
            rows.append((name, p + "ffn_out", rel(x["ffn_out"], down)))
            rows.append((name, p + "resid_out", rel(x["resid_out"], x["resid_mid"] + x["ffn_out"])))
        last = d[f"blk.{n_layer - 1}.resid_out"].astype(np.float64)
        rows.append((name, "output_norm", rel(d["output_norm"], rms(last, W["output_norm.weight"]))))
        lm = d["output_norm"].astype(np.float64) @ ref.lm_head.T.astype(np.float64)
        top = case["top_ids"]
        rows.append((name, "logits@top (max abs)", float(np.abs(np.take_along_axis(lm, top, 1) - case["top_logits"]).max())))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree")
    ap.add_argument("--build", default=None, help="its CPU build folder (default <llama-cpp>/build-cpu)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data",
                                                  "llamacpp_layers"))
    ap.add_argument("--no-noise", action="store_true", help="skip the noise table (needs the reference)")
    args = ap.parse_args()
    build_dir = args.build or os.path.join(args.llama_cpp, "build-cpu")
    commit = "unknown"
    info = os.path.join(build_dir, "common", "build-info.cpp")
    if os.path.exists(info):
        for line in open(info):
            if line.startswith("char const * LLAMA_COMMIT"):
                commit = line.split('"')[1]
                break

    import gguf

    fields = gguf.GGUFReader(args.model).fields
    n_layer = int(fields["qwen2.block_count"].contents())
    head_dim = int(fields["qwen2.embedding_length"].contents()) // int(fields["qwen2.attention.head_count"].contents())
    cases = {}
    with tempfile.TemporaryDirectory(prefix="qc-llamacpp-") as work:
        exe = build(args.llama_cpp, build_dir, work)
        for name, prompt in PROMPTS.items():
            pre = os.path.join(work, name)
            subprocess.run([exe, args.model, pre, str(args.threads), prompt], check=True)
            ids = [int(x) for x in open(pre + ".ids").read().split()]
            n = len(ids)
            logits = np.fromfile(pre + ".logits", np.float32).reshape(n, -1)
            top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K].astype(np.int32)
            cases[name] = {"prompt": prompt, "ids": ids, "tensors": select(read_nodes(pre + ".nodes"), n_layer, head_dim, n),
                           "top_ids": top, "top_logits": np.take_along_axis(logits, top, 1)}
            print(f"{name}: {n} tokens {ids}")

    arrays = {}
    for name, case in cases.items():
        for cap in SAVE:
            cap = cap.format(last=n_layer - 1)
            a = case["tensors"][cap]
            if np.abs(a).max() >= 65504:
                raise SystemExit(f"{name}/{cap}: |value| {np.abs(a).max()} does not fit float16")
            arrays[f"{name}/{cap}"] = a.astype(np.float16)
        arrays[f"{name}/top_ids"] = case["top_ids"]
        arrays[f"{name}/top_logits"] = case["top_logits"].astype(np.float32)
        arrays[f"{name}/ids"] = np.asarray(case["ids"], np.int32)
    np.savez_compressed(args.out + ".npz", **arrays)
    meta = {
        "source": (f"llama.cpp {commit} (CPU build, GGML_NATIVE) on the real Qwen2.5-Coder-0.5B-Instruct "
                   f"Q4_K_M file, recorded by scripts/record_llamacpp_dumps.py: one batch per prompt, "
                   f"eval-callback dumps of the first and last layers, F32 KV cache, flash attention "
                   f"off, {args.threads} threads; tensors float16, top-{TOP_K} logits float32"),
        "llama_cpp_commit": commit,
        "model": os.path.basename(args.model),
        "model_bytes": os.path.getsize(args.model),
        "prompts": {k: v["prompt"] for k, v in cases.items()},
        "names": {f"{p}/{op}": cap for p, op, _, cap in KEEP + KEEP_GLOBAL},
        "top_k": TOP_K,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}.npz ({os.path.getsize(args.out + '.npz')} bytes) and .json")

    if not args.no_noise:
        from qwencuda import reference as R

        ref = R.load(args.model)
        print("llama.cpp's own error per op (relative L2 vs float64 from its own inputs; attn_probs and "
              "logits: max abs):")
        for name, cap, e in noise_table(ref, cases, n_layer):
            print(f"  {name:12s} {cap:22s} {e:.2e}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Record llama.cpp's greedy continuation after long prompts on the real model: the oracle of
tests/test_long_context.py's depth parity (issue 13). Not run in CI: its output,
tests/data/llamacpp_depth.json, is committed; llama.cpp itself never is.

Recipe (what made the committed file; run on the GPU machine):

    # llama.cpp built outside this repository with CUDA and shared libraries:
    #   cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON
    python scripts/record_llamacpp_depth.py --llama-cpp DIR --build DIR/build --model MODEL.gguf \
        --text tests/data/depth_prompt.txt --lengths 4096 16384 30000 --gen 16 \
        --out tests/data/llamacpp_depth.json

What it does: writes a small C++ program (our own code, below) to a temporary folder and compiles
it against the llama.cpp build. The program tokenizes the text with llama.cpp's tokenizer (no BOS;
special tokens parsed), and for each length N: a fresh context of N + gen positions with
llama.cpp's defaults (every layer on the GPU, flash attention on auto, an F16 KV cache), the first
N tokens decoded in batches of 2048, then `gen` greedy steps, each recording the chosen id and the
gap between llama.cpp's two largest logits (near-ties are not asserted by the test).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile

GREEDY_CPP = r'''
// Our own small program against libllama: greedy continuation after the first N tokens of a text.
#include "llama.h"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet(ggml_log_level, const char *, void *) {}

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: greedy MODEL TEXT GEN N...\n"); return 2; }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 999;
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab *vocab = llama_model_get_vocab(model);
    FILE *ft = fopen(argv[2], "rb");
    if (!ft) { fprintf(stderr, "cannot read %s\n", argv[2]); return 1; }
    std::string text;
    char buf[65536];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, ft)) > 0) text.append(buf, got);
    fclose(ft);
    std::vector<llama_token> ids(text.size() + 16);
    int n = llama_tokenize(vocab, text.c_str(), (int)text.size(), ids.data(), (int)ids.size(), false, true);
    if (n <= 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
    ids.resize(n);
    const int gen = atoi(argv[3]);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    printf("{\"n_text_tokens\": %d, \"ids\": [", n);
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", ids[i]);
    printf("], \"cases\": [");
    for (int a = 4; a < argc; a++) {
        const int N = atoi(argv[a]);
        if (N > n) { fprintf(stderr, "the text has only %d tokens\n", n); return 1; }
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = N + gen + 8;
        cp.n_batch = 2048;
        cp.n_ubatch = 512;
        cp.no_perf = true;
        llama_context *ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "cannot create a context of %d\n", N + gen + 8); return 1; }
        for (int i = 0; i < N; i += 2048) {
            const int m = N - i < 2048 ? N - i : 2048;
            if (llama_decode(ctx, llama_batch_get_one(ids.data() + i, m)) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        }
        printf("%s{\"length\": %d, \"generated\": [", a > 4 ? "," : "", N);
        std::vector<float> margins;
        for (int step = 0; step < gen; step++) {
            const float *row = llama_get_logits_ith(ctx, -1);
            int best = 0;
            for (int v = 1; v < n_vocab; v++) if (row[v] > row[best]) best = v;
            float second = -INFINITY;
            for (int v = 0; v < n_vocab; v++) if (v != best && row[v] > second) second = row[v];
            margins.push_back(row[best] - second);
            printf("%s%d", step ? "," : "", best);
            llama_token t = best;
            if (step + 1 < gen && llama_decode(ctx, llama_batch_get_one(&t, 1)) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        }
        printf("], \"margins\": [");
        for (size_t i = 0; i < margins.size(); i++) printf("%s%.4f", i ? "," : "", margins[i]);
        printf("]}");
        fflush(stdout);
        llama_free(ctx);
    }
    printf("]}\n");
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source folder (include/, ggml/include/)")
    ap.add_argument("--build", required=True, help="its CMake build folder (bin/ with libllama.so)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 30000])
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--commit", default="unknown", help="llama.cpp commit, for the record")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        src, exe = os.path.join(work, "greedy.cpp"), os.path.join(work, "greedy")
        with open(src, "w") as f:
            f.write(GREEDY_CPP)
        lib = os.path.join(a.build, "bin")
        subprocess.run(["g++", "-O2", "-std=c++17", src, "-o", exe,
                        "-I", os.path.join(a.llama_cpp, "include"), "-I", os.path.join(a.llama_cpp, "ggml", "include"),
                        "-L", lib, "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"], check=True)
        out = subprocess.run([exe, a.model, a.text, str(a.gen)] + [str(n) for n in a.lengths],
                             check=True, capture_output=True, text=True).stdout
    rec = json.loads(out)
    with open(a.model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with open(a.text, "rb") as f:
        text_sha = hashlib.sha256(f.read()).hexdigest()
    data = {
        "source": f"llama.cpp {a.commit}, CUDA backend (every layer on the GPU), its default context "
                  f"settings (flash attention auto, F16 KV cache), prompt decoded in batches of 2048, greedy; "
                  f"margins = top1 - top2 logit; made by scripts/record_llamacpp_depth.py",
        "model_sha256": sha,
        "text": os.path.basename(a.text),
        "text_sha256": text_sha,
        "ids": rec["ids"][:max(a.lengths)],
        "cases": rec["cases"],
    }
    with open(a.out, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    for c in data["cases"]:
        print(f"length {c['length']}: generated {c['generated']} margins {c['margins']}")


if __name__ == "__main__":
    main()

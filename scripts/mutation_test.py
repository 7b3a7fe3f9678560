#!/usr/bin/env python3
"""Mutation testing (issue 19 item 8): inject known engine bugs, one at a time, into a copy of the
C code, rebuild the CPU module there and run a chosen subset of the tests; print which tests
catch each mutant. Every mutant must be caught: exit status 1 if one survives, 2 if a mutation's
anchor text is not found (the code moved: update the list below rather than pass silently).

    python scripts/mutation_test.py                      # every mutant, the default subset
    python scripts/mutation_test.py -m rope_theta_x2 -m top_p_one_more
    python scripts/mutation_test.py -x                   # stop each run at the first failure
    python scripts/mutation_test.py --tests tests/test_kernel_params.py --list

Not run in CI (a build and a test run per mutant). The working tree is copied as it is
(uncommitted and untracked files included, .git and build outputs left out), first built and
tested without a mutant: a test that fails there is reported and not counted as a catch.

A mutant is a list of (file, old, new) edits plus environment variables for its test run; every
occurrence of `old` is replaced and its count must be `count` (default 1).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (what the bug is, [(file, old, new, count)], env)
MUTANTS = {
    "rope_theta_x2": (
        "RoPE theta read from the file, then doubled",
        [("csrc/engine/model.c",
          "    if (!(cfg->rope_theta >= QC_MIN_ROPE_THETA",
          "    cfg->rope_theta *= 2.0f;\n    if (!(cfg->rope_theta >= QC_MIN_ROPE_THETA", 1)], {}),
    "rmsnorm_eps_1e-5": (
        "RMSNorm eps 1e-5 instead of the file's 1e-6",
        [("csrc/engine/model.c",
          "    if (!(cfg->norm_eps > 0.0f) || cfg->norm_eps > 1.0f)",
          "    cfg->norm_eps = 1e-5f;\n    if (!(cfg->norm_eps > 0.0f) || cfg->norm_eps > 1.0f)", 1)], {}),
    "top_p_one_more": (
        "top-p (the default path, no top-k) keeps one token past the one that reaches top_p",
        [("csrc/engine/sampler.c",
          "        if (kept > 0 && acc >= target) break;",
          "        if (kept > 0 && acc - exp((double)v[cand[kept - 1]] - vmax) >= target) break;", 1)], {}),
    "top_k_one_more": (
        "top-k keeps k + 1 tokens",
        [("csrc/engine/sampler.c",
          "        select_best(v, cand, n, st->top_k, wk.heap, cand);\n        n = st->top_k;",
          "        select_best(v, cand, n, st->top_k + 1, wk.heap, cand);\n        n = st->top_k + 1;", 1)], {}),
    "no_qkv_bias": (
        "the q/k/v biases are loaded but never added (NULL bias pointers)",
        [("csrc/engine/model.c",
          "            goto fail;\n    }\n    *out = m;",
          "            goto fail;\n        L->bq = L->bk = L->bv = NULL;\n    }\n    *out = m;", 1)], {}),
    "lm_head_is_embedding": (
        "the lm_head reads token_embd.weight although the file carries output.weight",
        [("csrc/engine/model.c",
          'load_matrix(m, "output.weight", &m->output, err)',
          'load_matrix(m, "token_embd.weight", &m->output, err)', 1)], {}),
    "gqa_wrong_map": (
        "query head h reads KV head h % n_head_kv instead of h / group",
        [("csrc/cpu/cpu_ops.c",
          "const int kvh = h / group;",
          "const int kvh = h % j->n_head_kv; (void)group;", 1)], {}),
    "attn_keys_off_by_one": (
        "attention at position p sees keys 0..p-1 (its own key missing; position 0 keeps key 0)",
        [("csrc/cpu/cpu_ops.c",
          "const int last = j->pos[t];",
          "const int last = j->pos[t] > 0 ? j->pos[t] - 1 : 0;", 1)], {}),
    "no_causal_mask": (
        "attention sees every key of the batch, the future included",
        [("csrc/cpu/cpu_ops.c",
          "const int last = j->pos[t];",
          "const int last = j->n_kv - 1;", 1)], {}),
    "attn_scale_1_over_d": (
        "attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim)",
        [("csrc/cpu/cpu_ops.c",
          "const float scale = 1.0f / sqrtf((float)hd);",
          "const float scale = 1.0f / (float)hd;", 1)], {}),
    "rope_pos_plus_one": (
        "RoPE angles of position p + 1",
        [("csrc/cpu/cpu_ops.c",
          "rope_angles(pos[t], inv_freq, half, c, s);",
          "rope_angles(pos[t] + 1, inv_freq, half, c, s);", 2)], {}),
    "rope_interleaved": (
        "RoPE rotates GPT-J pairs (2i, 2i+1) instead of NEOX pairs (i, i + head_dim/2)",
        [("csrc/cpu/cpu_ops.c",
          "            const float x0 = v[i], x1 = v[i + half];\n"
          "            v[i] = x0 * c[i] - x1 * s[i];\n"
          "            v[i + half] = x0 * s[i] + x1 * c[i];",
          "            const float x0 = v[2 * i], x1 = v[2 * i + 1];\n"
          "            v[2 * i] = x0 * c[i] - x1 * s[i];\n"
          "            v[2 * i + 1] = x0 * s[i] + x1 * c[i];", 1)], {}),
    "missing_residual": (
        "the residual add returns the block's output alone (unfused path: QWENCUDA_NO_FUSION=1)",
        [("csrc/cpu/cpu_ops.c",
          "for (int64_t i = begin; i < end; i++) j->out[i] = j->a[i] + j->b[i];",
          "for (int64_t i = begin; i < end; i++) j->out[i] = j->b[i];", 1)],
        {"QWENCUDA_NO_FUSION": "1"}),
    "swiglu_swapped": (
        "silu(up) * gate instead of silu(gate) * up (unfused path: QWENCUDA_NO_FUSION=1)",
        [("csrc/cpu/cpu_ops.c",
          "j->out[i] = silu_mul(j->a[i], j->b[i]);",
          "j->out[i] = silu_mul(j->b[i], j->a[i]);", 1)],
        {"QWENCUDA_NO_FUSION": "1"}),
}

# The default subset, strongest and fastest first: the outside oracle on the real model (the
# C engine only, with its fast kernels and with its float32 reference ops: the NumPy reference is
# not mutated), the parameter-seeing kernel tests, the sampler's
# kept sets, the engine against the reference on two synthetic shapes, the session.
DEFAULT_TESTS = [
    *(f"tests/test_llamacpp_layers.py::{t}[{d}-{c}]" for d in ("cpu", "cpu:float")
      for t in ("test_layers_match_llamacpp", "test_logits_match_llamacpp")
      for c in ("fibonacci", "france", "haiku-chat")),
    "tests/test_kernel_params.py",
    "tests/test_sampler_filters.py",
    "tests/test_engine_vs_reference.py::test_every_capture_matches_reference",
    "tests/test_engine_vs_reference.py::test_tied_models_match_reference",
    "tests/test_session.py",
]

IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so", "*.o",
                                ".pytest_cache", "notebooks", "bench")


def build(src, log):
    env = dict(os.environ, QWENCUDA_CUDA="0")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"],
                           cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT)
    return r.returncode == 0


def run_tests(src, tests, k, env_extra, stop_first, junit):
    env = dict(os.environ, PYTHONPATH=src, **env_extra)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "-o", "addopts=", *tests]
    if k:
        cmd += ["-k", k]
    if stop_first:
        cmd.append("-x")
    t0 = time.time()
    subprocess.run(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failed, total = [], 0
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            total += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}")
    return failed, total, time.time() - t0


def apply(src, edits, originals):
    for rel, old, new, count in edits:
        path = os.path.join(src, rel)
        text = originals.setdefault(rel, open(path).read())
        found = text.count(old)
        if found != count:
            return f"{rel}: anchor found {found} times, expected {count}: {old.splitlines()[0].strip()!r}"
    for rel, old, new, count in edits:
        with open(os.path.join(src, rel), "w") as f:
            f.write(originals[rel].replace(old, new))
    return None


def restore(src, originals):
    for rel, text in originals.items():
        with open(os.path.join(src, rel), "w") as f:
            f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--mutant", action="append", help="run only these (repeatable)")
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    ap.add_argument("-k", default=None, help="pytest -k expression")
    ap.add_argument("-x", action="store_true", help="stop each run at its first failure (faster; "
                    "names one catching test)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = ap.parse_args()
    if args.list:
        for name, (what, edits, env) in MUTANTS.items():
            print(f"{name:22s} {what}" + (f" [{' '.join(f'{k}={v}' for k, v in env.items())}]" if env else ""))
        return 0
    names = args.mutant or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        ap.error(f"unknown mutants {unknown}; --list shows them")
    k = args.k

    tmp = tempfile.mkdtemp(prefix="qc-mutants-")
    src = os.path.join(tmp, "src")
    status = 0
    try:
        shutil.copytree(ROOT, src, ignore=IGNORE)
        # anchors first: a moved anchor fails before any build
        for name in names:
            originals = {}
            err = apply(src, MUTANTS[name][1], originals)
            restore(src, originals)
            if err:
                print(f"ANCHOR NOT FOUND  {name}: {err}")
                status = 2
        if status:
            return status
        if not build(src, os.path.join(tmp, "build-base.log")):
            print(f"the unmutated copy does not build: {tmp}/build-base.log")
            args.keep = True
            return 2
        base_failed, total, secs = run_tests(src, args.tests, k, {}, False, os.path.join(tmp, "base.xml"))
        print(f"baseline: {total} tests, {len(base_failed)} failing without a mutant ({secs:.0f} s)"
              + "".join(f"\n    {t}" for t in base_failed))
        if total == 0:
            print("no tests ran: check --tests / -k")
            return 2
        envs = {frozenset(v[2].items()) for n, v in MUTANTS.items() if n in names and v[2]}
        base_env = {}
        for env in envs:            # tests that fail only with the mutant's environment
            bf, _, _ = run_tests(src, args.tests, k, dict(env), False, os.path.join(tmp, "base-env.xml"))
            base_env[env] = set(bf)
            if bf:
                print(f"baseline with {dict(env)}: {len(bf)} failing" + "".join(f"\n    {t}" for t in bf))
        survivors = []
        for name in names:
            what, edits, env = MUTANTS[name]
            originals = {}
            apply(src, edits, originals)
            try:
                if not build(src, os.path.join(tmp, f"build-{name}.log")):
                    print(f"{name:22s} does not compile (caught by the compiler): {tmp}/build-{name}.log")
                    args.keep = True
                    continue
                failed, total, secs = run_tests(src, args.tests, k, env, args.x,
                                                os.path.join(tmp, f"{name}.xml"))
            finally:
                restore(src, originals)
            known = set(base_failed) | base_env.get(frozenset(env.items()), set())
            caught = [t for t in failed if t not in known]
            mark = "CAUGHT  " if caught else "SURVIVED"
            print(f"{mark} {name:22s} {what}: {len(caught)} of {total} tests fail ({secs:.0f} s)")
            by_test = {}
            for t in caught:                       # module::function -> parameter ids caught
                by_test.setdefault(t.split("[")[0], []).append(t[len(t.split("[")[0]):])
            for t, ids in by_test.items():
                shown = " ".join(i for i in ids[:4] if i)
                more = f" +{len(ids) - 4}" if len(ids) > 4 else ""
                print(f"           {len(ids):3d}  {t} {shown}{more}")
            if not caught:
                survivors.append(name)
        print(f"\n{len(names) - len(survivors)} of {len(names)} mutants caught"
              + (f"; SURVIVED: {', '.join(survivors)}" if survivors else ""))
        return 1 if survivors else 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

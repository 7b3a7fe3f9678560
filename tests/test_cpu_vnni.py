"""The CPU's VNNI kernel sets (csrc/cpu/simd_vnni.c) and the choice of a set (cpu_simd.c,
QWENCUDA_CPU_KERNELS), issue 17 item 2.

The VNNI sets compute the q8 dot products with vpdpbusd instead of AVX2's vpmaddubsw +
vpmaddwd; the integer of each lane is the same and every float operation is the same, so their
results must equal the AVX2 set's BIT FOR BIT:
  - test_vnni_equals_avx2_bit_for_bit: every q8 kernel type (Q4_0 Q5_0 Q8_0 Q4_K Q6_K), random
    blocks (every bit pattern) and quantized floats, several shapes, 1..8 and 13 tokens; the
    fused ops (matmul_add, matmul_multi with its norm, matmul_swiglu); whole forward passes of
    synthetic models (qwencuda.testing.write_model) of every weight type with a kernel, captures
    of every layer, and a greedy decode. Each set runs in its own process
    (QWENCUDA_CPU_KERNELS is read once). Skipped, with the reason, where the CPU lacks the set.
  - test_emulated_vnni_equals_avx2: the q8 kernels' source (simd_q8_kernels.h, which the VNNI
    sets compile with vpdpbusd) compiled with vpdpbusd replaced by its definition (a scalar
    loop), against the AVX2 kernels in C (Q6_K: the VNNI sets keep AVX2's kernel), on random blocks and
    activation codes (-128..127, zero blocks), every token count: runs on any AVX2 CPU (and under
    ASan/UBSan where the compiler has them), so everything but the instruction itself is
    checked even where the CPU has no VNNI.
  - test_comparison_can_fail: the same comparison between the AVX2 set and the float reference
    ("float") finds the differences of 8-bit activations: the bit-identity test can fail.
  - test_kernel_choice: each value of QWENCUDA_CPU_KERNELS gives the set that the CPU's flags
    (/proc/cpuinfo, the kernel's view: it hides AVX-512 where the OS does not save its state)
    allow, named by build_info()["cpu_kernels"], or, for a set the CPU lacks or an unknown value,
    a ValueError naming the variable from every device="cpu" backend (device="cpu:float" still
    works) and "error: ..." in build_info.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import qwencuda as qc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VNNI_SETS = ("avxvnni", "avx512vnni")
Q8_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
MODEL_TYPES = ("q4_0", "q5_0", "q8_0", "q4_k", "q6_k", "q4_k_m", "f16")
# tiny-hd64: every dimension a multiple of 256 (K types without fallbacks); tiny: dim 64 (the
# K types fall back to legacy ones); tiny-gqa7: dim 224, 7 query heads per KV head
MODEL_CONFIGS = ("tiny-hd64", "tiny", "tiny-gqa7")


def cpu_flags():
    """The CPU's flags from /proc/cpuinfo (empty on a CPU without a flags line, e.g. aarch64),
    or None where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def available_sets():
    """The kernel sets this CPU runs, best first (cpu_simd.h), from its flags; None if unknown."""
    flags = cpu_flags()
    if flags is None:
        return None
    if not {"avx2", "fma", "f16c"} <= flags:
        return []
    sets = []
    if {"avx512f", "avx512vl", "avx512_vnni"} <= flags:
        sets.append("avx512vnni")
    if "avx_vnni" in flags:
        sets.append("avxvnni")
    return sets + ["avx2"]


def run_with(kernels, code, *args, timeout=900):
    """python -c code *args with QWENCUDA_CPU_KERNELS=kernels (None: unset), importing this
    qwencuda."""
    env = dict(os.environ)
    env.pop("QWENCUDA_CPU_KERNELS", None)
    if kernels is not None:
        env["QWENCUDA_CPU_KERNELS"] = kernels
    here = os.path.dirname(os.path.dirname(os.path.abspath(qc.__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------------------------
# the battery of results, computed in one process per kernel set


BATTERY = textwrap.dedent(r"""
    import sys
    import numpy as np
    import qwencuda as qc
    from qwencuda import kernels as K

    # (elements, bytes) of a block, and the byte offsets of its f16 scales (csrc/engine/quants.h)
    BLOCK = {"Q4_0": (32, 18, [0]), "Q5_0": (32, 22, [0]), "Q8_0": (32, 34, [0]),
             "Q4_K": (256, 144, [0, 2]), "Q6_K": (256, 210, [208])}
    SHAPES = [(3, 256), (17, 768), (130, 1024)]
    LEGACY_SHAPES = [(5, 96), (9, 224)]
    TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 13)   # every count of one kernel call (13 = 8 + 5)

    def random_weight(t, rows, cols, seed):
        # random bytes (every code and packed scale) with finite f16 scales
        qk, size, halves = BLOCK[t]
        rng = np.random.default_rng(seed)
        nb = cols // qk
        raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
        for off in halves:
            h = (rng.standard_normal((rows, nb)) * 0.02).astype(np.float16)
            raw[:, :, off:off + 2] = h.view(np.uint8).reshape(rows, nb, 2)
        return K.Weight(raw.reshape(rows, nb * size), t, (rows, cols))

    def activations(n, cols, seed):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x[:, ::37] *= 40.0    # outliers: blocks whose small values round to codes near 0
        x[:, 32:64] = 0.0     # a block of zeros (d = 0)
        return x

    def main(out, models):
        res = {}
        seed = 0
        for t in BLOCK:
            shapes = SHAPES + (LEGACY_SHAPES if BLOCK[t][0] == 32 else [])
            for rows, cols in shapes:
                seed += 1
                w = random_weight(t, rows, cols, seed)
                wf = K.Weight.from_float(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05, t)
                for n in TOKENS:
                    x = activations(n, cols, seed * 100 + n)
                    res[f"matmul/{t}/{rows}x{cols}/n{n}/random"] = K.matmul(w, x)
                    res[f"matmul/{t}/{rows}x{cols}/n{n}/quantized"] = K.matmul(wf, x)
            # the fused ops, with weights of this type (and another type beside it in multi)
            rows, cols = 40, 512
            x = activations(11, cols, seed)
            rng = np.random.default_rng(seed)
            norm = (1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
            wa, wb, wc = (random_weight(t, rows, cols, seed + i) for i in (11, 12, 13))
            other = random_weight("Q8_0" if t != "Q8_0" else "Q4_0", 24, cols, seed + 14)
            resid = rng.standard_normal((11, rows)).astype(np.float32)
            for n in (1, 11):
                res[f"matmul_add/{t}/n{n}"] = K.matmul_add(wa, x[:n], resid[:n], in_place=False)
                biases = [rng.standard_normal(rows).astype(np.float32), None,
                          rng.standard_normal(24).astype(np.float32)]
                for i, o in enumerate(K.matmul_multi([wa, wb, other], x[:n], biases=biases, norm=norm)):
                    res[f"matmul_multi/{t}/n{n}/{i}"] = o
                res[f"matmul_swiglu/{t}/n{n}"] = K.matmul_swiglu(wa, wc, x[:n], norm=norm)
                res[f"matmul_swiglu/{t}/n{n}/nonorm"] = K.matmul_swiglu(wb, wa, x[:n])
        ids = [3, 17, 42, 7, 99, 250, 1, 64, 128, 5, 300]
        for path in models:
            name = path.rsplit("/", 1)[-1]
            with qc.Model(path, device="cpu") as m:
                res[f"forward/{name}/logits"] = m.forward(ids).logits
                tr = m.forward(ids, capture="*", logits="all")
                for k, v in tr.items():
                    res[f"forward/{name}/capture/{k}"] = np.asarray(v)
                s = m.session()
                logits = [s.prefill(ids[:5], logits="all").logits]
                tok = int(np.argmax(logits[-1][-1]))
                for _ in range(4):
                    logits.append(s.step(tok).logits)
                    tok = int(np.argmax(logits[-1][-1]))
                res[f"decode/{name}"] = np.concatenate([np.reshape(l, (-1, l.shape[-1])) for l in logits])
                s.close()
        res["cpu_kernels"] = np.array(qc.build_info()["cpu_kernels"])
        np.savez(out, **res)

    main(sys.argv[1], sys.argv[2:])
""")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("vnni-models")
    return [qc.testing.write_model(str(folder / f"{cfg}-{wt}.gguf"), cfg, wt, seed=3)
            for cfg in MODEL_CONFIGS for wt in MODEL_TYPES]


@pytest.fixture(scope="module")
def battery(models, tmp_path_factory):
    """battery(set) -> {name: array}: BATTERY's results with QWENCUDA_CPU_KERNELS=set (cached)."""
    folder = tmp_path_factory.mktemp("vnni-results")
    done = {}

    def get(kernels):
        if kernels not in done:
            out = str(folder / f"{kernels}.npz")
            r = run_with(kernels, BATTERY, out, *models)
            assert r.returncode == 0, f"QWENCUDA_CPU_KERNELS={kernels}: battery failed:\n{r.stderr[-4000:]}"
            with np.load(out) as z:
                done[kernels] = {k: z[k] for k in z.files}
        return done[kernels]
    return get


def bit_differences(a, b):
    """The names whose arrays differ in any bit (or in shape, or are missing on one side), with
    how much."""
    diffs = []
    for name in sorted(set(a) | set(b)):
        if name == "cpu_kernels":
            continue
        if name not in a or name not in b:
            diffs.append(f"{name}: only in {'first' if name in a else 'second'}")
            continue
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            diffs.append(f"{name}: {x.dtype}{x.shape} against {y.dtype}{y.shape}")
            continue
        if x.dtype.kind == "f":
            bx = x.view(np.dtype(f"u{x.dtype.itemsize}"))
            by = y.view(np.dtype(f"u{y.dtype.itemsize}"))
        else:
            bx, by = x, y
        if not np.array_equal(bx, by):
            n = int(np.count_nonzero(bx != by))
            with np.errstate(invalid="ignore"):   # the masked attention scores are -inf on both sides
                err = np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64))) if x.dtype.kind == "f" else "-"
            diffs.append(f"{name}: {n} of {x.size} values differ (max |diff| {err})")
    return diffs


def _need_set(kernels):
    sets = available_sets()
    if sets is None:
        pytest.skip("no /proc/cpuinfo: the CPU's kernel sets are unknown")
    if kernels not in sets:
        flags = sorted(f for f in (cpu_flags() or ()) if "vnni" in f or f.startswith("avx512"))
        pytest.skip(f"this CPU cannot run the {kernels} set (its VNNI / AVX-512 flags: {flags or 'none'})")


@pytest.mark.parametrize("vnni", VNNI_SETS)
def test_vnni_equals_avx2_bit_for_bit(battery, vnni):
    _need_set(vnni)
    ref, got = battery("avx2"), battery(vnni)
    assert str(ref["cpu_kernels"]).startswith("avx2+fma+f16c,")
    assert str(got["cpu_kernels"]).startswith(f"avx2+fma+f16c+{vnni},"), got["cpu_kernels"]
    kinds = {k.split("/")[0] for k in ref}
    assert {"matmul", "matmul_add", "matmul_multi", "matmul_swiglu", "forward", "decode"} <= kinds
    diffs = bit_differences(ref, got)
    assert not diffs, f"{vnni} differs from avx2 in {len(diffs)} results:\n" + "\n".join(diffs[:40])


def test_comparison_can_fail(battery):
    """The float reference against the AVX2 set: the q8 matmuls differ (8-bit activations), and
    bit_differences finds them; a result set against itself has none."""
    _need_set("avx2")
    ref, flt = battery("avx2"), battery("float")
    assert str(flt["cpu_kernels"]).startswith("portable C")
    diffs = bit_differences(ref, flt)
    for t in Q8_TYPES:
        assert any(d.startswith(f"matmul/{t}/") for d in diffs), t
        assert any(d.startswith(f"matmul_swiglu/{t}/") for d in diffs), t
    assert any(d.startswith("forward/tiny-hd64-q4_k_m.gguf/logits") for d in diffs)
    # and no difference where there is none: a result against itself
    assert bit_differences(ref, dict(ref)) == []


# --------------------------------------------------------------------------------------------
# the VNNI kernels' source with vpdpbusd emulated, against the AVX2 kernels (any AVX2 CPU)


HARNESS = textwrap.dedent(r"""
    #include <immintrin.h>
    #include <stdint.h>
    #include <stdio.h>
    #include <string.h>

    /* vpdpbusd by its definition: each 32-bit lane plus the four products of its unsigned
     * bytes of u by the signed bytes of s */
    static inline __attribute__((target("avx2"), always_inline)) __m256i emu_dpbusd(__m256i acc, __m256i u,
                                                                                   __m256i s) {
        uint8_t ub[32];
        int8_t sb[32];
        int32_t a[8];
        _mm256_storeu_si256((__m256i *)ub, u);
        _mm256_storeu_si256((__m256i *)sb, s);
        _mm256_storeu_si256((__m256i *)a, acc);
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 4; j++) a[i] += (int32_t)ub[4 * i + j] * (int32_t)sb[4 * i + j];
        return _mm256_loadu_si256((const __m256i *)a);
    }

    #include "simd_vnni.c"

    #define QC_Q8_TARGET "avx2,fma,f16c"
    #define QC_Q8_DOT(u, s) emu_dpbusd(_mm256_setzero_si256(), u, s)
    #define QC_Q8(name) name##_emulated
    #include "simd_q8_kernels.h"

    static uint64_t state = 0x9e3779b97f4a7c15ull;
    static uint32_t next(void) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        return (uint32_t)(state >> 32);
    }
    /* a finite half, either sign, exponent 2^-14 .. 2^5 */
    static uint16_t rand_half(void) {
        return (uint16_t)((next() & 0x83ffu) | ((1u + next() % 20u) << 10));
    }
    static float rand_float(void) { return ((float)(next() % 2000001u) - 1000000.0f) * 1e-6f; }

    int main(void) {
        const qc_simd_kernels *avx2 = qc_simd_avx2_kernels();
        const struct { int type, qk, size; int halves[2]; qc_q8_dot_fn emu; } types[] = {
            {QC_TYPE_Q4_0, 32, 18, {0, -1}, q4_0_dot_emulated},
            {QC_TYPE_Q5_0, 32, 22, {0, -1}, q5_0_dot_emulated},
            {QC_TYPE_Q8_0, 32, 34, {0, -1}, q8_0_dot_emulated},
            {QC_TYPE_Q4_K, 256, 144, {0, 2}, q4_K_dot_emulated},
        };
        static uint8_t row[64 * 256];
        static qc_q8_block x[8 * 41];
        long checked = 0, bad = 0;
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            for (int trial = 0; trial < 60; trial++) {
                const int nb = 8 * (1 + trial % 5);          /* 8 .. 40 blocks of 32 */
                const int xs = nb + trial % 2;               /* tokens' blocks apart */
                const int wblocks = nb * 32 / types[ti].qk;
                for (int i = 0; i < wblocks * types[ti].size; i++) row[i] = (uint8_t)next();
                for (int b = 0; b < wblocks; b++)
                    for (int h = 0; h < 2; h++)
                        if (types[ti].halves[h] >= 0) {
                            const uint16_t v = rand_half();
                            memcpy(row + b * types[ti].size + types[ti].halves[h], &v, 2);
                        }
                for (int i = 0; i < 8 * xs; i++) {
                    const int zero = next() % 8 == 0;          /* blocks of zero codes */
                    for (int j = 0; j < 32; j++) x[i].qs[j] = zero ? 0 : (int8_t)next();
                    x[i].d = next() % 16 == 0 ? 0.0f : rand_float() * rand_float();
                    x[i].s = rand_float();
                }
                for (int nt = 1; nt <= 8; nt++) {
                    float a[8], e[8];
                    avx2->q8_dot[types[ti].type](row, x, xs, nt, nb, a);
                    types[ti].emu(row, x, xs, nt, nb, e);
                    checked += nt;
                    if (memcmp(a, e, sizeof(float) * (size_t)nt) != 0) {
                        if (bad < 10)
                            for (int t = 0; t < nt; t++)
                                if (memcmp(&a[t], &e[t], sizeof(float)))
                                    printf("type %d nb %d nt %d token %d: avx2 %.9g emulated vnni %.9g\n",
                                           types[ti].type, nb, nt, t, a[t], e[t]);
                        bad++;
                    }
                }
            }
        }
        /* the sets themselves: the AVX2 set's other kernels (Q6_K's too), VNNI q8 kernels, their names */
        for (int avx512 = 0; avx512 < 2; avx512++) {
            const qc_simd_kernels *k = qc_simd_vnni_kernels(avx2, avx512);
            int same = k->quantize == avx2->quantize && k->f_dot[QC_TYPE_F16] == avx2->f_dot[QC_TYPE_F16] &&
                       k->attn_scores == avx2->attn_scores && k->silu_mul == avx2->silu_mul;
            for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
                same = same && k->q8_dot[types[ti].type] != NULL && k->q8_dot[types[ti].type] != avx2->q8_dot[types[ti].type];
            same = same && k->q8_dot[QC_TYPE_Q6_K] == avx2->q8_dot[QC_TYPE_Q6_K];   /* kept, see simd_vnni.c */
            if (!same || strcmp(k->name, avx512 ? "avx2+fma+f16c+avx512vnni" : "avx2+fma+f16c+avxvnni") != 0) {
                printf("set %d (%s) is not the AVX2 set with VNNI q8 kernels\n", avx512, k->name);
                bad++;
            }
        }
        printf("checked %ld dot products, %ld calls differ\n", checked, bad);
        return bad != 0;
    }
""")

SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


@pytest.mark.parametrize("sanitized", [False, True], ids=["plain", "asan-ubsan"])
def test_emulated_vnni_equals_avx2(tmp_path, sanitized):
    if not os.path.exists(os.path.join(ROOT, "csrc", "cpu", "simd_q8_kernels.h")):
        pytest.skip("the C sources are not next to the tests")
    _need_set("avx2")
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc})")
    src = tmp_path / "harness.c"
    src.write_text(HARNESS)
    exe = str(tmp_path / "harness")
    cmd = [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
           "-I", os.path.join(ROOT, "csrc", "cpu"), "-I", os.path.join(ROOT, "csrc", "engine"),
           str(src), os.path.join(ROOT, "csrc", "cpu", "simd_avx2.c"), "-o", exe, "-lm"]
    if sanitized:
        cmd[1:1] = SAN_FLAGS
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 and sanitized and "sanitize" in r.stderr:
        pytest.skip(f"{cc} cannot build with sanitizers: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, f"harness build failed:\n{r.stderr[-4000:]}"
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1", UBSAN_OPTIONS="print_stacktrace=1")
    r = subprocess.run([exe], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert "calls differ" in r.stdout and " 0 calls differ" in r.stdout, r.stdout


# --------------------------------------------------------------------------------------------
# the choice of a set


CHOICE = textwrap.dedent(r"""
    import json, sys, tempfile, os
    import numpy as np
    import qwencuda as qc
    from qwencuda import kernels as K

    out = {"describe": qc.build_info()["cpu_kernels"]}
    w = K.Weight.from_float(np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64), "Q8_0")
    x = np.linspace(-2, 3, 64, dtype=np.float32).reshape(1, 64)
    for device in ("cpu", "cpu:float"):
        try:
            out[device] = K.matmul(w, x, device=device).tolist()
        except Exception as e:
            out[device] = f"{type(e).__name__}: {e}"
    try:
        with qc.Model(sys.argv[1], device="cpu") as m:
            m.forward([1, 2, 3])
        out["model"] = "ok"
    except Exception as e:
        out["model"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
""")

VALUES = (None, "auto", "avx2", "vnni", "avxvnni", "avx512vnni", "float", "portable", "bogus", "AVX2")


def expected_choice(value, sets):
    """(set name, or "portable C", or None for an error) for QWENCUDA_CPU_KERNELS=value."""
    vnni = [s for s in sets if s != "avx2"]
    if value in (None, "auto"):
        return sets[0] if sets else "portable C"
    if value in ("float", "portable"):
        return "portable C"
    if value == "vnni":
        return vnni[0] if vnni else None
    if value in ("avx2", "avxvnni", "avx512vnni"):
        return value if value in sets else None
    return None


@pytest.fixture(scope="module")
def choice_model(tmp_path_factory):
    pytest.importorskip("gguf")
    return qc.testing.write_model(str(tmp_path_factory.mktemp("vnni-choice") / "tiny.gguf"), "tiny", "q8_0")


@pytest.mark.parametrize("value", VALUES, ids=[str(v) for v in VALUES])
def test_kernel_choice(choice_model, value):
    sets = available_sets()
    if sets is None:
        pytest.skip("no /proc/cpuinfo: the CPU's kernel sets are unknown")
    r = run_with(value, CHOICE, choice_model)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want = expected_choice(value, sets)
    describe = got["describe"]
    forced = value not in (None, "auto")
    if want is None:
        # a clear error, from build_info and from every device="cpu" backend; cpu:float works
        assert describe.startswith(f"error: QWENCUDA_CPU_KERNELS"), describe
        if value in ("bogus", "AVX2"):
            assert "expected auto, avx2, vnni, avxvnni, avx512vnni, float or portable" in describe
        else:
            assert f"QWENCUDA_CPU_KERNELS={value}: this CPU" in describe and "lacks" in describe
        for what in ("cpu", "model"):
            assert isinstance(got[what], str) and got[what].startswith("ValueError: cpu: QWENCUDA_CPU_KERNELS"), got[what]
        assert isinstance(got["cpu:float"], list)
        return
    name = "avx2+fma+f16c" if want == "avx2" else f"avx2+fma+f16c+{want}" if want != "portable C" else want
    assert describe.startswith(name + (" (" if want == "portable C" else ",")), (value, describe)
    if want != "portable C":
        assert "q8 dot products (Q4_0 Q5_0 Q8_0 Q4_K Q6_K)" in describe
        assert ("by vpdpbusd" in describe) == (want != "avx2")
    assert describe.endswith(f"; QWENCUDA_CPU_KERNELS={value}") == forced, describe
    assert got["model"] == "ok"
    assert isinstance(got["cpu"], list) and isinstance(got["cpu:float"], list)
    # the 8-bit activations show in the results where a SIMD set runs, not in the reference
    assert (got["cpu"] == got["cpu:float"]) == (want == "portable C")


def test_this_process_names_its_set():
    """build_info names a set this CPU can run (or the error / choice of QWENCUDA_CPU_KERNELS)."""
    describe = qc.build_info()["cpu_kernels"]
    sets = available_sets()
    if os.environ.get("QWENCUDA_CPU_KERNELS") or sets is None:
        assert describe
        return
    want = sets[0] if sets else None
    if want is None:
        assert describe == "portable C (float32 reference)"
    else:
        assert describe.startswith(("avx2+fma+f16c," if want == "avx2" else f"avx2+fma+f16c+{want},"))

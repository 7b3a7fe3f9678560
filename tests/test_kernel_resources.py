"""What the compiler makes of the decode step's kernels: no local memory in their own code, no spills.

Local memory is memory: a thread stores it and reads it back through L1 and L2. The lm_head's
four-row kernel kept its four row pointers and sums there (qc_gemv_q8_rows_upto4 indexed them with a
run-time row), and ncu counted 3.68M sectors written to L2 by one lm_head of the 0.5B (118 MB, about
97 bytes a thread, for 0.6 MB of logits) while L2 was 87% busy and DRAM at 59% (H200;
bench/results/20261201-3112744-*, addendum). These tests compile the files of the one-token decode
kernels for sm_90 with setup.py's language flags and -O3, keeping the PTX and ptxas's report, and
require of each kernel no ld.local or st.local in its own body and 0 bytes of spills. A stack frame
alone is allowed: the qkv_attention kernel has one of 40 bytes for a function it calls only for
|angle| >= 2^31 (the double sincos's slow argument reduction; a RoPE angle is at most its position).
They need only nvcc (CI has it), no GPU.
"""
import os
import re

import pytest

from engine_util import nvcc_compile, nvcc_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry_bodies(ptx):
    """{kernel name: the PTX of its body} for each .entry (its braces matched; callees are .func)."""
    bodies = {}
    for m in re.finditer(r"\.entry\s+(\S+)\s*\(", ptx):
        i = ptx.index("{", ptx.index(")", m.end()))
        depth = 0
        for k in range(i, len(ptx)):
            depth += {"{": 1, "}": -1}.get(ptx[k], 0)
            if depth == 0:
                bodies[m.group(1)] = ptx[i:k + 1]
                break
    return bodies


def compile_report(source, tmp_path):
    """{mangled kernel name: (local loads and stores in its PTX body, spill store bytes, spill load
    bytes)} of one file, compiled for sm_90."""
    keep = tmp_path / "keep"
    keep.mkdir()
    r = nvcc_compile(ROOT, source, tmp_path / (source + ".o"), "-O3", "-Xptxas", "-v", "-keep", "-keep-dir", str(keep))
    assert r.returncode == 0, r.stderr[-2000:]
    spills = {name: (int(st), int(ld)) for name, st, ld in
              re.findall(r"Function properties for (\S+)\s+\d+ bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads", r.stderr)}
    ptx = "".join(p.read_text() for p in keep.glob("*.ptx"))
    bodies = _entry_bodies(ptx)
    assert bodies and spills, "no PTX entries or no ptxas report"
    return {name: (len(re.findall(r"\b(?:ld|st)\.local\b", body)),) + spills.get(name, (-1, -1))
            for name, body in bodies.items()}


# (file, the mangled names of its one-token decode kernels, how many instantiations at least)
DECODE_KERNELS = [
    ("matmul.cu", r"_Z23qc_gemv_q8_rows4_kernel", 12),          # the lm_head: three types, SH or not, DRAW or not
    ("matmul.cu", r"_Z26qc_gemv_q8_add_norm_kernel", 6),        # the o projection
    ("matmul.cu", r"_Z14qc_gemv_kernelILi\d+ELi1E", 20),        # one token: the down projection, q/k/v
    ("matmul.cu", r"_Z28qc_gemv_q8_split_rows_kernel", 5),     # the down projection, two rows a block
    ("matmul_swiglu.cu", r"_Z30qc_gemv_q8_swiglu_q8out_kernel", 6),   # gate/up
    ("qkv_attention.cu", r"_Z23qc_qkv_attention_kernel", 8),    # the attention norm .. attention: 2 sizes
]


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("source", sorted({f for f, _, _ in DECODE_KERNELS}))
def test_decode_kernels_use_no_local_memory(source, tmp_path):
    report = compile_report(source, tmp_path)
    for f, pattern, at_least in DECODE_KERNELS:
        if f != source:
            continue
        mine = {n: v for n, v in report.items() if re.match(pattern, n)}
        assert len(mine) >= at_least, f"{pattern}: {len(mine)} instantiations in {source}"
        bad = {n: v for n, v in mine.items() if v != (0, 0, 0)}
        assert not bad, f"local loads and stores in the body / spill store bytes / spill load bytes: {bad}"


def test_entry_bodies_see_local_memory():
    """The PTX reader itself: a body's local accesses are found, a callee's are not its caller's."""
    ptx = """.func f() { .local .b8 d[8]; st.local.u64 [d], 1; { .reg .u32 a; } ret; }
.visible .entry k1(.param .u64 p) { .reg .b64 %r; { .reg .u32 b; } ld.local.u64 %r, [%r]; call f; ret; }
.visible .entry k2(.param .u64 p) { call f; ret; }"""
    bodies = _entry_bodies(ptx)
    assert set(bodies) == {"k1", "k2"}
    assert "ld.local" in bodies["k1"] and "local" not in bodies["k2"]

"""scripts/step_stamps.py: its patch applies to the kernels as they are and compiles, and its
reports read a dump correctly (a synthetic one with known times)."""
import pathlib
import re
import shutil
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import step_stamps  # noqa: E402
from engine_util import nvcc_compile, nvcc_path  # noqa: E402


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    tree = tmp_path_factory.mktemp("stamped")
    for d in ("kernels", "csrc/engine"):
        shutil.copytree(ROOT / d, tree / d)
    step_stamps.patch(tree)
    return tree


def test_patch_stamps_every_kernel_and_the_decode_phases(patched):
    names = (patched / "stamp_tags.txt").read_text().split()
    kernels = sum(len(re.findall(r"__global__\s", f.read_text()))
                  for f in (ROOT / "kernels").glob("*.cu"))
    # every __global__ definition has a guard (a declaration would have none: there are none)
    assert len(names) - 1 == kernels
    for n in ("qkv_attention.cu:qc_qkv_attention_kernel", "matmul.cu:qc_gemv_q8_add_norm_kernel",
              "matmul_swiglu.cu:qc_gemv_q8_swiglu_q8out_kernel", "embed.cu:qc_embed_kernel"):
        assert n in names
    guards = sum(f.read_text().count("qc_st_guard qc_st_g_(") for f in (patched / "kernels").glob("*.cu"))
    assert guards == kernels
    assert (patched / "kernels/qc_cuda.cuh").read_text().count("qc_st_mark(") == 3   # definition, 1, 2
    marks = {f: (patched / "kernels" / f).read_text().count("qc_st_mark(") for f in
             ("matmul.cu", "matmul_swiglu.cu", "qkv_attention.cu")}
    assert marks == {"matmul.cu": 7, "matmul_swiglu.cu": 2, "qkv_attention.cu": 3}
    assert "QC_STAMPS" in (patched / "kernels/cuda_backend.cu").read_text()


def test_patch_refuses_a_changed_kernel(tmp_path):
    for d in ("kernels", "csrc/engine"):
        shutil.copytree(ROOT / d, tmp_path / d)
    f = tmp_path / "kernels/matmul_swiglu.cu"
    f.write_text(f.read_text().replace("qc_gemv_q8_row4<T, SH>(four, cols, xq, lane, acc);", "/* gone */"))
    with pytest.raises(SystemExit, match="update step_stamps.py"):
        step_stamps.patch(tmp_path)


def test_decode_runs_the_bench_round(tmp_path, monkeypatch):
    """decode: the bench's round on a model (here a tiny one on the CPU; on the GPU with QC_STAMPS),
    with the prompt's length and the steps it was given (512 tokens unless told)."""
    import qwencuda.bench as bench
    from qwencuda.testing.writer import write_model
    path = write_model(tmp_path / "tiny.gguf", "tiny")
    rounds, one_round = [], bench._one_round

    def seen(model, ids, steps):
        rounds.append((len(ids), steps))
        return one_round(model, ids, steps)

    monkeypatch.setattr(bench, "_one_round", seen)
    step_stamps.decode(str(path), 3, device="cpu")
    step_stamps.decode(str(path), 2, prompt=20, device="cpu")
    assert rounds == [(512, 3), (20, 2)]


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
def test_patched_kernels_compile(patched, tmp_path):
    # the gate/up kernels (guards, the wait's marks, the inner marks) and the backend (the dump)
    for name in ("matmul_swiglu.cu", "cuda_backend.cu"):
        r = nvcc_compile(str(patched), name, tmp_path / (name + ".o"), "-O1")
        assert r.returncode == 0, r.stderr[-3000:]


DT = np.dtype([("tag", "<u4"), ("block", "<u4"), ("nb", "<u4"), ("sm", "<u4"), ("t", "<u8", 8)])


def _dump(tmp_path, patched):
    """Six decode steps of embed, two layers of four kernels, lm_head and argmax: each launch's
    blocks enter 0.5 us before its release, reach the wait 0.4 us before it, are released over
    20 ns, end 1.5 us after it; launches 3 us apart, steps 100 us apart."""
    tags = (patched / "stamp_tags.txt").read_text().split("\n")
    tag = {n.split(":")[1]: i for i, n in enumerate(tags) if ":" in n}
    layer = [("qc_qkv_attention_kernel", 112), ("qc_gemv_q8_add_norm_kernel", 28),
             ("qc_gemv_q8_swiglu_q8out_kernel", 152), ("qc_gemv_kernel", 896)]
    seq = [("qc_embed_kernel", 4)] + layer * 2 + [("qc_gemv_kernel", 320), ("qc_argmax_cluster_kernel", 32)]
    recs, T = [], 1_000_000
    for _ in range(6):
        for name, nb in seq:
            for b in range(nb):
                mark6 = T + 900 if name == "qc_qkv_attention_kernel" else 0
                recs.append((tag[name], b, nb, b % 132, (T - 500, T - 400, T + 10 * (b % 3), T + 1500,
                                                         T + 300, T + 700, mark6, 0)))
            T += 3000
        T += 100_000
    path = tmp_path / "dump"
    np.random.default_rng(0).permutation(np.array(recs, DT)).tofile(path)   # the ring's order is any
    return path, patched / "stamp_tags.txt"


def test_kernels_report(tmp_path, patched, capsys):
    step_stamps.kernels(*_dump(tmp_path, patched))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("5 steps, median 31.5 us")
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out[2:]}
    # count, crit, gap, placed, ready, spread, body, span, early, crit/step
    assert rows["qc_qkv_attention_kernel[112]"] == [10, 3.0, 1.5, -0.5, -0.4, 0.02, 1.49, 1.5, 0.5, 6.0]
    assert rows["qc_gemv_kernel[896]"][:2] == [10, 3.0]
    assert rows["qc_gemv_kernel[320]"][:2] == [5, 3.0]
    assert rows["qc_argmax_cluster_kernel[32]"][1] == 1.5   # the step's last: its own span


def test_layers_report(tmp_path, patched, capsys):
    step_stamps.layers(*_dump(tmp_path, patched))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 + 12   # the step before's argmax, then the step's 11 launches
    first = out[2].split()   # the embed: released 103 us after that argmax, its blocks at the wait 0.4 us before
    assert first[1] == "qc_embed_kernel" and float(first[6]) == 103.0 and float(first[5]) == 102.6   # R0, Y1
    qkv = out[3].split()
    assert qkv[1] == "qc_qkv_attention_kernel" and qkv[2] == "112"
    assert [float(v) for v in qkv[-3:]] == [0.29, 0.69, 0.89]   # marks after each block's release

"""Fuzzing the GGUF reader with seeded random corruptions of a small valid file.

Every corrupted image must either parse cleanly or raise GGUFError: never crash, hang, raise
anything else, or ask for a huge allocation (MemoryError counts as a failure). The loop runs in a
subprocess so that a crash fails this test instead of killing pytest.

QWENCUDA_FUZZ_CASES sets the number of cases per seed (default 6000; the CI budget).
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

import qwencuda  # noqa: E402

CASES = int(os.environ.get("QWENCUDA_FUZZ_CASES", "6000"))

FUZZ = textwrap.dedent(r"""
    import os, random, struct, sys, tempfile
    from qwencuda import _core, GGUFFile, GGUFError

    seed, n, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    data = open(path, "rb").read()
    meta_end = _core._gguf_parse_bytes(data)["data_offset"]
    rng = random.Random(seed)
    INTERESTING = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 31, 32, 33, 255, 256, 2**31, 2**32 - 1,
                   2**32, 2**63 - 1, 2**63, 2**64 - 1, len(data), len(data) - 1, meta_end]
    parsed = rejected = opened = 0
    tmp = tempfile.mkdtemp()

    def corrupt():
        b = bytearray(data)
        for _ in range(rng.choice([1, 1, 1, 2, 3, 8])):
            # most flips hit the header, metadata and tensor table, where the parser works
            end = meta_end if rng.random() < 0.9 else len(b)
            pos = rng.randrange(end)
            r = rng.random()
            if r < 0.35:
                b[pos] = rng.randrange(256)
            elif r < 0.6:
                b[pos] ^= 1 << rng.randrange(8)
            elif r < 0.85:
                width = rng.choice([4, 8])
                v = rng.choice(INTERESTING) % (1 << (8 * width))
                b[pos:pos + width] = v.to_bytes(width, "little")
            elif r < 0.93:
                del b[pos:pos + rng.randrange(1, 16)]
            else:
                b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
        if rng.random() < 0.05:
            del b[rng.randrange(len(b) + 1):]
        return bytes(b)

    for i in range(n):
        b = corrupt()
        try:
            s = _core._gguf_parse_bytes(b)
        except GGUFError as exc:
            assert str(exc), "empty message"
            rejected += 1
            continue
        parsed += 1
        # every tensor of a file that parses can be viewed and (if decodable) decoded
        if parsed % 25 == 1:
            p = os.path.join(tmp, "f.gguf")
            with open(p, "wb") as fh:
                fh.write(b)
            with GGUFFile(p) as f:
                f.metadata
                for name, info in f.tensors.items():
                    r = f.raw(name)
                    assert r.nbytes == info.nbytes, (name, r.nbytes, info.nbytes)
                    try:
                        x = f.tensor(name)
                    except GGUFError:
                        continue
                    assert x.shape == info.shape
            opened += 1
    print(f"fuzz seed {seed}: {n} cases, {parsed} parsed, {rejected} rejected, {opened} opened")
""")


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_uint32("qwen2.block_count", 2)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<|im_end|>"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3])
    w.add_uint64("u64", 7)
    w.add_float64("f64", 0.5)
    w.add_int8("i8", -3)
    w.add_tensor("q8", gguf_quantize(rng.standard_normal((2, 32)).astype(np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.add_tensor("f32", rng.standard_normal((3, 2)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal(4).astype(np.float16))
    raw = rng.integers(0, 256, (1, 144), dtype=np.uint8)
    raw[:, 0:4] = np.array([0.5, 0.25], np.float16).view(np.uint8)
    w.add_tensor("q4k", raw, raw_dtype=T.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _env():
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(qwencuda.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_corruptions_never_crash(small_file, seed):
    r = subprocess.run([sys.executable, "-c", FUZZ, str(seed), str(CASES), small_file],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, f"fuzz process died (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith(f"fuzz seed {seed}: {CASES} cases, "), r.stdout
    # the corruptions must exercise both outcomes, or the fuzzer tests nothing
    parsed = int(line.split(", ")[1].split()[0])
    rejected = int(line.split(", ")[2].split()[0])
    assert parsed > CASES // 50 and rejected > CASES // 4, line


def test_fuzz_harness_detects_a_crash(small_file):
    """The harness fails on a crash (guards against a check that can never fail)."""
    crash = "import ctypes; ctypes.string_at(0)"
    r = subprocess.run([sys.executable, "-c", crash], capture_output=True, env=_env(), timeout=60)
    assert r.returncode != 0

"""Fuzzing the GGUF reader with seeded random corruptions of a small valid file.

Every corrupted image must either parse cleanly or raise GGUFError: never crash, hang, raise
anything else, or ask for a huge allocation (MemoryError counts as a failure). The loop runs in a
subprocess so that a crash fails this test instead of killing pytest.

QWENCUDA_FUZZ_CASES sets the number of cases per seed (default 6000; the CI budget).

The second half (test_model_mutants_*) mutates the structure of a whole synthetic model file in
the ways that once loaded and computed garbage without a word (issue 14): tensor offsets that
alias or shift, tensor types and dimensions changed, general.alignment changed without
re-padding, the tensor count off by one, block_count off, rope.freq_base missing or absurd, bytes
of the tensor table and of metadata keys flipped. Each mutant must be refused (GGUFError or
ModelError), or load and give the original logits bit for bit, or warn (where llama.cpp, too,
loads the file: rope.freq_base missing). QWENCUDA_MUTANTS sets the number (default 3000).
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
MUTANTS = int(os.environ.get("QWENCUDA_MUTANTS", "3000"))

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


# ---------------------------------------------------------------------------------------------
# whole-model mutants: refused, or the original logits, never silently different

MUTATE = textwrap.dedent(r"""
    import math, os, random, struct, sys, tempfile, warnings
    import numpy as np
    import gguf
    import qwencuda as qc
    from qwencuda import GGUFError, ModelError

    seed, n, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    IDS = [1, 7, 42, 3, 99]
    data = open(path, "rb").read()
    r = gguf.GGUFReader(path)
    sizes = {t.value: s for t, s in gguf.GGML_QUANT_SIZES.items()}   # type -> (block, bytes)

    def spans(field):
        # byte ranges of a field's parts, from its offset
        out, at = [], field.offset
        for part in field.parts:
            out.append((at, at + part.nbytes))
            at += part.nbytes
        return out

    tensors = []   # (name, type, ne, table ranges: name, dims, type, offset)
    for t in r.tensors:
        sp = spans(t.field)
        tensors.append(dict(name=t.name, type=int(t.tensor_type), offset=int(t.field.parts[5][0]),
                            ne=[int(x) for x in t.field.parts[3]], name_at=sp[1], dims_at=sp[3],
                            type_at=sp[4][0], offset_at=sp[5][0]))
    kv = {k: spans(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    table = (min(t["name_at"][0] for t in tensors) - 8, max(t["offset_at"] for t in tensors) + 8)

    def bytes_per(ty, ne0):
        b = sizes.get(ty)
        return None if b is None or ne0 % b[0] else ne0 // b[0] * b[1]

    def same_size_swap(t, ty):
        # a type of the same block bytes (F16/BF16, Q4_0/Q4_K, Q5_0/Q5_K over 256 elements)
        # describes a different, valid file: no reader can tell, so the fuzzer does not draw it
        a, b = bytes_per(t["type"], t["ne"][0]), bytes_per(ty, t["ne"][0])
        return a is not None and a == b

    def put(b, at, fmt, v):
        b[at:at + struct.calcsize(fmt)] = struct.pack(fmt, v)

    def mutate(rng):
        b = bytearray(data)
        kind = rng.choice(["offset_alias", "offset_shift", "type", "dims", "alignment",
                           "n_tensors", "block_count", "rope", "table_bytes", "key_bytes"])
        t = rng.choice(tensors)
        if kind == "offset_alias":
            other = rng.choice([0] + [u["offset"] for u in tensors if u is not t])
            if other == t["offset"]:
                return None, kind
            put(b, t["offset_at"], "<Q", other)
        elif kind == "offset_shift":
            put(b, t["offset_at"], "<Q", max(0, t["offset"] + rng.choice([-64, -32, 32, 64, 96])))
        elif kind == "type":
            ty = rng.choice([x for x in range(42) if x != t["type"]])
            if same_size_swap(t, ty):
                return None, kind
            put(b, t["type_at"], "<I", ty)
        elif kind == "dims":
            d = rng.randrange(len(t["ne"]))
            ne = t["ne"][d]
            put(b, t["dims_at"][0] + 8 * d, "<Q", rng.choice([ne // 2, ne * 2, ne + 32, ne - 32, 0, 1]))
        elif kind == "alignment":
            put(b, kv["general.alignment"][3][0], "<I", rng.choice([1, 2, 4, 8, 16, 64, 128]))
        elif kind == "n_tensors":
            put(b, 8, "<Q", len(tensors) + rng.choice([-3, -2, -1, 1]))
        elif kind == "block_count":
            put(b, kv["qwen2.block_count"][3][0], "<I", rng.choice([0, 1, 3, 4, 2**32 - 1]))
        elif kind == "rope":
            at = kv["qwen2.rope.freq_base"]
            if rng.random() < 0.2:   # rename the key: rope.freq_base is then missing
                b[at[1][0] + rng.randrange(len("qwen2.rope."), len("qwen2.rope.freq_base"))] ^= 0x20
            else:
                put(b, at[3][0], "<f", rng.choice([math.inf, -math.inf, math.nan, 1e30, 1e-6, 0.0,
                                                   -1e6, 3e9, 0.5]))
        elif kind == "table_bytes":
            for _ in range(rng.choice([1, 1, 2, 3])):
                at = rng.randrange(*table)
                b[at] = b[at] ^ (1 << rng.randrange(8)) if rng.random() < 0.6 else rng.randrange(256)
            # a flip that makes a same-size type swap describes a valid file (see above)
            for u in tensors:
                ty = struct.unpack_from("<I", b, u["type_at"])[0]
                if ty != u["type"] and same_size_swap(u, ty):
                    return None, kind
        else:   # key_bytes: a byte of a model key (a renamed key reads as missing)
            k = rng.choice([k for k in kv if k.startswith("qwen2.") or k == "general.architecture"])
            lo, hi = kv[k][1]
            b[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
        return bytes(b), kind

    tmp = tempfile.mkdtemp()
    mpath = os.path.join(tmp, "m.gguf")
    with qc.Model(path, device="cpu") as m:
        want = m.forward(IDS).logits
    rng = random.Random(seed)
    counts = dict(tried=0, refused=0, equal=0, warned=0, silent=0)
    silent = []
    while counts["tried"] < n:
        b, kind = mutate(rng)
        if b is None or b == data:
            continue
        counts["tried"] += 1
        with open(mpath, "wb") as fh:
            fh.write(b)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with qc.Model(mpath, device="cpu") as m:
                    got = m.forward(IDS).logits
            except (GGUFError, ModelError) as exc:
                assert str(exc), "empty message"
                counts["refused"] += 1
                continue
        if got.shape == want.shape and np.array_equal(got, want):
            counts["equal"] += 1
        elif any("freq_base is missing" in str(w.message) for w in caught):
            counts["warned"] += 1
        else:
            counts["silent"] += 1
            silent.append(kind)
            with open(os.path.join(tmp, f"silent-{counts['silent']}.gguf"), "wb") as fh:
                fh.write(b)
    print(f"mutants seed {seed}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) +
          f"; silent kinds {sorted(set(silent))} in {tmp}")
""")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    # q4_k_m: Q5_0, Q8_0, Q6_K and F32 tensors; general.alignment written so it can be mutated
    path = tmp_path_factory.mktemp("mutants") / "tiny-q4km.gguf"
    return qwencuda.testing.write_model(str(path), "tiny", "q4_k_m", alignment=32)


def test_model_mutants_are_refused_or_compute_the_original(model_file):
    r = subprocess.run([sys.executable, "-c", MUTATE, "1", str(MUTANTS), model_file],
                       capture_output=True, text=True, env=_env(), timeout=900)
    assert r.returncode == 0, f"mutant process died (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
    line = r.stdout.strip().splitlines()[-1]
    counts = {k: int(v) for v, k in (p.split() for p in line.split(": ", 1)[1].split(";")[0].split(", "))}
    assert counts["tried"] == MUTANTS, line
    assert counts["silent"] == 0, line
    # every outcome is exercised, or the mutants test nothing
    assert counts["refused"] > MUTANTS // 2 and counts["warned"] > 0 and counts["equal"] > 0, line

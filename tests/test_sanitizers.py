"""The CPU C core under AddressSanitizer and UndefinedBehaviorSanitizer (issue 14).

The test builds qwencuda._core without CUDA, with -fsanitize=address,undefined and
-fno-sanitize-recover (the first report aborts), into a temporary folder, and runs a subset in a
Python process that preloads libasan: every weight type of the synthetic tiny model written
with general.alignment 32, 2 and 1, tied and untied (GGUF allows 1 and 2: block structs
then sit at odd addresses), each tensor dequantized and one forward pass on the CPU, with the results of the
misaligned files equal to the aligned file's bit for bit. Any sanitizer report fails the test.
Skipped, with the reason, where the compiler has no sanitizer runtime or the C sources are not
next to the tests.

The same subset also runs in this process against the normal build (test_misaligned_files_*),
so the equality holds without sanitizers too.
"""
import glob
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import qwencuda as qc

pytest.importorskip("gguf")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAN_FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
IDS = [1, 5, 9, 2, 7, 3]

# Run in the sanitized process and in this one: writes each weight type at three alignments,
# checks dequantized tensors and CPU logits of the misaligned files against the aligned one.
SUBSET = textwrap.dedent(r"""
    import os, sys, tempfile
    import numpy as np
    import qwencuda as qc

    def run(folder, weight_types, ids):
        checked = odd = 0   # odd: tensors whose data starts at an address not a multiple of 4
        # tied=True drops output.weight's 53-byte table entry: one of the two headers has an odd
        # length, so with alignment 1 the data of every type starts at an odd address somewhere
        for wt, tied in ((wt, tied) for wt in weight_types for tied in (False, True)):
            want_t = want_l = None
            for al in (None, 2, 1):
                p = qc.testing.write_model(os.path.join(folder, f"{wt}-{tied}-{al}.gguf"), "tiny", wt,
                                           tied=tied, alignment=al)
                with qc.GGUFFile(p) as f:
                    got_t = {n: f.tensor(n) for n in f.tensors}
                    offs = [f.tensors[n].offset for n in f.tensors]
                start = qc._core._gguf_parse_bytes(open(p, "rb").read())["data_offset"]
                with qc.Model(p, device="cpu") as m:
                    got_l = m.forward(ids).logits
                if al is None:
                    want_t, want_l = got_t, got_l
                    continue
                odd += sum((start + o) % 4 != 0 for o in offs)
                for n, x in got_t.items():
                    assert np.array_equal(x, want_t[n], equal_nan=True), (wt, al, n)
                assert np.array_equal(got_l, want_l), (wt, al, "logits")
                checked += 1
        return checked, odd

    if __name__ == "__main__":
        folder = tempfile.mkdtemp()
        n, odd = run(folder, sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")])
        print(f"subset: {n} misaligned files equal to their aligned twin, {odd} tensors at odd addresses")
""")


def _subset_module(tmp_path):
    path = tmp_path / "qc_san_subset.py"
    path.write_text(SUBSET)
    return str(path)


def _runtime(name):
    """The path of the compiler's sanitizer runtime, or None."""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return None
    out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


@pytest.fixture(scope="module")
def sanitized_build(tmp_path_factory):
    if not os.path.exists(os.path.join(ROOT, "setup.py")) or not glob.glob(os.path.join(ROOT, "csrc", "engine", "*.c")):
        pytest.skip("the C sources are not next to the tests (not a source checkout)")
    libasan = _runtime("libasan.so")
    if libasan is None or _runtime("libubsan.so") is None:
        pytest.skip("the C compiler has no AddressSanitizer/UBSan runtime (libasan.so, libubsan.so)")
    out = tmp_path_factory.mktemp("san")
    env = dict(os.environ, QWENCUDA_CUDA="0", CFLAGS=SAN_FLAGS + " -O1", LDFLAGS=SAN_FLAGS)
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "lib"),
                        "--build-temp", str(out / "tmp")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"sanitizer build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    # a package folder: the Python sources of the package under test, the sanitized extension
    pkg = out / "site" / "qwencuda"
    pkg.mkdir(parents=True)
    src = os.path.dirname(os.path.abspath(qc.__file__))
    for f in glob.glob(os.path.join(src, "*.py")) + [d for d in glob.glob(os.path.join(src, "*"))
                                                     if os.path.isfile(os.path.join(d, "__init__.py"))]:
        os.symlink(f, pkg / os.path.basename(f))   # the modules and the subpackages
    (so,) = glob.glob(str(out / "lib" / "qwencuda" / "_core*.so"))
    shutil.copy(so, pkg / os.path.basename(so))
    return str(out / "site"), libasan


def test_sanitizers_report_nothing_on_the_c_subset(sanitized_build, tmp_path):
    site, libasan = sanitized_build
    # the sanitized module first; then whatever the caller's PYTHONPATH held (gguf, where it is
    # not installed in the interpreter itself)
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, LD_PRELOAD=libasan,
               # Python itself is not instrumented and keeps memory until exit: no leak report
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=86",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=87")
    env.pop("QWENCUDA_MODEL", None)
    check = subprocess.run([sys.executable, "-c", "import qwencuda, sys; print(qwencuda._core.__file__)"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.startswith(site), check.stdout + check.stderr[-2000:]
    r = subprocess.run([sys.executable, _subset_module(tmp_path), ",".join(qc.testing.WEIGHT_TYPES),
                        ",".join(map(str, IDS))], env=env, capture_output=True, text=True, timeout=600)
    reports = [ln for ln in r.stderr.splitlines() if "runtime error:" in ln or "AddressSanitizer" in ln]
    assert r.returncode == 0 and not reports, \
        f"rc {r.returncode}; {len(reports)} sanitizer reports:\n" + r.stderr[-6000:]
    assert f"subset: {4 * len(qc.testing.WEIGHT_TYPES)} misaligned files" in r.stdout, r.stdout
    assert int(r.stdout.split(", ")[-1].split()[0]) > 100, r.stdout   # the subset reads misaligned data


@pytest.mark.parametrize("weight_type", ["f32", "f16", "bf16", "q5_0", "q8_0", "q4_k_m"])
def test_misaligned_files_give_the_aligned_files_numbers(weight_type, tmp_path):
    """general.alignment 1 and 2: same dequantized tensors and logits as alignment 32."""
    ns = {}
    exec(compile(SUBSET, "qc_san_subset", "exec"), ns)
    checked, odd = ns["run"](str(tmp_path), [weight_type], IDS)
    assert checked == 4 and odd > 0

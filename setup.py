"""Build qwencuda._core: C11 host code (csrc/) and, where nvcc is found, CUDA kernels (kernels/).

Environment:
  QWENCUDA_CUDA=0          build the CPU-only module even where nvcc exists
  QWENCUDA_CUDA_ARCHS      semicolon list of SM versions to compile for, e.g. "80;86;89;90" (90 =
                           H100/H200), plus PTX of the last one. Default: the compute capability
                           of the GPUs present (nvidia-smi); without a GPU one portable target,
                           sm_90 machine code plus PTX for compute_80 (the oldest supported
                           architecture), which the driver JIT-compiles for any other GPU >= 8.0
  CUDA_HOME / CUDA_PATH    where the toolkit lives (else nvcc on PATH, else /usr/local/cuda)
  QWENCUDA_DEBUG=1         -O0 -g builds
"""
import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
OLDEST_ARCH = "80"      # the kernels need sm_80 (Ampere) or newer
PORTABLE_SASS = "90"    # machine code where no GPU tells us better: H100/H200


def find_cuda():
    """Return (cuda_home, nvcc) or (None, None)."""
    if os.environ.get("QWENCUDA_CUDA", "1") == "0":
        return None, None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home, os.path.join(home, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), nvcc
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda", "/usr/local/cuda/bin/nvcc"
    return None, None


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def present_archs(nvcc):
    """The compute capabilities of the GPUs present, as "90" etc., if nvidia-smi tells them and
    nvcc can compile for each; else []."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    caps = sorted({line.strip().replace(".", "") for line in out.stdout.splitlines()
                   if re.fullmatch(r"\d+\.\d+", line.strip())}, key=int)
    if out.returncode != 0 or not caps:
        return []
    known = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    if known and any(f"compute_{c}" not in known for c in caps):
        print(f"qwencuda: nvcc cannot compile for the GPU present (sm_{caps[-1]}): portable build")
        return []
    return [c for c in caps if int(c) >= int(OLDEST_ARCH)]


def cuda_targets(nvcc):
    """(sass archs, ptx arch, why): machine code for each of sass, plus PTX of ptx."""
    env = os.environ.get("QWENCUDA_CUDA_ARCHS", "").strip()
    if env:
        archs = [a.strip() for a in env.split(";") if a.strip()]
        for a in archs:
            if not re.fullmatch(r"\d+a?", a):
                raise SystemExit(f"QWENCUDA_CUDA_ARCHS: bad architecture {a!r} (want e.g. 80;90)")
        # PTX of the highest architecture too, so newer GPUs can JIT it
        return archs, archs[-1], "QWENCUDA_CUDA_ARCHS"
    here = present_archs(nvcc)
    if here:
        return here, here[-1], "the GPU present"
    return [PORTABLE_SASS], OLDEST_ARCH, "no GPU found: portable"


class BuildExt(build_ext):
    def build_extension(self, ext):
        cuda_home, nvcc = find_cuda()
        debug = os.environ.get("QWENCUDA_DEBUG") == "1"
        opt = ["-O0", "-g"] if debug else ["-O3"]
        ext.extra_compile_args = ["-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                  "-fvisibility=hidden", "-pthread"] + opt
        ext.extra_link_args = ["-pthread", "-lm"]
        if cuda_home:
            sass, ptx, why = cuda_targets(nvcc)
            version = nvcc_version(nvcc)
            built = ";".join([f"sm_{a}" for a in sass] + [f"compute_{ptx}"])
            print(f"qwencuda: building with CUDA {version} from {cuda_home} for {built} ({why}; "
                  f"set QWENCUDA_CUDA_ARCHS to choose)")
            objects = self.compile_cuda(nvcc, cuda_home, sass, ptx, debug)
            ext.extra_objects = objects
            # and relink when one was rebuilt: setuptools relinks only for a source or a
            # dependency newer than the module, and an edit of a kernel alone left the old one
            ext.depends = list(ext.depends) + objects
            ext.define_macros += [("QC_HAVE_CUDA", "1"),
                                  ("QC_CUDA_ARCHS", '"%s"' % built),
                                  ("QC_CUDA_VERSION", '"%s"' % version)]
            ext.include_dirs.append(os.path.join(cuda_home, "include"))
            libdir = os.path.join(cuda_home, "lib64")
            if not os.path.isdir(libdir):
                libdir = os.path.join(cuda_home, "lib")
            ext.library_dirs.append(libdir)
            ext.runtime_library_dirs.append(libdir)
            ext.libraries += ["cudart", "cublas", "stdc++"]
        else:
            print("qwencuda: nvcc not found (or QWENCUDA_CUDA=0): building the CPU-only module")
        super().build_extension(ext)

    def compile_cuda(self, nvcc, cuda_home, archs, ptx, debug):
        sources = sorted(glob.glob(os.path.join("kernels", "*.cu")))
        outdir = os.path.join(self.build_temp, "kernels")
        os.makedirs(outdir, exist_ok=True)
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        # PTX: the driver JIT-compiles it for GPUs without machine code here
        gencode += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
        headers = glob.glob("kernels/*.cuh") + glob.glob("kernels/*.h") + glob.glob("csrc/engine/*.h")
        newest_header = max((os.path.getmtime(h) for h in headers), default=0)

        def one(src):
            obj = os.path.join(outdir, os.path.basename(src) + ".o")
            if (os.path.exists(obj) and os.path.getmtime(obj) > os.path.getmtime(src)
                    and os.path.getmtime(obj) > newest_header and not self.force):
                return obj
            cmd = [nvcc, "-c", src, "-o", obj, "-std=c++17", "-Icsrc/engine", "-Ikernels",
                   "-Xcompiler", "-fPIC,-Wall,-fvisibility=hidden", "--expt-relaxed-constexpr",
                   "-DQC_HAVE_CUDA=1"] + (["-O0", "-g", "-lineinfo"] if debug else ["-O3", "-lineinfo"]) + gencode
            print(" ".join(cmd))
            r = subprocess.run(cmd)
            if r.returncode != 0:
                raise SystemExit(f"nvcc failed on {src}")
            return obj

        jobs = int(os.environ.get("QWENCUDA_NVCC_JOBS", str(max(1, os.cpu_count() or 1))))
        with ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(one, sources))


# the layers of csrc/: the engine core (plain C), the CPU backend, the Python bindings
C_DIRS = ["csrc/engine", "csrc/cpu", "csrc/python"]
c_sources = sorted(f for d in C_DIRS for f in glob.glob(os.path.join(d, "*.c")))

setup(
    ext_modules=[Extension(
        "qwencuda._core",
        sources=c_sources,
        include_dirs=C_DIRS + [numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), ("_GNU_SOURCE", "1")],
        depends=[f for d in C_DIRS for f in glob.glob(os.path.join(d, "*.h"))],
    )],
    cmdclass={"build_ext": BuildExt},
)

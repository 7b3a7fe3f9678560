#!/usr/bin/env bash
# Developer build into a private folder, so that several people (or agents) can build and test
# the same source tree at once without replacing each other's loaded extension:
#   scripts/devbuild.sh NAME          -> /tmp/qc-NAME/qwencuda (symlinks to the sources + _core.so)
#   PYTHONPATH=/tmp/qc-NAME python -m pytest tests/...
# CPU-only unless QWENCUDA_CUDA=1 is set (nvcc is slow); QWENCUDA_CUDA_ARCHS as in setup.py.
set -euo pipefail
name=${1:?usage: scripts/devbuild.sh NAME}
top=$(cd "$(dirname "$0")/.." && pwd)
out=/tmp/qc-$name
# the project's virtual environment when there is one (numpy and setuptools live there)
py=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x "$top/.venv/bin/python" ] && py=$top/.venv/bin/python
mkdir -p "$out/qwencuda" "$out/build"
cd "$top"
QWENCUDA_CUDA=${QWENCUDA_CUDA:-0} "$py" setup.py -q build_ext --build-lib "$out/build/lib" \
    --build-temp "$out/build/tmp" >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
grep -E "warning|error" "$out/build.log" || true
find "$out/qwencuda" -maxdepth 1 -type l -delete
for f in "$top"/qwencuda/*; do
    case "$f" in *.so|*__pycache__*) continue ;; esac
    ln -s "$f" "$out/qwencuda/$(basename "$f")"
done
cp -f "$out"/build/lib/qwencuda/_core*.so "$out/qwencuda/.core.tmp" && mv -f "$out/qwencuda/.core.tmp" "$out/qwencuda/$(basename "$out"/build/lib/qwencuda/_core*.so)"
echo "built: PYTHONPATH=$out"

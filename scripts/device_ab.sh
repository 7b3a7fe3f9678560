#!/usr/bin/env bash
# scripts/device_ab.sh: an A/B of two builds' decode speed on the GPU machine, with the builds made
# here (on the CPU machine) so that the device's time goes to measuring.
#
# Why: the device tool's machine goes back after 30 s idle and lends 1800 s a session; a build
# there (pip install, all kernels, sm_90) took 90-150 s alone and more than 6 minutes for three at
# once (2026-12-03), while here two build side by side in about 6 minutes of no device time. A
# compressed .so (15 MB of 32) fits the 64 MiB a call carries, two of them beside the tree.
#
# Here (CPU machine, CPython of the device: 3.12):
#   scripts/device_ab.sh build BASE
#       builds BASE (a commit) and the working tree for sm_90 (scripts/devbuild.sh: /tmp/qc-ab-base,
#       /tmp/qc-ab-new) and writes .dev/{base.tar.xz, base.so.xz, new.so.xz} (.dev/ is git-ignored: list it in
#       .git/info/exclude). PYTHON names the interpreter (default python3.12 on PATH).
#       With STAMPS=1 also both trees patched by scripts/step_stamps.py (its copy of this tree) and
#       built (/tmp/qc-ab-base-st, /tmp/qc-ab-new-st): .dev/{base,new}-st.so.xz and their
#       .dev/{base,new}-st-tags.txt (about 6 minutes more).
#   scripts/device_ab.sh split MODEL
#       the real GGUF file into .model/part0..8 (one a call: each ~52 MB).
# On the device (the `run` tool; carry .whl (the gguf wheel), .dev/*, then one .model/partN a call):
#   scripts/device_ab.sh setup            both builds into /tmp/base and /tmp/new, gguf into /tmp/site
#   scripts/device_ab.sh part N           .model/partN to /tmp/m
#   scripts/device_ab.sh model            the parts joined into /tmp/m/qwen.gguf, and its sha256
#   scripts/device_ab.sh bench MODEL [ROUNDS] [ENV...]
#       `python -m qwencuda bench` (prompt 512, depths 0 and 2048, 128 tokens, 3 repeats) of base,
#       then new, ROUNDS (3) times; ENV (NAME=value words) applies to new only, so that one build
#       also A/Bs a switch read at creation (QWENCUDA_*=0). DEPTHS (words) replaces "0 2048", e.g.
#       DEPTHS="8192 16384" for the flash decode past QC_KV_SHORT keys.
#   scripts/device_ab.sh setup-stamps     after setup, in a call that carries .dev/*-st.*: the
#                                         stamped builds into /tmp/base-st and /tmp/new-st
#   scripts/device_ab.sh stamps MODEL [STEPS] [ENV...]
#       step_stamps.py's decode (STEPS (64) greedy steps after 512 tokens) of each stamped build,
#       then its kernels table (medians of the last 8 steps); ENV for new only, as in bench.
#       Stamped builds are compared with each other only (the stamps cost time of their own).
# A round took about 2 s a build on the real 0.5B file (H200, 2026-12-03).
set -euo pipefail
so=_core.cpython-312-x86_64-linux-gnu.so
top=$(cd "$(dirname "$0")/.." && pwd)
# on the device: build $1's command (the rest), with the ENV words in $new_env for new only
as_build() {
    local v=$1
    shift
    local extra=()
    [ "$v" = new ] && extra=("${new_env[@]}")
    (cd /tmp && env "${extra[@]}" "$@")
}
mode=${1:?usage: scripts/device_ab.sh build BASE | split MODEL | setup | part N | model | bench MODEL [ROUNDS] [ENV...] | setup-stamps | stamps MODEL [STEPS] [ENV...]}
shift
case $mode in
build)
    # each through scripts/devbuild.sh: base from its own extracted tree, new from this one
    base=${1:?the base commit}
    export PYTHON=${PYTHON:-python3.12} QWENCUDA_CUDA=1 QWENCUDA_CUDA_ARCHS=90
    work=/tmp/device_ab
    rm -rf "$work" && mkdir -p "$work/base" "$top/.dev"
    git -C "$top" archive "$base" | xz -T0 > "$top/.dev/base.tar.xz"
    tar -xJf "$top/.dev/base.tar.xz" -C "$work/base"
    "$work/base/scripts/devbuild.sh" ab-base >"$work/build-base.log" 2>&1 &
    "$top/scripts/devbuild.sh" ab-new >"$work/build-new.log" 2>&1 &
    wait
    for v in base new; do
        [ -f "/tmp/qc-ab-$v/qwencuda/$so" ] || { tail -20 "$work/build-$v.log"; exit 1; }
        xz -T0 -6 -c "/tmp/qc-ab-$v/qwencuda/$so" > "$top/.dev/$v.so.xz"
    done
    if [ "${STAMPS:-0}" = 1 ]; then
        # copies of both trees (new: this one's tracked and untracked-not-ignored files) patched
        # by this tree's step_stamps.py, so that both carry the same stamps
        mkdir -p "$work/base-st" "$work/new-st"
        tar -xJf "$top/.dev/base.tar.xz" -C "$work/base-st"
        (cd "$top" && git ls-files -co --exclude-standard | tar --ignore-failed-read -cf - -T - 2>/dev/null) |
            tar -xf - -C "$work/new-st"
        for v in base new; do "$PYTHON" "$top/scripts/step_stamps.py" patch "$work/$v-st" >/dev/null; done
        "$work/base-st/scripts/devbuild.sh" ab-base-st >"$work/build-base-st.log" 2>&1 &
        "$work/new-st/scripts/devbuild.sh" ab-new-st >"$work/build-new-st.log" 2>&1 &
        wait
        for v in base new; do
            [ -f "/tmp/qc-ab-$v-st/qwencuda/$so" ] || { tail -20 "$work/build-$v-st.log"; exit 1; }
            xz -T0 -6 -c "/tmp/qc-ab-$v-st/qwencuda/$so" > "$top/.dev/$v-st.so.xz"
            cp "$work/$v-st/stamp_tags.txt" "$top/.dev/$v-st-tags.txt"
        done
    fi
    ls -la "$top/.dev"
    ;;
split)
    mkdir -p "$top/.model"
    split -n 9 -d -a 1 "${1:?the GGUF file}" "$top/.model/part"
    ls -la "$top/.model"
    ;;
setup)
    mkdir -p /tmp/m /tmp/base /tmp/new /tmp/src-base
    python -m pip install -q --no-deps --target /tmp/site .whl/gguf*.whl
    tar -xJf .dev/base.tar.xz -C /tmp/src-base
    cp -r /tmp/src-base/qwencuda /tmp/base/ && xz -dc .dev/base.so.xz > /tmp/base/qwencuda/$so
    cp -r qwencuda /tmp/new/ && xz -dc .dev/new.so.xz > /tmp/new/qwencuda/$so
    for v in base new; do (cd /tmp && PYTHONPATH=/tmp/$v:/tmp/site python -c "import qwencuda; print(qwencuda.__file__)"); done
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    ;;
part)
    # (its own folder: a part call may land on a fresh machine where setup never ran, when the
    # machine of the calls before was given back; 2026-12-03)
    mkdir -p /tmp/m && mv ".model/part${1:?N}" /tmp/m/ && ls /tmp/m | wc -l
    ;;
model)
    cat /tmp/m/part{0..8} > /tmp/m/qwen.gguf
    rm /tmp/m/part?
    sha256sum /tmp/m/qwen.gguf
    ;;
bench)
    model=${1:?the GGUF file}
    rounds=${2:-3}
    shift $(( $# < 2 ? $# : 2 ))
    new_env=("$@")
    for r in $(seq "$rounds"); do
        for v in base new; do
            echo "== round $r $v"
            # shellcheck disable=SC2086  # (DEPTHS: words)
            as_build $v PYTHONPATH=/tmp/$v:/tmp/site python -m qwencuda bench --model "$model" \
                --prompt-tokens 512 --depth ${DEPTHS:-0 2048} --gen-tokens 128 --repeats 3 2>&1 | grep -E "decode  "
        done
    done
    ;;
setup-stamps)
    for v in base new; do
        rm -rf "/tmp/$v-st" && mkdir -p "/tmp/$v-st" && cp -r "/tmp/$v/qwencuda" "/tmp/$v-st/"
        xz -dc ".dev/$v-st.so.xz" > "/tmp/$v-st/qwencuda/$so"
    done
    ;;
stamps)
    model=${1:?the GGUF file}
    steps=${2:-64}
    shift $(( $# < 2 ? $# : 2 ))
    new_env=("$@")
    for v in base new; do
        echo "== $v, stamped"
        as_build $v QC_STAMPS="/tmp/st-$v.bin" PYTHONPATH="/tmp/$v-st:/tmp/site" \
            python "$top/scripts/step_stamps.py" decode "$model" "$steps" 512 >"/tmp/st-$v.log" 2>&1 ||
            { tail -5 "/tmp/st-$v.log"; continue; }
        python "$top/scripts/step_stamps.py" kernels "/tmp/st-$v.bin" ".dev/$v-st-tags.txt" 8
    done
    ;;
*)
    echo "device_ab.sh: unknown mode $mode" >&2
    exit 2
    ;;
esac

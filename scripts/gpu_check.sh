#!/usr/bin/env bash
# scripts/gpu_check.sh: the check of qwencuda on a GPU machine, in one command:
#   1. build and install (pip install --no-build-isolation), for this GPU's architecture;
#   2. write the 0.5B-shaped synthetic models (F16, Q8_0, Q4_K_M) in the background meanwhile;
#   3. the whole test suite, GPU tests included (QWENCUDA_MODEL: the real model, when present);
#   4. `python -m qwencuda bench` (prompt 512, decode 128) on the synthetic files and the real one,
#      and scripts/kernel_bench.py (matmul per weight type at 0.5B shapes, and decode at 7B shapes:
#      us and GB/s), and where a decode step's time goes kernel by kernel and between the steps of
#      the generation loop (scripts/profile_decode.py timeline and loop, where torch is installed);
#   5. compute-sanitizer memcheck of short CUDA generations (prefill on both matmul paths, decode
#      steps; with every capture (the unfused ops) and without (the fused ops, replayed decode));
#   6. a report bench/results/<date>-<commit>-<device>.md.
# When $OUT is set (the device tool) the report and the logs are also copied there: at most 7
# files, no folders, so they all come back.
#
# Environment (all optional):
#   PYTHON                 python3                     interpreter to build and test with
#   QWENCUDA_MODEL         real GGUF file to test and bench, when it exists
#   QWENCUDA_CUDA_ARCHS    the GPU's compute capability (nvidia-smi), e.g. 90
#   GPU_CHECK_STEPS        build,tests,bench,sanitizer
#   GPU_CHECK_PYTEST_ARGS  extra pytest arguments (e.g. "-k cuda" or "-x"; no quoted spaces)
#   GPU_CHECK_TESTS        what pytest collects (default: tests)
#   GPU_CHECK_BENCH_TYPES  f16 q8_0 q4_k_m
#   GPU_CHECK_PROMPT / GPU_CHECK_GEN / GPU_CHECK_REPEATS   512 / 128 / 3
#   GPU_CHECK_LONG_PROMPTS  prompt lengths of the long-context bench (real model, else the
#                           Q4_K_M-shaped file), e.g. "4096 16384 32768"; empty: none
#   GPU_CHECK_LONG_DEPTHS   depths of its decode, e.g. "4096 16384"
#   LLAMA_BENCH            llama.cpp's llama-bench: the same work on the same file, in the report
#   GPU_CHECK_LLAMA_WAIT   seconds to wait at the bench step for LLAMA_BENCH to exist (a build still
#                          running beside the check; default 0)
#   GPU_CHECK_TEST_TIMEOUT seconds for the test step (default 900; the H100 took 356 s for 5092
#                          tests at f0bdc45, then did not finish 5110 in 600 s at 15a6859)
#   GPU_CHECK_COMMIT       commit to name in the report where the tree has no .git
set -uo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top"
PY=${PYTHON:-python3}
steps=${GPU_CHECK_STEPS:-build,tests,bench,sanitizer}
has_step() { [[ ",$steps," == *",$1,"* ]]; }
logdir=$(mktemp -d /tmp/gpu_check.XXXXXX)
synth=${QWENCUDA_SYNTH_DIR:-/tmp/qc-synth}
export QWENCUDA_SYNTH_DIR=$synth
mkdir -p "$synth" bench/results
export PYTHONUNBUFFERED=1

# ---- machine -----------------------------------------------------------------------------
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
nvcc_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
export QWENCUDA_CUDA_ARCHS=${QWENCUDA_CUDA_ARCHS:-${cap:-90}}
# the device tool copies the working tree without .git: GPU_CHECK_COMMIT names the commit then
commit=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo nogit)}
export QWENCUDA_COMMIT=$commit   # what bench prints for the installed copy, which has no .git
slug=$(echo "${gpu_name:-nogpu}" | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9' '-' | sed 's/-*$//')
report="bench/results/$(date -u +%Y%m%d)-$commit-$slug.md"
echo "gpu_check: $gpu_name (driver $driver, sm_$QWENCUDA_CUDA_ARCHS), nvcc $nvcc_version, commit $commit"

# ---- synthetic 0.5B-shaped models, written in parallel while the build runs ------------------
bench_types=${GPU_CHECK_BENCH_TYPES:-f16 q8_0 q4_k_m}
synth_pids=()
if has_step tests || has_step bench; then
    for wt in $bench_types; do
        f="$synth/qwen05b-$wt.gguf"
        [ -e "$f" ] && continue
        # qwencuda/testing/ needs only numpy and gguf: load it as a package of its own, since
        # qwencuda itself is not installed yet while the build runs
        "$PY" -c "import importlib.util as u, os, sys
spec = u.spec_from_file_location('qc_testing', '$top/qwencuda/testing/__init__.py',
                                 submodule_search_locations=['$top/qwencuda/testing'])
t = u.module_from_spec(spec); sys.modules['qc_testing'] = t; spec.loader.exec_module(t)
t.write_model('$f.part', config='qwen2.5-0.5b', weight_type='$wt'); os.replace('$f.part', '$f')" \
            >"$logdir/synth-$wt.log" 2>&1 &
        synth_pids+=($!)
    done
fi

# ---- 1. build ------------------------------------------------------------------------------
build_status=skipped
if has_step build; then
    t0=$(date +%s)
    if QWENCUDA_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -q . >"$logdir/build.log" 2>&1; then
        build_status="ok ($(( $(date +%s) - t0 )) s)"
    else
        build_status="FAILED"
        tail -30 "$logdir/build.log"
    fi
    echo "build: $build_status"
fi
info=$(cd /tmp && "$PY" -c "import qwencuda; print(qwencuda.build_info())" 2>&1)
echo "build_info: $info"

for p in "${synth_pids[@]}"; do wait "$p"; done
for wt in $bench_types; do [ -e "$synth/qwen05b-$wt.gguf" ] || cat "$logdir/synth-$wt.log" 2>/dev/null; done

# ---- 2. tests ------------------------------------------------------------------------------
test_summary="not run"
if has_step tests && [ "$build_status" != FAILED ]; then
    t0=$(date +%s)
    timeout "${GPU_CHECK_TEST_TIMEOUT:-900}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
        --junitxml="$logdir/junit.xml" ${GPU_CHECK_PYTEST_ARGS:-} ${GPU_CHECK_TESTS:-tests} >"$logdir/pytest.log" 2>&1
    rc=$?
    test_summary=$("$PY" - "$logdir/junit.xml" "$rc" "$(( $(date +%s) - t0 ))" <<'EOF'
import sys, xml.etree.ElementTree as ET
path, rc, secs = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    root = ET.parse(path).getroot()
except Exception as exc:
    print(f"no junit report (pytest exit {rc}: {exc})"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"{passed} passed, {tot['failures']} failed, {tot['errors']} errors, {tot['skipped']} skipped "
      f"(pytest exit {rc}, {secs} s)")
# properties the tests recorded (e.g. whether CUDA's greedy tokens equal the CPU's)
for case in root.iter("testcase"):
    for prop in case.iter("property"):
        print(f"  - {case.get('name')}: {prop.get('name')} = {prop.get('value')}")
EOF
)
    echo "tests: $test_summary"
    grep -E "^(FAILED|ERROR)" "$logdir/pytest.log" | head -40
fi

# ---- 3. bench ------------------------------------------------------------------------------
if has_step bench && [ "$build_status" != FAILED ]; then
    files=()
    for wt in $bench_types; do [ -e "$synth/qwen05b-$wt.gguf" ] && files+=("$synth/qwen05b-$wt.gguf"); done
    [ -n "${QWENCUDA_MODEL:-}" ] && [ -e "${QWENCUDA_MODEL}" ] && files+=("$QWENCUDA_MODEL")
    for f in "${files[@]}"; do
        (cd /tmp && timeout 240 "$PY" -m qwencuda bench --model "$f" --device cuda \
            --prompt-tokens "${GPU_CHECK_PROMPT:-512}" --gen-tokens "${GPU_CHECK_GEN:-128}" \
            --repeats "${GPU_CHECK_REPEATS:-3}") >>"$logdir/bench.log" 2>&1 || echo "bench failed: $f" >>"$logdir/bench.log"
    done
    # the last file again without the fused ops (QWENCUDA_NO_FUSION=1), to see what they buy
    if [ "${#files[@]}" -gt 0 ]; then
        echo "without fusion (QWENCUDA_NO_FUSION=1):" >>"$logdir/bench.log"
        (cd /tmp && QWENCUDA_NO_FUSION=1 timeout 240 "$PY" -m qwencuda bench --model "${files[-1]}" --device cuda \
            --prompt-tokens "${GPU_CHECK_PROMPT:-512}" --gen-tokens "${GPU_CHECK_GEN:-128}" \
            --repeats "${GPU_CHECK_REPEATS:-3}") >>"$logdir/bench.log" 2>&1 || echo "bench failed: ${files[-1]}" >>"$logdir/bench.log"
    fi
    # long context: prefill of long prompts, decode after deep contexts (issue 13)
    lf=${QWENCUDA_MODEL:-}; [ -n "$lf" ] && [ -e "$lf" ] || lf="$synth/qwen05b-q4_k_m.gguf"
    if [ -n "${GPU_CHECK_LONG_PROMPTS:-}${GPU_CHECK_LONG_DEPTHS:-}" ] && [ -e "$lf" ]; then
        echo "long context ($(basename "$lf")):" >>"$logdir/bench.log"
        [ -n "${GPU_CHECK_LONG_PROMPTS:-}" ] && (cd /tmp && timeout 600 "$PY" -m qwencuda bench --model "$lf" --device cuda \
            --prompt-tokens $GPU_CHECK_LONG_PROMPTS --gen-tokens 0 --repeats "${GPU_CHECK_REPEATS:-3}") >>"$logdir/bench.log" 2>&1
        [ -n "${GPU_CHECK_LONG_DEPTHS:-}" ] && (cd /tmp && timeout 600 "$PY" -m qwencuda bench --model "$lf" --device cuda \
            --prompt-tokens 1 --depth $GPU_CHECK_LONG_DEPTHS --gen-tokens "${GPU_CHECK_GEN:-128}" \
            --repeats "${GPU_CHECK_REPEATS:-3}") >>"$logdir/bench.log" 2>&1
    fi
    # llama.cpp on the same file and the same work, in the same lease (a llama-bench still being
    # built beside this check is waited for, GPU_CHECK_LLAMA_WAIT seconds; one that never came is
    # named in the report, not left out silently)
    if [ -n "${LLAMA_BENCH:-}" ]; then
        for _ in $(seq "${GPU_CHECK_LLAMA_WAIT:-0}"); do [ -x "$LLAMA_BENCH" ] && break; sleep 1; done
        [ -x "$LLAMA_BENCH" ] || echo "llama.cpp: not run (LLAMA_BENCH=$LLAMA_BENCH is not an executable file)" >>"$logdir/bench.log"
    fi
    if [ -n "${LLAMA_BENCH:-}" ] && [ -x "$LLAMA_BENCH" ] && [ -e "$lf" ]; then
        comma() { echo "$*" | tr ' ' ','; }
        echo "llama.cpp (llama-bench -ngl 99 -fa 1, $(basename "$lf")):" >>"$logdir/bench.log"
        timeout 600 "$LLAMA_BENCH" -m "$lf" -ngl 99 -fa 1 -r "${GPU_CHECK_REPEATS:-3}" \
            -p "$(comma ${GPU_CHECK_PROMPT:-512} ${GPU_CHECK_LONG_PROMPTS:-})" -n "${GPU_CHECK_GEN:-128}" >>"$logdir/bench.log" 2>&1
        [ -n "${GPU_CHECK_LONG_DEPTHS:-}" ] && timeout 600 "$LLAMA_BENCH" -m "$lf" -ngl 99 -fa 1 -r "${GPU_CHECK_REPEATS:-3}" \
            -p 0 -n "${GPU_CHECK_GEN:-128}" -d "$(comma $GPU_CHECK_LONG_DEPTHS)" >>"$logdir/bench.log" 2>&1
    fi
    (cd /tmp && timeout 120 "$PY" "$top/scripts/kernel_bench.py" --device cuda) >>"$logdir/bench.log" 2>&1 \
        || echo "kernel_bench failed" >>"$logdir/bench.log"
    # the decode GEMVs at 7B shapes (issue 16: bytes/s per op against the ~3.35 TB/s bound)
    (cd /tmp && timeout 180 "$PY" "$top/scripts/kernel_bench.py" --device cuda --shapes 7B --tokens 1 \
        --types F16,Q8_0,Q4_K,Q6_K,Q5_0 --iters 50) >>"$logdir/bench.log" 2>&1 \
        || echo "kernel_bench (7B shapes) failed" >>"$logdir/bench.log"
    # the draw on the device vs on the host, on the real file (else the Q4_K_M-shaped one)
    sf=${QWENCUDA_MODEL:-}; [ -n "$sf" ] && [ -e "$sf" ] || sf="$synth/qwen05b-q4_k_m.gguf"
    [ -e "$sf" ] && (cd /tmp && timeout 240 "$PY" "$top/scripts/sampling_bench.py" "$sf" cuda \
        "${GPU_CHECK_PROMPT:-512}" "${GPU_CHECK_GEN:-128}" "${GPU_CHECK_REPEATS:-3}") >>"$logdir/bench.log" 2>&1 \
        || echo "sampling_bench failed" >>"$logdir/bench.log"
    # each kernel's share of a decode step, from CUPTI's start and end times: the kernels run as
    # built, where %globaltimer stamps (scripts/step_stamps.py) change what they time
    if [ -e "$sf" ] && "$PY" -c "import torch" 2>/dev/null; then
        echo "decode timeline ($(basename "$sf"), after ${GPU_CHECK_PROMPT:-512} tokens; scripts/profile_decode.py):" >>"$logdir/bench.log"
        (cd /tmp && timeout 180 "$PY" "$top/scripts/profile_decode.py" timeline "$sf" "${GPU_CHECK_PROMPT:-512}" 16 2>&1 \
            | grep -v -i "warn") >>"$logdir/bench.log" || echo "profile_decode timeline failed" >>"$logdir/bench.log"
        # and between the steps of the generation loop (the draw's hand-off to the host)
        echo "decode loop between steps ($(basename "$sf"); scripts/profile_decode.py loop):" >>"$logdir/bench.log"
        (cd /tmp && timeout 180 "$PY" "$top/scripts/profile_decode.py" loop "$sf" "${GPU_CHECK_PROMPT:-512}" 40 2>&1 \
            | grep -v -i "warn") >>"$logdir/bench.log" || echo "profile_decode loop failed" >>"$logdir/bench.log"
    fi
    cat "$logdir/bench.log" 2>/dev/null
fi

# ---- 4. compute-sanitizer ------------------------------------------------------------------
san_summary="not run"
if has_step sanitizer && [ "$build_status" != FAILED ]; then
    if command -v compute-sanitizer >/dev/null; then
        (cd /tmp && "$PY" -c "from qwencuda import testing
testing.write_model('$synth/tiny-q4_k_m-san.gguf', config='tiny', weight_type='q4_k_m')
testing.write_model('$synth/tiny-hd128-f16-san.gguf', config='tiny-hd128', weight_type='f16')
testing.write_model('$synth/gqa7-hd64-q8_0-san.gguf', config=dict(n_vocab=400, dim=448, n_layer=2, n_head=7, n_head_kv=1, ffn_dim=512), weight_type='q8_0')
testing.write_model('$synth/gqa7-hd64-f32-san.gguf', config=dict(n_vocab=400, dim=448, n_layer=2, n_head=7, n_head_kv=1, ffn_dim=512), weight_type='f32')") >"$logdir/sanitizer.log" 2>&1
        (cd /tmp && timeout 300 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 \
            "$PY" -c "
import numpy as np, qwencuda as qc
for path in ['$synth/tiny-q4_k_m-san.gguf', '$synth/tiny-hd128-f16-san.gguf', '$synth/gqa7-hd64-q8_0-san.gguf']:
    for capture in ('*', None):                                 # unfused ops, then the fused ones
        with qc.Model(path, device='cuda') as m, m.session(max_context=200) as s:
            s.prefill_chunk = 64                                # flash attention over earlier chunks
            s.prefill(np.arange(1, 150, dtype=np.int32) % 399, capture=capture, attn_rows=[-1] if capture else None)
            s.reset()
            ids = np.arange(1, 13, dtype=np.int32)
            tr = s.prefill(ids, capture=capture, logits='all')  # 12 tokens: the cuBLAS path
            for t in range(4):                                  # decode: the GEMV path (replayed)
                tr = s.step(int(tr.argmax[-1]), capture=capture)
            s.reset(); s.prefill(ids[:3], capture=capture, logits='all')
            sp = qc.Sampler(m.config.n_vocab, temperature=0.8, top_k=5, top_p=0.9, min_p=0.01,
                            repeat_penalty=1.1, seed=1)            # the draw on the device
            s.reset(); t = s.prefill(ids, logits=None, sampler=sp).token
            for _ in range(3):
                sp.accept(t); t = s.step(t, logits=None, sampler=sp).token
            sp = qc.Sampler(m.config.n_vocab, temperature=0.8, top_k=5, seed=2)
            s.reset(); t = s.prefill(ids, logits=None, sampler=sp).token
            for _ in range(6):                                  # no penalty: steps run ahead
                t = s.step(t, logits=None, sampler=sp).token
            assert s.ran_ahead
print('sanitized run ok')
") >>"$logdir/sanitizer.log" 2>&1
        rc=$?
        san_summary="memcheck: $(grep -E 'ERROR SUMMARY|LEAK SUMMARY' "$logdir/sanitizer.log" | tr '\n' ' ')(exit $rc)"
        # initcheck and racecheck on the attention paths: flash prefill over earlier chunks, the
        # flash decode past QC_KV_SHORT keys (replayed), split-K decode, attention-row captures.
        # F32 weights: initcheck does not see cuBLAS's f16 tensor-core stores (a blind spot:
        # tests/test_cuda_prefill_writes.py checks those writes without the tool)
        for tool in initcheck racecheck; do
            (cd /tmp && timeout 400 compute-sanitizer --tool $tool --error-exitcode 9 "$PY" -c "
import numpy as np, qwencuda as qc
with qc.Model('$synth/gqa7-hd64-f32-san.gguf', device='cuda') as m, m.session(max_context=3300, prefill_chunk=1024) as s:
    tr = s.prefill(np.arange(3100) % 399 + 1)
    for _ in range(3):
        tr = s.step(int(tr.argmax[-1]))
    s.reset(); s.prefill(np.arange(1, 40), capture='blk.0.attn_probs', attn_rows=[-1])
    tr = s.prefill([5]); s.step(int(tr.argmax[-1]))
    g = qc.Sampler(m.config.n_vocab); t = s.prefill([7, 8], logits=None, sampler=g).token
    for _ in range(5):                                          # greedy steps run ahead
        t = s.step(t, logits=None, sampler=g).token
    assert s.ran_ahead
print('$tool run ok')
") >"$logdir/sanitizer-$tool.log" 2>&1
            rc=$?
            san_summary="$san_summary; $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logdir/sanitizer-$tool.log" | tail -1) (exit $rc)"
            cat "$logdir/sanitizer-$tool.log" >>"$logdir/sanitizer.log"
        done
        # the folded down projection (swiglu_down: the slices, the sums' atomics and clears, the
        # attention launch and the head adding them): a model whose gate/up take the 32-row
        # kernel, three layers, a vocabulary for the lm_head's draw; logits steps (sum_add), greedy
        # steps drawn in the lm_head (matmul_draw's output norm), a capturing step between. Each
        # prefill is one token: a longer one takes cuBLAS, whose f16 tensor-core stores initcheck
        # does not see (its bias kernel's reads were 44384 false reports, H200, 2026-12-03)
        (cd /tmp && "$PY" -c "from qwencuda import testing
testing.write_model('$synth/fold-q8_0-san.gguf', config=dict(n_vocab=12000, dim=224, n_layer=3, n_head=14, n_head_kv=2, ffn_dim=512), weight_type='q8_0')") >>"$logdir/sanitizer.log" 2>&1
        for tool in memcheck racecheck initcheck; do
            (cd /tmp && timeout 400 compute-sanitizer --tool $tool --error-exitcode 9 "$PY" -c "
import numpy as np, qwencuda as qc
with qc.Model('$synth/fold-q8_0-san.gguf', device='cuda') as m, m.session(max_context=96) as s:
    tr = s.prefill([3])
    for k in range(6):
        tr = s.step(int(tr.argmax[-1]), capture='blk.1.ffn_out' if k == 2 else None)
    g = qc.Sampler(m.config.n_vocab); s.reset(); t = s.prefill([7], logits=None, sampler=g).token
    for _ in range(5):                                          # greedy steps run ahead
        t = s.step(t, logits=None, sampler=g).token
    assert s.ran_ahead
print('fold $tool run ok')
") >"$logdir/sanitizer-fold-$tool.log" 2>&1
            rc=$?
            san_summary="$san_summary; fold $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$logdir/sanitizer-fold-$tool.log" | tail -1) (exit $rc)"
            cat "$logdir/sanitizer-fold-$tool.log" >>"$logdir/sanitizer.log"
        done
    else
        san_summary="compute-sanitizer not found"
    fi
    echo "sanitizer: $san_summary"
fi

# ---- 5. report -----------------------------------------------------------------------------
{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "- commit: $commit"
    echo "- device: ${gpu_name:-none} (nvidia-smi), driver ${driver:-?}, sm_$QWENCUDA_CUDA_ARCHS, nvcc ${nvcc_version:-?}"
    echo "- build: $build_status"
    echo "- build_info: \`$info\`"
    echo "- tests: $test_summary"
    # the outside oracles count themselves (tests/conftest.py): HF transformers, llama.cpp's layers
    grep -E "^outside oracle" "$logdir/pytest.log" 2>/dev/null | sed 's/^/  - /'
    echo "- sanitizer (tiny models, prefill + decode, with and without capture; memcheck on three weight types, initcheck and racecheck on F32 weights): $san_summary"
    echo
    echo "## Failures"
    echo
    echo '```'
    grep -E "^(FAILED|ERROR)" "$logdir/pytest.log" 2>/dev/null | head -60
    echo '```'
    echo
    echo "## Bench (prompt ${GPU_CHECK_PROMPT:-512}, decode ${GPU_CHECK_GEN:-128}, median of ${GPU_CHECK_REPEATS:-3})"
    echo
    echo '```'
    cat "$logdir/bench.log" 2>/dev/null
    echo '```'
} >"$report"
echo "report: $report"

if [ -n "${OUT:-}" ]; then
    cp "$report" "$OUT/report.md"
    for f in build.log pytest.log junit.xml bench.log sanitizer.log; do
        if [ -e "$logdir/$f" ]; then cp "$logdir/$f" "$OUT/$f"; fi   # (a missing last log is not a failure)
    done
fi

#!/usr/bin/env bash
# One GPU-machine call that runs the named steps and packs every log and result into $OUT/session.tgz
# (the device tool returns at most 8 files). Usage: bash tools/gpu_session.sh STEP...
#   build     build nvfp4_plugin._C for sm_90a in place (system torch)
#   tests     every gpu-marked test (pytest -m gpu), or those in $GPU_TESTS; tests@VAR=VALUE[+VAR=VALUE] with env vars
#   pytest    all tests (any marker) of the files in $PYTEST_FILES, on the GPU
#   sanitize  compute-sanitizer memcheck + racecheck over the compiled ops, then over the Triton kernels
#   sanitize-triton  the Triton part alone; sanitize-cuda the compiled-ops part alone
#   bench-quant@VAR=VALUE[+VAR=VALUE][@op,op]  bench-quant with env vars set (and these --ops, which come after
#             $BENCH_QUANT_ARGS'), e.g. bench-quant@NVFP4_PLUGIN_QUANT_TILING=rows@nvfp4_masked_silu
#   bench-quant / bench-triton / bench-gemm / bench-quantize   the benchmark scripts ($BENCH_QUANTIZE_ARGS, e.g.
#             --methods mse gptq)
#   bench-moe the fused-MoE layer by stage into $R/moe.md ($BENCH_MOE_ARGS, e.g. --sustained 16384, --trace 16384,
#             --no-vllm without the vLLM bundle on PYTHONPATH)
#   info      `nvfp4-plugin info`: the layer plan this GPU gets
#   e2e       benchmarks/bench_e2e.py run into $R/e2e with $E2E_ARGS (e.g. --engines sglang --timeout 600), the
#             engine bundle's site first on PYTHONPATH; sglang-jit: SGLang's Marlin JIT kernels (~6.5 min of nvcc,
#             CPU only: start it early, e.g. with gpu_bg.sh, beside GPU work)
#   tune-gemm tune_gemm.py into a copy of the package configs under $R/configs, used by the later steps
#             ($TUNE_KINDS, default dense,grouped,masked; $TUNE_BUDGET_S, default 420; $TUNE_ARGS more
#             tune_gemm.py options, e.g. --max-m 16)
#   (bench-gemm / bench-quant take more options from $BENCH_GEMM_ARGS / $BENCH_QUANT_ARGS, e.g. --skip-grouped)
#   diag-gemm every tile shape against the reference on the shapes that exposed the wgmma race
#   ncu       Nsight Compute profiles of the GEMM and Triton quant kernels where targets are missed
#             (tools/ncu_profile.py -> $R/ncu/summary.md; $NCU_CASES: space-separated cases)
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/session; mkdir -p "$R"
export NVFP4_PLUGIN_CUDA_ARCHS="${NVFP4_PLUGIN_CUDA_ARCHS:-9.0a}" PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
status=0
step() {
  local name="$1"; shift; local t0=$SECONDS
  echo "=== $name: $*"
  "$@" > "$R/$name.log" 2>&1; local rc=$?
  tail -n 25 "$R/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
  return 0
}
sanitize_cuda() {
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/cuda_sanitizer_driver.py
  step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/cuda_sanitizer_driver.py
}
sanitize_triton() {
  step memcheck-triton compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/triton_sanitizer_driver.py
  step racecheck-triton compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/triton_sanitizer_driver.py
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$R/gpu.txt" 2>&1
for s in "$@"; do
  case "$s" in
    build) PYTHONPATH="$PWD" step build python3 setup.py build_ext --inplace ;;  # box packages only
    tests) NVFP4_PLUGIN_REQUIRE_EXT=1 step tests python3 -m pytest -q -rs --durations=25 -m gpu -p no:cacheprovider ${GPU_TESTS:-tests} ;;
    tests@*=*)  # tests@VAR=VALUE[+VAR=VALUE]: the tests step with env vars set (e.g. a forced kernel variant)
      kv="${s#tests@}"
      NVFP4_PLUGIN_REQUIRE_EXT=1 step "tests-${kv//[^A-Za-z0-9=]/_}" env ${kv//+/ } python3 -m pytest -q -rs -m gpu \
        -p no:cacheprovider ${GPU_TESTS:-tests} ;;
    pytest) NVFP4_PLUGIN_REQUIRE_EXT=1 step pytest python3 -m pytest -q -rs -p no:cacheprovider $PYTEST_FILES ;;
    sanitize) sanitize_cuda; sanitize_triton ;;
    sanitize-triton) sanitize_triton ;;
    sanitize-cuda) sanitize_cuda ;;
    bench-quant@*=*)  # bench-quant@VAR=VALUE[+VAR=VALUE][@op,op]: bench-quant with env vars set (csrc's benchmark knobs)
      kv="${s#bench-quant@}"; ops=""
      case "$kv" in *@*) ops="--ops ${kv#*@}"; ops="${ops//,/ }"; kv="${kv%%@*}" ;; esac
      tag="${kv//[^A-Za-z0-9=]/_}"
      step "bq-$tag" env ${kv//+/ } python3 benchmarks/bench_quant.py --out "$R/$tag" ${BENCH_QUANT_ARGS:-} $ops ;;
    info) step info python3 -m nvfp4_plugin.cli info ;;
    # with an engine bundle's site first on PYTHONPATH (../shared/tools/*-bundle/README.md):
    e2e) step e2e python3 -m benchmarks.bench_e2e run --out "$R/e2e" ${E2E_ARGS:-} ;;
    sglang-jit) step sglang-jit python3 -m benchmarks.bench_e2e prebuild-sglang-jit ;;
    diag-gemm) step diag-gemm python3 tools/diag_gemm_tiles.py ;;
    bench-quant) step bench-quant python3 benchmarks/bench_quant.py --out "$R" ${BENCH_QUANT_ARGS:-} ;;
    bench-triton) step bench-triton python3 benchmarks/bench_triton_quant.py --out "$R/triton_quant_h200.md" ;;
    bench-gemm) step bench-gemm python3 benchmarks/bench_gemm.py --out "$R" ${BENCH_GEMM_ARGS:-} ;;
    bench-moe) step bench-moe python3 -m benchmarks.bench_moe --out "$R/moe.md" ${BENCH_MOE_ARGS:-} ;;
    tune-gemm)  # tunes into a copy of the package configs under $R (comes back in the tarball; later steps use it)
      mkdir -p "$R/configs"; cp nvfp4_plugin/gemm/configs/*.json "$R/configs/"
      export NVFP4_PLUGIN_GEMM_CONFIG_DIR="$R/configs"
      step tune-gemm python3 benchmarks/tune_gemm.py --out "$R" --budget-s "${TUNE_BUDGET_S:-420}" \
        --kinds "${TUNE_KINDS:-dense,grouped,masked}" ${TUNE_ARGS:-} ;;
    ncu) step ncu python3 tools/ncu_profile.py --out "$R/ncu" ${NCU_CASES:+--cases $NCU_CASES} ;;
    bench-quantize) step bench-quantize python3 benchmarks/bench_quantize.py --out "$R/quantize_h200.md" --weight-only-too ${BENCH_QUANTIZE_ARGS:-} ;;
    *) echo "unknown step $s"; status=2 ;;
  esac
done
tar czf "${OUT:-/tmp}/session.tgz" -C "$R" . && ls -la "${OUT:-/tmp}/session.tgz"
exit $status

#!/usr/bin/env bash
# Everything the compiled quantization kernels need on the GPU machine, in one call (H200: ~5 min):
# build nvfp4_plugin._C in place for sm_90a with the system torch, GPU tests, compute-sanitizer
# memcheck + racecheck, benchmark. Steps can be picked: gpu_build.sh [build] [test] [sanitize] [bench].
# Results (benchmark markdown/JSON, logs) go to $OUT if set (the device tool's output folder), else
# benchmarks/results. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/.."

export NVFP4_PLUGIN_CUDA_ARCHS="${NVFP4_PLUGIN_CUDA_ARCHS:-9.0a}"
export MAX_JOBS="${MAX_JOBS:-16}"
RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build test sanitize bench)
status=0

run_step() {
  local name="$1"; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$RESULTS/$name.log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  return "$rc"
}

for step in "${STEPS[@]}"; do
  case "$step" in
    build)
      run_step build python3 setup.py build_ext --inplace || exit "$status"
      run_step import python3 -c "import nvfp4_plugin._C as c, nvfp4_plugin._ext as e, torch; \
print('BUILT_ARCHS', c.BUILT_ARCHS); print('runs on cuda:', e.extension_runs_on(torch.device('cuda')) or 'yes')" \
        || exit "$status"
      ;;
    test)
      NVFP4_PLUGIN_REQUIRE_EXT=1 run_step gpu_tests python3 -m pytest -q -rs -m gpu \
        tests/test_cuda_quant.py tests/test_cuda_peers.py
      ;;
    sanitize)
      run_step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/cuda_sanitizer_driver.py
      run_step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 tests/cuda_sanitizer_driver.py
      ;;
    bench)
      run_step bench python3 benchmarks/bench_quant.py --out "$RESULTS"
      ;;
    *)
      echo "unknown step $step (build, test, sanitize, bench)"; exit 2 ;;
  esac
done
exit "$status"

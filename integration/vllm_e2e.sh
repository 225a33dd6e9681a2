#!/usr/bin/env bash
# End-to-end vLLM serving on the GPU machine, after the vLLM bundle is unpacked to /tmp/site
# (../shared/tools/vllm-bundle/README.md). Usage: bash integration/vllm_e2e.sh STEP...
#   models      make-model Llama and Qwen3-MoE (tiny) and quantize each to ModelOpt and compressed-tensors
#   llama       serve the Llama checkpoints: ours (both formats; default backends, and the reference
#               backend), vLLM's built-in modelopt_fp4, bf16
#   moe         the same for Qwen3-MoE (no bf16)
#   cachecheck  serve one checkpoint with the default backend, then with the reference backend
#   corrupt     a checkpoint with a missing scale tensor and one with an inf global scale must fail cleanly
# Results (one JSON per server, logs) are packed into $OUT/e2e.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}" PATH="/tmp/site/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 \
       HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NVFP4_PLUGIN_LOG_LEVEL=INFO
M=/tmp/models; R=/tmp/e2e; mkdir -p "$M" "$R"
# The package is not pip-installed on the GPU machine: expose its entry points to importlib.metadata
# with a dist-info folder on PYTHONPATH, or vLLM never loads the plugin.
python3 integration/entry_points.py /tmp/nvfp4ep && export PYTHONPATH="/tmp/nvfp4ep:$PYTHONPATH"
python3 -c "from importlib.metadata import entry_points as e; assert any(p.name == 'nvfp4' for p in e(group='vllm.general_plugins')), 'entry point not visible'" || exit 3
status=0
serve() {  # name model [--quantization q] [extra...]
  local name=$1; shift
  echo "=== serve $name"
  python3 integration/serve_check.py --engine vllm --out "$R/$name.json" --log "$R/$name.log" --model "$@" \
    > "$R/$name.summary" 2>&1 || status=1
  head -c 1500 "$R/$name.summary"; echo
}
for s in "$@"; do
  case "$s" in
    models)
      for arch in llama qwen3_moe; do
        python3 -m nvfp4_plugin.cli make-model "$M/$arch-bf16" --arch "$arch" --size tiny || status=1
        for fmt in modelopt compressed-tensors; do
          python3 -m nvfp4_plugin.cli quantize "$M/$arch-bf16" "$M/$arch-$fmt" --format "$fmt" --device cuda || status=1
        done
      done ;;
    llama|moe)
      arch=$([ "$s" = llama ] && echo llama || echo qwen3_moe)
      serve "$arch-ours-modelopt" "$M/$arch-modelopt" --quantization nvfp4
      serve "$arch-ours-ct" "$M/$arch-compressed-tensors" --quantization nvfp4
      NVFP4_PLUGIN_LINEAR_BACKEND=reference NVFP4_PLUGIN_MOE_BACKEND=reference \
        serve "$arch-ours-modelopt-reference" "$M/$arch-modelopt" --quantization nvfp4
      serve "$arch-builtin-modelopt" "$M/$arch-modelopt"
      [ "$s" = llama ] && serve "$arch-bf16" "$M/$arch-bf16" ;;
    cachecheck)  # the reference backend after a default-backend run of the same model (vLLM's compile cache)
      serve "llama-ours-modelopt" "$M/llama-modelopt" --quantization nvfp4
      NVFP4_PLUGIN_LINEAR_BACKEND=reference NVFP4_PLUGIN_MOE_BACKEND=reference \
        serve "llama-ours-modelopt-reference" "$M/llama-modelopt" --quantization nvfp4 ;;
    corrupt)
      rm -rf "$M/bad1" "$M/bad2"; cp -r "$M/llama-modelopt" "$M/bad1"; cp -r "$M/llama-modelopt" "$M/bad2"
      python3 integration/corrupt_checkpoint.py "$M/bad1" drop-tensor model.layers.0.self_attn.k_proj.weight_scale
      python3 integration/corrupt_checkpoint.py "$M/bad2" set-scalar model.layers.1.mlp.down_proj.weight_scale_2 inf
      echo "=== corrupt 1"; python3 integration/serve_check.py --engine vllm --model "$M/bad1" --quantization nvfp4 \
        --timeout 300 --out "$R/corrupt-missing.json" --expect-fail "model.layers.0.self_attn.k_proj.weight_scale" \
        > "$R/corrupt-missing.summary" 2>&1 || status=1; head -c 800 "$R/corrupt-missing.summary"
      echo "=== corrupt 2"; python3 integration/serve_check.py --engine vllm --model "$M/bad2" --quantization nvfp4 \
        --timeout 300 --out "$R/corrupt-inf.json" --expect-fail "model.layers.1.mlp.down_proj.weight_scale_2" \
        > "$R/corrupt-inf.summary" 2>&1 || status=1; head -c 800 "$R/corrupt-inf.summary" ;;
    *) echo "unknown step $s"; status=2 ;;
  esac
done
tar czf "${OUT:-/tmp}/e2e.tgz" -C "$R" . 2>/dev/null; ls -la "${OUT:-/tmp}/e2e.tgz"
exit $status

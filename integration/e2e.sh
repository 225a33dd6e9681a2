#!/usr/bin/env bash
# End-to-end serving on the GPU machine with vLLM or SGLang, after the engine's bundle is unpacked
# (../shared/tools/vllm-bundle/README.md, ../shared/tools/sglang-bundle/README.md).
# Usage: bash integration/e2e.sh ENGINE STEP...     ENGINE: vllm | sglang
#   Environment: SITE (default /tmp/site) = the unpacked bundle; M (default /tmp/models) = checkpoints;
#   R (default /tmp/e2e-ENGINE) = results; PORT (default 8123) and MEMFRAC (GPU memory share per server,
#   default 0.5) let two e2e.sh runs share one GPU (e.g. PORT=8200 MEMFRAC=0.3 for both); VARIANTS (default:
#   all) = the servers llama / moe / smol start, by the name after the model's, e.g. VARIANTS="ours-modelopt
#   builtin-modelopt" for ours against the built-in alone (each server takes 1-3 minutes).
# Steps:
#   models      make-model Llama and Qwen3-MoE (tiny) and quantize each to ModelOpt and compressed-tensors
#   smollm2     quantize the real SmolLM2-135M (bf16 folder in $M/smollm2-bf16) to both formats (or carry
#               a checkpoint quantized elsewhere to $M/smollm2-modelopt: integration/carry_model.sh)
#   llama       serve the Llama checkpoints: ours (both formats; default backends, and the reference
#               backend), the engine's built-in modelopt_fp4, bf16
#   moe         the same for Qwen3-MoE (no bf16)
#   smol        the same for SmolLM2-135M (variants whose folder is absent are skipped)
#   smallmodels make-model Llama "small" (16 heads, 8 KV heads: real head sharding under TP) as llama_small
#               and Qwen3-MoE "small" (8 experts, hidden 1024) as qwen3_moe_small, ModelOpt only
#   tp          TP=1 vs TP=2 (needs 2 GPUs) for ours on the ModelOpt checkpoints of $TP_MODELS (default
#               "llama qwen3_moe llama_small"): greedy text must match (integration/compare_tp.py ->
#               $R/NAME-tp2.md); tp1 / tp2 run one side only (e.g. TP=1 on a one-GPU machine)
#   ep          expert parallel, TP=2 + EP=2 (vLLM --enable-expert-parallel, SGLang --ep-size 2) on
#               $TP_MODELS (default "qwen3_moe qwen3_moe_small"), against the TP=1 result of an earlier
#               tp / tp1 step ($R/NAME-ep2.md; and TP=2 of a tp2 step, NAME-tp2.md); prints the MoE path the
#               server logged; ep2 serves only
#   cachecheck  serve one checkpoint with the default backend, then with the reference backend
#   corrupt     a checkpoint with a missing scale tensor and one with an inf global scale must fail cleanly
#   ref         CPU reference (integration/reference_logprobs.py: transformers fp32 on the dequantized
#               weights) of every ModelOpt checkpoint and bf16 model in $M, and of each ModelOpt checkpoint
#               in bf16 (the bf16 floor: how far bf16 arithmetic alone moves the logprobs)
#   compare     the logprob table of everything in $R (integration/compare_logprobs.py -> $R/compare.md)
# Results (one JSON per server, logs) are packed into $OUT/$(basename $R).tgz (e2e-ENGINE.tgz). $R accumulates over calls
# of one hold (steps can be split across device calls); a later run of a step overwrites its files.
set -uo pipefail
cd "$(dirname "$0")/.."
ENGINE=${1:?usage: e2e.sh vllm|sglang STEP...}; shift
SITE=${SITE:-/tmp/site}; M=${M:-/tmp/models}; R=${R:-/tmp/e2e-$ENGINE}; mkdir -p "$M" "$R"
PORT=${PORT:-8123}; MEMFRAC=${MEMFRAC:-0.5}
export PYTHONPATH="$SITE:$PWD:${PYTHONPATH:-}" PATH="$SITE/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       PYTHONUNBUFFERED=1 NVFP4_PLUGIN_LOG_LEVEL=INFO
case "$ENGINE" in
  vllm) GROUP=vllm.general_plugins; export VLLM_USE_FLASHINFER_SAMPLER=0 ;;
  sglang) GROUP=sglang.srt.plugins
    # SGLang JIT-compiles its bf16 kernels with the box's nvcc, ninja and c++ (sglang-bundle README).
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache
    if ! command -v ninja >/dev/null; then
      nb=$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null) && [ -n "$nb" ] && export PATH="$nb:$PATH"
    fi ;;
  *) echo "unknown engine $ENGINE (vllm | sglang)"; exit 2 ;;
esac
# The package is not pip-installed on the GPU machine: expose its entry points to importlib.metadata
# with a dist-info folder on PYTHONPATH, or the engine never loads the plugin.
python3 integration/entry_points.py /tmp/nvfp4ep && export PYTHONPATH="/tmp/nvfp4ep:$PYTHONPATH"
python3 -c "from importlib.metadata import entry_points as e; assert any(p.name == 'nvfp4' for p in e(group='$GROUP')), 'entry point not visible'" || exit 3
status=0
serve() {  # name model [--quantization q] [extra...]
  local name=$1; shift
  [ -d "$1" ] || { echo "=== $ENGINE serve $name: skipped, $1 is not here"; return; }
  echo "=== $ENGINE serve $name"
  python3 integration/serve_check.py --engine "$ENGINE" --port "$PORT" --mem-fraction "$MEMFRAC" --out "$R/$name.json" --log "$R/$name.log" --model "$@" \
    > "$R/$name.summary" 2>&1 || status=1
  head -c 1500 "$R/$name.summary"; echo
}
quantize_both() {  # name (outputs already there, e.g. carried in, are kept)
  for fmt in modelopt compressed-tensors; do
    [ -d "$M/$1-$fmt" ] && { echo "=== quantize $1 $fmt: $M/$1-$fmt is already there"; continue; }
    [ -d "$M/$1-bf16" ] || { echo "=== quantize $1 $fmt: no $M/$1-bf16"; continue; }
    python3 -m nvfp4_plugin.cli quantize "$M/$1-bf16" "$M/$1-$fmt" --format "$fmt" --device cuda || status=1
  done
}
wanted() {  # variant: in $VARIANTS, or VARIANTS unset
  [ -z "${VARIANTS:-}" ] || [[ " $VARIANTS " == *" $1 "* ]]
}
serve_all() {  # name [with-bf16]
  wanted ours-modelopt && serve "$1-ours-modelopt" "$M/$1-modelopt" --quantization nvfp4
  wanted ours-ct && serve "$1-ours-ct" "$M/$1-compressed-tensors" --quantization nvfp4
  wanted ours-modelopt-reference && NVFP4_PLUGIN_LINEAR_BACKEND=reference NVFP4_PLUGIN_MOE_BACKEND=reference \
    serve "$1-ours-modelopt-reference" "$M/$1-modelopt" --quantization nvfp4
  wanted builtin-modelopt && serve "$1-builtin-modelopt" "$M/$1-modelopt"
  [ -n "${2:-}" ] && wanted bf16 && serve "$1-bf16" "$M/$1-bf16"
  return 0
}
expect_fail() {  # name model text
  echo "=== $ENGINE corrupt $1"
  python3 integration/serve_check.py --engine "$ENGINE" --port "$PORT" --mem-fraction "$MEMFRAC" --model "$2" --quantization nvfp4 --timeout 300 \
    --out "$R/$1.json" --expect-fail "$3" > "$R/$1.summary" 2>&1 || status=1
  head -c 800 "$R/$1.summary"; echo
}
for s in "$@"; do
  case "$s" in
    models)
      for arch in llama qwen3_moe; do
        [ -d "$M/$arch-bf16" ] || python3 -m nvfp4_plugin.cli make-model "$M/$arch-bf16" --arch "$arch" --size tiny || status=1
        quantize_both "$arch"
      done ;;
    smollm2) quantize_both smollm2 ;;
    llama) serve_all llama with-bf16 ;;
    moe) serve_all qwen3_moe ;;
    smol) serve_all smollm2 with-bf16 ;;
    smallmodels)
      [ -d "$M/llama_small-bf16" ] || python3 -m nvfp4_plugin.cli make-model "$M/llama_small-bf16" --arch llama --size small \
        || status=1
      quantize_both llama_small
      [ -d "$M/qwen3_moe_small-bf16" ] || python3 -m nvfp4_plugin.cli make-model "$M/qwen3_moe_small-bf16" \
        --arch qwen3_moe --size small || status=1
      [ -d "$M/qwen3_moe_small-modelopt" ] || python3 -m nvfp4_plugin.cli quantize "$M/qwen3_moe_small-bf16" \
        "$M/qwen3_moe_small-modelopt" --format modelopt --device cuda || status=1 ;;
    tp|tp1|tp2|ep|ep2)
      # vLLM's all-reduce fast paths (custom all-reduce, torch symmetric memory, the fused
      # all-reduce + RMSNorm pass) need NVLink multicast, which the GPU machines keep off: without
      # these flags a TP=2 server dies at its profiling run with an illegal memory access. SGLang's
      # custom all-reduce is turned off the same way (NCCL all-reduce in both engines).
      export VLLM_ALLREDUCE_USE_SYMM_MEM=0
      if [ "$ENGINE" = vllm ]; then
        TP2=(--tensor-parallel-size 2 --disable-custom-all-reduce --compilation-config
             '{"pass_config": {"fuse_allreduce_rms": false}}')
        EP2=("${TP2[@]}" --enable-expert-parallel)
      else
        # (and the FlashInfer all-reduce fusion SGLang turns on for Qwen3-MoE / Llama at TP > 1: its JIT build
        # held a TP=2 server's start for 4.5 minutes)
        TP2=(--tp-size 2 --disable-custom-all-reduce --enforce-disable-flashinfer-allreduce-fusion)
        EP2=("${TP2[@]}" --ep-size 2)
      fi
      case "$s" in
        ep|ep2) tp_models=${TP_MODELS:-qwen3_moe qwen3_moe_small} ;;
        *) tp_models=${TP_MODELS:-llama qwen3_moe llama_small} ;;
      esac
      for name in $tp_models; do
        case "$s" in tp|tp1) serve "$name-tp1" "$M/$name-modelopt" --quantization nvfp4 ;; esac
        case "$s" in tp|tp2) serve "$name-tp2" "$M/$name-modelopt" --quantization nvfp4 -- "${TP2[@]}" ;; esac
        case "$s" in ep|ep2)
          serve "$name-ep2" "$M/$name-modelopt" --quantization nvfp4 -- "${EP2[@]}"
          # which expert-parallel format the engine handed our MoE method, as the server logged it
          grep -h -m 2 "nvfp4_plugin: [A-Za-z]* MoE" "$R/$name-ep2.log" 2>/dev/null ;; esac
        # TP=2 and EP=2 each against TP=1 (from this run or an earlier step of this hold)
        case "$s" in tp|ep)
          for par in tp2 ep2; do
            [ -f "$R/$name-$par.json" ] || continue
            if [ ! -f "$R/$name-tp1.json" ]; then
              echo "=== $name-$par: no TP=1 result to compare with (run the tp1 step first)"; status=1; continue
            fi
            python3 integration/compare_tp.py "$R/$name-tp1.json" "$R/$name-$par.json" --md "$R/$name-$par.md" \
              || status=1
          done ;; esac
      done ;;
    cachecheck)  # the reference backend after a default-backend run of the same model (vLLM's compile cache)
      serve "llama-ours-modelopt" "$M/llama-modelopt" --quantization nvfp4
      NVFP4_PLUGIN_LINEAR_BACKEND=reference NVFP4_PLUGIN_MOE_BACKEND=reference \
        serve "llama-ours-modelopt-reference" "$M/llama-modelopt" --quantization nvfp4 ;;
    corrupt)
      rm -rf "$M/bad1" "$M/bad2"; cp -r "$M/llama-modelopt" "$M/bad1"; cp -r "$M/llama-modelopt" "$M/bad2"
      python3 integration/corrupt_checkpoint.py "$M/bad1" drop-tensor model.layers.0.self_attn.k_proj.weight_scale
      python3 integration/corrupt_checkpoint.py "$M/bad2" set-scalar model.layers.1.mlp.down_proj.weight_scale_2 inf
      expect_fail corrupt-missing "$M/bad1" "model.layers.0.self_attn.k_proj.weight_scale"
      expect_fail corrupt-inf "$M/bad2" "model.layers.1.mlp.down_proj.weight_scale_2" ;;
    ref)
      for name in llama qwen3_moe smollm2; do
        [ -d "$M/$name-modelopt" ] && { python3 integration/reference_logprobs.py --model "$M/$name-modelopt" \
          --out "$R/$name-ref.json" > "$R/$name-ref.summary" 2>&1 || status=1; tail -c 400 "$R/$name-ref.summary"
          python3 integration/reference_logprobs.py --model "$M/$name-modelopt" --dtype bfloat16 \
          --out "$R/$name-ref-bf16.json" > "$R/$name-ref-bf16.summary" 2>&1 || status=1; }
        [ -d "$M/$name-bf16" ] && { python3 integration/reference_logprobs.py --model "$M/$name-bf16" \
          --out "$R/$name-bf16-ref.json" > "$R/$name-bf16-ref.summary" 2>&1 || status=1; }
      done ;;
    compare) python3 integration/compare_logprobs.py "$R" --md "$R/compare.md" || status=1 ;;
    *) echo "unknown step $s"; status=2 ;;
  esac
done
tgz="${OUT:-/tmp}/$(basename "$R").tgz"  # e2e-ENGINE.tgz by default
tar czf "$tgz" -C "$R" . 2>/dev/null; ls -la "$tgz"
exit $status

#!/usr/bin/env bash
# Serve $MODEL with --quantization nvfp4 on $PORT (default 8000) through $NVFP4_PLUGIN_ENGINE (vllm or
# sglang); every argument is passed on to the engine's server.
set -euo pipefail
: "${MODEL:?set MODEL to the NVFP4 checkpoint folder (or hub id) to serve}"
PORT=${PORT:-8000}
case ${NVFP4_PLUGIN_ENGINE:-vllm} in
  vllm)   exec vllm serve "$MODEL" --quantization nvfp4 --host 0.0.0.0 --port "$PORT" "$@" ;;
  sglang) exec python3 -m sglang.launch_server --model-path "$MODEL" --quantization nvfp4 --host 0.0.0.0 \
            --port "$PORT" "$@" ;;
  *) echo "entrypoint: NVFP4_PLUGIN_ENGINE must be vllm or sglang, got ${NVFP4_PLUGIN_ENGINE}" >&2; exit 2 ;;
esac

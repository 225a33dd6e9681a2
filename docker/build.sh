#!/usr/bin/env bash
# The serving image's build steps, runnable outside Docker too (CI on the CPU machine, the H200):
# build the plugin with its compiled extension for NVFP4_PLUGIN_CUDA_ARCHS (default sm_90a, sm_100a,
# sm_103a) into $PYTHON's environment (or into --target DIR), then check the result:
#   * the extension holds code for every requested architecture (cuobjdump, where installed);
#   * with a GPU: the extension loads and `nvfp4-plugin info` runs;
#   * `nvfp4-plugin info --capability X.Y --compile` passes for sm_90, sm_100 and sm_103 (no GPU needed).
# usage: docker/build.sh [--target DIR]            (PYTHON=python3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')     # absolute: the checks run from /
ARCHS=${NVFP4_PLUGIN_CUDA_ARCHS:-9.0a;10.0a;10.3a}
TARGET=""
if [[ ${1:-} == "--target" ]]; then TARGET=$2; fi
log() { echo "docker/build.sh: $*"; }
if [[ -z ${CUDA_HOME:-} ]]; then
  # the toolkit of the nvcc that runs (PATH may hold a wrapper script: ask nvcc itself)
  TOP=$(nvcc --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  if [[ -n $TOP && -f $TOP/include/cuda_runtime.h ]]; then export CUDA_HOME=$(cd "$TOP" && pwd); fi
fi

log "building the extension for $ARCHS with $($PY -c 'import sys, torch; print(sys.executable, "torch", torch.__version__, "CUDA", torch.version.cuda)')"
if [[ -n $TARGET ]]; then
  NVFP4_PLUGIN_CUDA_ARCHS=$ARCHS NVFP4_PLUGIN_REQUIRE_EXT_BUILD=1 \
    "$PY" -m pip install -q --no-deps --no-build-isolation --upgrade --target "$TARGET" .
  export PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH}
else
  NVFP4_PLUGIN_CUDA_ARCHS=$ARCHS NVFP4_PLUGIN_REQUIRE_EXT_BUILD=1 \
    "$PY" -m pip install -q --no-deps --no-build-isolation .
fi
cd /   # from here on, the installed copy, not the source tree
SO=$("$PY" -c 'import importlib.util as u; print(u.find_spec("nvfp4_plugin._C").origin)')
log "extension: $SO"
CUOBJDUMP=${CUOBJDUMP:-$("$PY" -c 'import os, pathlib, shutil
p = shutil.which("cuobjdump")
home = os.environ.get("CUDA_HOME")
if p is None and home and os.access(os.path.join(home, "bin", "cuobjdump"), os.X_OK):
    p = os.path.join(home, "bin", "cuobjdump")
if p is None:                       # an nvidia-* wheel (nvidia/cu13/bin or nvidia/cuda_cuobjdump/bin)
    try:
        import nvidia
        p = next((str(c) for b in nvidia.__path__ for c in sorted(pathlib.Path(b).glob("*/bin/cuobjdump"))
                  if os.access(c, os.X_OK)), None)
    except ImportError:
        pass
print(p or "")')}
if [[ -n $CUOBJDUMP ]]; then
  ELF=$("$CUOBJDUMP" --list-elf "$SO")
  for a in ${ARCHS//;/ }; do
    sm="sm_${a//./}"
    grep -q "$sm" <<<"$ELF" || { log "ERROR: no $sm code in $SO"; echo "$ELF"; exit 1; }
  done
  log "cubins for: $(grep -o 'sm_[0-9]*a' <<<"$ELF" | sort -u | tr '\n' ' ')"
else
  log "cuobjdump not found: architecture check skipped"
fi
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  "$PY" -m nvfp4_plugin.cli info
  "$PY" -c 'from nvfp4_plugin._ext import extension_status as s; st = s(); assert st.loaded, st.error; print("extension loaded:", st.archs)'
fi
for cap in 9.0 10.0 10.3; do
  "$PY" -m nvfp4_plugin.cli info --capability $cap --compile | tail -1
done
log "ok"

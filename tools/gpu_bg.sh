#!/usr/bin/env bash
# Run gpu_session.sh detached so a session can outlast the device tool's 10-minute command limit;
# later calls (each within 30 s of the last, or the machine goes back) wait on it.
#   bash tools/gpu_bg.sh start STEP...   start `gpu_session.sh STEP...` (env passes through), then wait
#   bash tools/gpu_bg.sh wait            wait up to $WAIT_S (default 560) seconds
# When the run has ended, its session.tgz and console log are copied to $OUT and the exit status is
# printed; a wait that times out exits 124 (call `wait` again at once).
set -uo pipefail
cd "$(dirname "$0")/.."
BG=/tmp/gpu_bg
cmd="${1:-wait}"; shift || true
if [ "$cmd" = start ]; then
  if [ -f "$BG/pid" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; then echo "a run is already going"; exit 2; fi
  rm -rf "$BG"; mkdir -p "$BG/out"
  OUT="$BG/out" setsid nohup bash -c 'bash tools/gpu_session.sh "${@:2}"; echo $? > "$1/rc"' _ "$BG" "$@" \
    > "$BG/console.log" 2>&1 < /dev/null &
  echo $! > "$BG/pid"
elif [ "$cmd" != wait ]; then
  echo "usage: gpu_bg.sh start STEP... | wait"; exit 2
fi
[ -d "$BG" ] || { echo "no run was started on this machine (it may have gone back)"; exit 3; }
deadline=$((SECONDS + ${WAIT_S:-560})); shown=0
while [ ! -f "$BG/rc" ] && [ $SECONDS -lt $deadline ]; do
  sleep 5
  n=$(wc -l < "$BG/console.log"); [ "$n" -gt "$shown" ] && sed -n "$((shown + 1)),${n}p" "$BG/console.log" | grep "^===" ; shown=$n
done
if [ ! -f "$BG/rc" ]; then echo "still running ($(tail -n 1 "$BG/console.log"))"; exit 124; fi
cp "$BG/console.log" "$BG"/out/* "${OUT:-/tmp}/" 2>/dev/null
tail -n 60 "$BG/console.log"
echo "run ended with exit $(cat "$BG/rc")"
exit "$(cat "$BG/rc")"

#!/usr/bin/env bash
# Move a checkpoint folder to the GPU machine, whose calls carry at most 64 MiB each.
#   here:  bash integration/carry_model.sh split SRC_DIR NAME [PART_MB]   -> .carry/NAME-0, NAME-1, ... (git-ignored)
#   there: bash integration/carry_model.sh append .carry/NAME-i /tmp/carry  (one call per part, same hold)
#          bash integration/carry_model.sh join /tmp/carry NAME DEST_DIR    (checks sha256, unpacks)
set -euo pipefail
die() { echo "carry_model: ERROR: $*" >&2; exit 1; }
cmd=${1:-}; shift || true
case "$cmd" in
  split)
    [[ $# -ge 2 ]] || die "usage: split SRC_DIR NAME [PART_MB]"
    src=$1; name=$2; mb=${3:-60}
    [[ -d $src ]] || die "$src is not a folder"
    root=$(git rev-parse --show-toplevel); out=$root/.carry; mkdir -p "$out"
    rm -rf "$out/$name"-[0-9] "$out/$name"-[0-9][0-9]; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    tar -C "$(dirname "$src")" -cf "$tmp/$name.tar" "$(basename "$src")"
    (cd "$tmp" && split -b "${mb}M" -d -a 2 "$name.tar" "$name.part-" && sha256sum "$name.tar" > "$name.sha256")
    i=0
    for p in "$tmp/$name".part-*; do
      mkdir -p "$out/$name-$i"; mv "$p" "$out/$name-$i/"; cp "$tmp/$name.sha256" "$out/$name-$i/"; i=$((i + 1))
    done
    echo "split $src into $i carry folders: .carry/$name-0 .. .carry/$name-$((i - 1)) (folder name inside: $(basename "$src"))" ;;
  append)
    [[ $# -eq 2 ]] || die "usage: append CARRY_FOLDER DEST"
    mkdir -p "$2"; cp "$1"/* "$2"/; ls -la "$2" ;;
  join)
    [[ $# -eq 3 ]] || die "usage: join DIR NAME DEST_DIR"
    d=$1; name=$2; dest=$3
    cat "$d/$name".part-* > "$d/$name.tar"
    (cd "$d" && sha256sum --quiet -c "$name.sha256") || die "$name.tar does not match its sha256 (a part is missing?)"
    mkdir -p "$dest"; tar -C "$dest" -xf "$d/$name.tar"; rm -f "$d/$name.tar" "$d/$name".part-*
    echo "joined $name into $dest: $(ls "$dest")" ;;
  *) die "usage: carry_model.sh split|append|join ..." ;;
esac

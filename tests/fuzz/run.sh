#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 60), seeded with the golden
# and malformed files, the documents ortckpt writes, and every past finding
# (tests/fuzz/regressions), keeping the growing corpora under target/fuzz-corpus.
# Targets: the Rust loader (load_bytes), encode/decode round trips (roundtrip),
# the Python API over checkpoints (atheris), and the Python parsers of untrusted
# documents: safetensors files, sharded index.json, the manager's metadata.json
# and compressed checkpoints (atheris-safetensors, atheris-index, atheris-metadata,
# atheris-compressed). Prints one summary line
# per target; exits non-zero on the first finding (libFuzzer writes the input to
# target/fuzz-artifacts: add it to tests/fuzz/regressions with a test).
#
#   tests/fuzz/run.sh [SECONDS] [--dev]     (make fuzz; make fuzz-smoke: 5 --dev)
#
# --dev builds the Rust targets in the dev profile (ASan, debug assertions and overflow checks, no
# optimisation): half the CPU of the release build, which make fuzz's long runs want for the speed of
# each input. A smoke runs every seed and past finding either way, then a short search.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_EACH=${1:-60}
PROFILE=release
BUILD=(-O)
if [ "${2:-}" = --dev ]; then
    PROFILE=debug
    BUILD=(--dev)
fi
PY=${PY:-.venv/bin/python}
CORPUS=target/fuzz-corpus
ARTIFACTS=target/fuzz-artifacts/
BIN=tests/fuzz/target/x86_64-unknown-linux-gnu/$PROFILE
mkdir -p "$CORPUS" "$ARTIFACTS"

command -v cargo-fuzz >/dev/null || cargo install --quiet --locked cargo-fuzz@0.13.2
# cargo-fuzz builds with sanitizer flags that stable rustc accepts only with RUSTC_BOOTSTRAP.
RUSTC_BOOTSTRAP=1 cargo fuzz build --fuzz-dir tests/fuzz "${BUILD[@]}" >/dev/null 2>&1 ||
    RUSTC_BOOTSTRAP=1 cargo fuzz build --fuzz-dir tests/fuzz "${BUILD[@]}"

for target in load_bytes roundtrip atheris atheris-safetensors atheris-index atheris-metadata atheris-compressed; do
    mkdir -p "$CORPUS/$target"
    flags=(-max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -timeout=10 -artifact_prefix="$ARTIFACTS$target-" -print_final_stats=1)
    case "$target" in
        atheris-*)
            kind=${target#atheris-}
            "$PY" tests/fuzz/seed_corpus.py --documents "$kind" "$CORPUS/$target" >/dev/null
            cmd=("$PY" tests/fuzz/atheris_documents.py "$kind") ;;
        atheris)
            "$PY" tests/fuzz/seed_corpus.py "$CORPUS/$target" >/dev/null
            cmd=("$PY" tests/fuzz/atheris_load.py) ;;
        *)
            "$PY" tests/fuzz/seed_corpus.py "$CORPUS/$target" >/dev/null
            cmd=("$BIN/$target") ;;
    esac
    log=target/fuzz-$target.log
    if ! "${cmd[@]}" "$CORPUS/$target" tests/fuzz/regressions "${flags[@]}" >"$log" 2>&1; then
        grep -E "panicked|Error|SUMMARY" "$log" | head -20
        echo "fuzz $target: FINDING, see $log and $ARTIFACTS"
        exit 1
    fi
    runs=$(grep -oE "stat::number_of_executed_units: [0-9]+" "$log" | grep -oE "[0-9]+$")
    cov=$(grep -E "(DONE|pulse|NEW|REDUCE|INITED)" "$log" | tail -1 | grep -oE "cov: [0-9]+" || true)
    echo "fuzz $target: ${SECONDS_EACH}s, $runs runs, $cov, corpus $(ls "$CORPUS/$target" | wc -l) inputs, no findings"
done

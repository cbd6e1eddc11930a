#!/usr/bin/env bash
# Runs the libFuzzer targets in fuzz/ (cargo-fuzz) for a bounded time each and fails on a crash.
#
#   scripts/fuzz.sh                        # every target, 30 s each (CI)
#   FUZZ_SECONDS=3600 scripts/fuzz.sh      # an hour each
#   scripts/fuzz.sh request_sequence       # one target
#   FUZZ_ARGS="-fork=4" scripts/fuzz.sh    # extra libFuzzer flags (here: 4 processes)
#
# FUZZ_SANITIZER=none builds without AddressSanitizer (faster, catches less); FUZZ_TOOLCHAIN=nightly
# uses a nightly toolchain instead of stable + RUSTC_BOOTSTRAP.
#
# What libFuzzer finds goes to fuzz/work/<target>/ (a working corpus, not committed); the
# committed seeds in fuzz/corpus/<target>/ are read, never written. A crash leaves its input in
# fuzz/artifacts/<target>/ and is printed (base64) so it survives a CI log.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_EACH="${FUZZ_SECONDS:-30}"
SANITIZER="${FUZZ_SANITIZER:-address}"
CARGO_FUZZ_VERSION=0.13.2
if [ "$#" -gt 0 ]; then
    TARGETS=("$@")
else
    TARGETS=(frame_decoder request_sequence daemon_frames client_session)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION (about a minute)"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi

# cargo-fuzz passes -Z flags (-Zsanitizer) that only a nightly rustc accepts. These machines
# have the stable toolchain only, and no other can be fetched; stable's rustc takes -Z flags
# under RUSTC_BOOTSTRAP=1 and ships the sanitizer runtimes, so that is what is used.
TOOLCHAIN=()
if [ -n "${FUZZ_TOOLCHAIN:-}" ]; then
    TOOLCHAIN=("+$FUZZ_TOOLCHAIN")
else
    export RUSTC_BOOTSTRAP=1
fi
# Overflow and debug assertions on: an arithmetic overflow on hostile input is a finding.
BUILD=(--release --debug-assertions --sanitizer "$SANITIZER")

# Build every target first, so a build failure is not mistaken for a crash.
for t in "${TARGETS[@]}"; do
    cargo "${TOOLCHAIN[@]}" fuzz build "${BUILD[@]}" "$t"
done

failed=()
for t in "${TARGETS[@]}"; do
    mkdir -p "fuzz/work/$t" "fuzz/artifacts/$t"
    # -timeout: an input running 10 s is a hang (a GET that never answers, a deadlock).
    # -max_len: room for ~100 operations in a request_sequence input.
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of flags
    args=(-max_total_time="$SECONDS_EACH" -timeout=10 -max_len=4096 -print_final_stats=1 ${FUZZ_ARGS:-})
    echo "== fuzz $t for ${SECONDS_EACH}s"
    touch "fuzz/work/$t.start"
    if ! cargo "${TOOLCHAIN[@]}" fuzz run "${BUILD[@]}" "$t" "fuzz/work/$t" "fuzz/corpus/$t" -- "${args[@]}"; then
        failed+=("$t")
    elif [ -n "$(find "fuzz/artifacts/$t" -type f -newer "fuzz/work/$t.start")" ]; then
        failed+=("$t") # -fork mode can go on past a crash; its artifact still counts.
    fi
done

if [ "${#failed[@]}" -gt 0 ]; then
    for t in "${failed[@]}"; do
        echo
        echo "!! fuzz target $t failed. Its inputs:"
        find "fuzz/artifacts/$t" -type f -newer "fuzz/work/$t.start" -print | while read -r a; do
            echo "   $a ($(stat -c %s "$a") bytes), base64:"
            head -c 65536 "$a" | base64 -w 0
            echo
        done
    done
    cat <<EOF

What to do with a crash artifact (base64 above: \`base64 -d > crash\` to get it back):
  reproduce:  RUSTC_BOOTSTRAP=1 cargo fuzz run -a <target> <file>
  minimize:   RUSTC_BOOTSTRAP=1 cargo fuzz tmin -a <target> <file>
  read it:    RUSTC_BOOTSTRAP=1 cargo fuzz fmt -a <target> <file>   (request_sequence: the operations)
then fix the cause, add a regression #[test] (frame_decoder: transport/proto/tests/decode.rs;
request_sequence: engine/tests/), and copy the minimized input into fuzz/corpus/<target>/.
EOF
    exit 1
fi
echo "fuzz: ${TARGETS[*]}: no crash in ${SECONDS_EACH}s each"

#!/usr/bin/env bash
# Builds tests/downstream, a crate outside the workspace that uses cudnn-ops as a dependent would (by
# path, only its public API, cudarc and half through its re-exports): the downstream block example must
# build there. Dependency versions start from the workspace's lock file (offline-friendly, the versions
# the workspace tested); DOWNSTREAM_FRESH=1 resolves them afresh, as `cargo add` would.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
if [[ ${DOWNSTREAM_FRESH:-0} == 1 ]]; then
  rm -f tests/downstream/Cargo.lock
else
  cp Cargo.lock tests/downstream/Cargo.lock
fi
cargo build --manifest-path tests/downstream/Cargo.toml "$@"
echo "downstream crate builds against cudnn-ops"

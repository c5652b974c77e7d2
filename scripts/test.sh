#!/usr/bin/env bash
# The test suite: every unit, property and integration test of the workspace,
# built once in release mode (the same build the binaries use).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release --workspace "$@"

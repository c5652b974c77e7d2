#!/usr/bin/env bash
# The DELI data-loader comparison in one run: straight from a simulated slow
# bucket, from local disk, and through the Stratus loader (prefetch + 25%
# cache), for ~100 KB samples (shard layout) and ~3 KB samples (one object per
# sample), plus link utilisation. Prints PASS/MISS per target; asserts nothing.
# Extra arguments go to the binary (see --help), e.g. --scenario small.
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo run --quiet --release -p ps-worker --bin bench-loader -- "$@"

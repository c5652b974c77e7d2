#!/usr/bin/env bash
# The distributed benchmark: dense vs top-k 1% vs top-k 0.1% parameter-server
# training of an MLP with 1.3M parameters (256-1024-1024-10) on in-process
# clusters (1 server process with 2 shards, 2 workers) behind a simulated
# 100 Mbit/s worker-server link. Prints per-step time split into compute,
# data wait and communication, bytes pushed and pulled per step, the share of
# a step spent on communication, a single-worker compute profile, and the
# targets (top-k 0.1% >= 5x faster per step than dense; communication < 20%
# of a top-k 0.1% step) as PASS/MISS. Never fails on a time; exits non-zero
# only when a run fails. About a minute on 2 cores.
#
# Usage: scripts/bench-cluster.sh [bench-cluster options]
#        scripts/bench-cluster.sh --help        every option
#        scripts/bench-cluster.sh --bandwidth-mbit 1000 --latency-ms 0.5 --json runs/bench.json
# The workers' per-epoch lines are left out here; run
# target/release/bench-cluster directly to see them.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p ps-tests --bin bench-cluster
set +e
timeout 900 target/release/bench-cluster "$@" | { grep -v '^worker [0-9]* epoch ' || true; }
status=${PIPESTATUS[0]}
set -e
if [[ $status -eq 124 ]]; then
    echo "bench-cluster: did not finish within 900 s" >&2
fi
exit "$status"

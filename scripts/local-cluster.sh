#!/usr/bin/env bash
# Run a whole Stratus cluster on this machine: build the binaries, prepare the
# dataset in a local-folder bucket, write the cluster CA, the server
# certificate and one certificate per worker rank to certs/ (`ps-server
# certs`; files already there are kept), start 1 ps-server process (2 shards)
# and 2 ps-workers on loopback, train, print the test accuracy, and stop every
# process it started (also on Ctrl-C or error).
#
# Usage: scripts/local-cluster.sh           synthetic set, configs/local.toml
#        scripts/local-cluster.sh --mnist   MNIST 5k subset, configs/mnist.toml
#                                           (fetched with pip the first time)
#        scripts/local-cluster.sh --mnist-cnn   the same with a small CNN,
#                                           configs/mnist-cnn.toml
# Logs and per-epoch metrics land in runs/.
set -euo pipefail
cd "$(dirname "$0")/.."

dataset=synthetic
config=configs/local.toml
case "${1:-}" in
    "") ;;
    --mnist) dataset=mnist; config=configs/mnist.toml ;;
    --mnist-cnn) dataset=mnist; config=configs/mnist-cnn.toml ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "local-cluster: unknown argument $1 (try --help)" >&2; exit 2 ;;
esac

echo "==> building ps-server and ps-worker (release)"
cargo build --release --bin ps-server --bin ps-worker
bin=target/release

echo "==> preparing the $dataset dataset"
if [[ $dataset == synthetic ]]; then
    [[ -f data/synthetic/manifest.json ]] ||
        "$bin/ps-worker" dataset synthetic --out file://data/synthetic
else
    [[ -f data/mnist/manifest.json ]] || {
        scripts/fetch-mnist.sh data/mnist_5k.csv.gz
        "$bin/ps-worker" dataset mnist --csv data/mnist_5k.csv.gz --out file://data/mnist
    }
fi

echo "==> cluster CA and certificates in certs/"
"$bin/ps-server" --config "$config" certs
mkdir -p runs
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "==> starting ps-server (2 shards) and 2 workers; logs in runs/"
"$bin/ps-server" --config "$config" >runs/server.log 2>&1 &
server=$!
pids+=("$server")
"$bin/ps-worker" --config "$config" train --rank 1 --no-progress --report runs/report-1.json \
    >runs/worker-1.log 2>&1 &
worker1=$!
pids+=("$worker1")
"$bin/ps-worker" --config "$config" train --rank 0 --report runs/report-0.json 2>&1 |
    tee runs/worker-0.log
status=${PIPESTATUS[0]}
wait "$worker1" || status=$?
wait "$server" || status=$?
pids=()
if [[ $status -ne 0 ]]; then
    echo "local-cluster: a process failed (exit $status); see runs/*.log" >&2
    tail -n 5 runs/server.log runs/worker-1.log >&2 || true
    exit "$status"
fi
tail -n 1 runs/worker-1.log
echo "==> done: every process exited cleanly"

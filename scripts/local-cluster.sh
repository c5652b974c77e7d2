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
#        scripts/local-cluster.sh --custom-cnn   MNIST with a CNN written in
#                                           candle-nn, trained through the
#                                           library API (examples/src/bin/
#                                           custom-cnn.rs, configs/custom-cnn.toml)
#        scripts/local-cluster.sh --gpt     a small GPT written in candle-nn,
#                                           trained through the library API on
#                                           the byte tokens of the docs
#                                           (examples/src/bin/tiny-gpt.rs,
#                                           configs/tiny-gpt.toml; docs/gpt.md)
#        scripts/local-cluster.sh --colocated [--mnist|--mnist-cnn|--custom-cnn|--gpt]
#                                           colocated shards: one ps-server
#                                           per worker (server i beside worker
#                                           i, one shard each), the layout for
#                                           cloud VMs that run both (docs/deploy.md,
#                                           "Topologies"); the config is the
#                                           chosen one with cluster.servers and
#                                           shards_per_server rewritten, saved
#                                           as runs/colocated.toml
# Logs and per-epoch metrics land in runs/, and charts of the metrics
# (`ps-data plot runs`) in runs/plots/.
set -euo pipefail
cd "$(dirname "$0")/.."

dataset=synthetic
config=configs/local.toml
colocated=0
program=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --mnist) dataset=mnist; config=configs/mnist.toml ;;
        --mnist-cnn) dataset=mnist; config=configs/mnist-cnn.toml ;;
        --custom-cnn) dataset=mnist; config=configs/custom-cnn.toml; program=custom-cnn ;;
        --gpt) dataset=text; config=configs/tiny-gpt.toml; program=tiny-gpt ;;
        --colocated) colocated=1 ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "local-cluster: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done

echo "==> building ps-server, ps-worker and ps-data${program:+ and $program} (release)"
cargo build --release --bin ps-server --bin ps-worker --bin ps-data ${program:+--bin "$program"}
bin=target/release
# The workers: ps-worker train, or a program that brings its own model
# (same flags, no subcommand).
if [[ -n $program ]]; then worker=("$bin/$program"); else worker=("$bin/ps-worker" train); fi

echo "==> preparing the $dataset dataset"
if [[ $dataset == synthetic ]]; then
    [[ -f data/synthetic/manifest.json ]] ||
        "$bin/ps-data" synthetic --out file://data/synthetic
elif [[ $dataset == text ]]; then
    # The project's documentation as a small corpus of byte tokens.
    text_in=(--in README.md)
    for f in docs/*.md; do [[ -f $f ]] && text_in+=(--in "$f"); done
    [[ -f data/text64/manifest.json ]] ||
        "$bin/ps-data" text "${text_in[@]}" --tokenizer bytes --seq-len 64 --out file://data/text64
else
    [[ -f data/mnist/manifest.json ]] || {
        scripts/fetch-mnist.sh data/mnist_5k.csv.gz
        "$bin/ps-data" mnist --csv data/mnist_5k.csv.gz --out file://data/mnist
    }
fi

mkdir -p runs
workers=$("$bin/ps-worker" --config "$config" show-config | sed -n 's/^workers = \([0-9]*\).*/\1/p' | head -n 1)
[[ $workers =~ ^[1-9][0-9]*$ ]] || { echo "local-cluster: cannot read cluster.workers from $config" >&2; exit 1; }
if [[ $colocated -eq 1 ]]; then
    # One server process per worker, one shard each, on ports 7400, 7401, ...
    servers=""
    for ((i = 0; i < workers; i++)); do servers+="${servers:+, }\"127.0.0.1:$((7400 + i))\""; done
    sed -e "s|^servers = .*|servers = [$servers]    # one ps-server beside each worker|" \
        -e "s|^shards_per_server = .*|shards_per_server = 1|" "$config" >runs/colocated.toml
    config=runs/colocated.toml
    nservers=$workers
else
    nservers=1
fi

echo "==> cluster CA and certificates in certs/"
"$bin/ps-server" --config "$config" certs
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [[ $colocated -eq 1 ]]; then
    echo "==> starting $nservers ps-servers (1 shard each, colocated) and $workers workers; logs in runs/"
else
    echo "==> starting ps-server and $workers workers; logs in runs/"
fi
servers_pids=()
for ((i = 0; i < nservers; i++)); do
    log=runs/server.log
    [[ $nservers -gt 1 ]] && log=runs/server-$i.log
    "$bin/ps-server" --config "$config" --index "$i" >"$log" 2>&1 &
    servers_pids+=($!)
    pids+=($!)
done
others=()
for ((r = 1; r < workers; r++)); do
    "${worker[@]}" --config "$config" --rank "$r" --no-progress \
        --report "runs/report-$r.json" >"runs/worker-$r.log" 2>&1 &
    others+=($!)
    pids+=($!)
done
"${worker[@]}" --config "$config" --rank 0 --report runs/report-0.json 2>&1 |
    tee runs/worker-0.log
status=${PIPESTATUS[0]}
for pid in "${others[@]}" "${servers_pids[@]}"; do
    wait "$pid" || status=$?
done
pids=()
if [[ $status -ne 0 ]]; then
    echo "local-cluster: a process failed (exit $status); see runs/*.log" >&2
    tail -n 5 runs/server*.log runs/worker-*.log >&2 || true
    exit "$status"
fi
for ((r = 1; r < workers; r++)); do tail -n 1 "runs/worker-$r.log"; done
echo "==> done: every process exited cleanly"
metrics_dir=$("$bin/ps-worker" --config "$config" show-config |
    sed -n 's/^metrics_dir = "\(.*\)".*/\1/p' | head -n 1)
if [[ -n "$metrics_dir" ]]; then
    echo "==> charts of the per-epoch metrics ($metrics_dir/worker-*.jsonl):"
    "$bin/ps-data" plot "$metrics_dir" | sed 's/^/  /'
fi

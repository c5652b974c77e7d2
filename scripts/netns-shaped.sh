#!/usr/bin/env bash
# Train over a real, kernel-shaped link: two network namespaces joined by a
# veth pair, each end shaped with `tc ... tbf rate 100mbit burst 32kbit
# latency 50ms`; ps-server (1 process, 2 shards) runs in one namespace on
# 10.231.0.1, both workers in the other on 10.231.0.2, so every request and
# reply crosses the shaped link (the workers share its 100 Mbit/s). It writes
# one config per run and, with `ps-server certs`, a cluster CA, the server
# certificate and the certificates of worker ranks 0 and 1 under
# target/netns-shaped/certs (the second run keeps them). It trains dense and
# then top-k 1%, checks that every process exits 0, prints each worker's
# summary line, and removes the namespaces, the processes it started and its
# data and certificates, also on failure or Ctrl-C; the configs and logs stay
# in target/netns-shaped.
# The addresses exist only inside the namespaces this script creates.
#
# Usage: sudo scripts/netns-shaped.sh [--rate 100mbit] [--epochs N]
# Needs root, iproute2 (ip, tc) and the tbf qdisc; skips (exit 0) otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

rate=100mbit
epochs=2
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rate) rate=${2:?--rate needs a value}; shift 2 ;;
        --epochs) epochs=${2:?--epochs needs a value}; shift 2 ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "netns-shaped: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
[[ $epochs =~ ^[1-9][0-9]*$ ]] || { echo "netns-shaped: --epochs must be a positive integer" >&2; exit 2; }

say() { echo "netns-shaped: $*"; }
if [[ $(id -u) -ne 0 ]]; then
    say "needs root (network namespaces and tc); skipping"
    exit 0
fi
for tool in ip tc timeout; do
    command -v "$tool" >/dev/null 2>&1 || { say "$tool is not installed; skipping"; exit 0; }
done

ns_srv="stratus-srv-$$"
ns_wrk="stratus-wrk-$$"
veth_srv="stxs$$"
veth_wrk="stxw$$"
srv_ip=10.231.0.1
wrk_ip=10.231.0.2
work="target/netns-shaped"
pids=()

cleanup() {
    local rc=$?
    set +e
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null; done
    ip netns del "$ns_srv" 2>/dev/null
    ip netns del "$ns_wrk" 2>/dev/null
    rm -rf "$work/data" "$work/certs"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say "building ps-server and ps-worker (release)"
cargo build --release --bin ps-server --bin ps-worker --bin ps-data
bin="$PWD/target/release"

rm -rf "$work"
mkdir -p "$work/runs"
"$bin/ps-data" synthetic --out "file://$PWD/$work/data/synthetic" \
    --train 4096 --test 1024 >/dev/null

say "creating namespaces $ns_srv ($srv_ip) and $ns_wrk ($wrk_ip), veth shaped to $rate each way"
ip netns add "$ns_srv"
ip netns add "$ns_wrk"
ip link add "$veth_srv" type veth peer name "$veth_wrk"
ip link set "$veth_srv" netns "$ns_srv"
ip link set "$veth_wrk" netns "$ns_wrk"
ip -n "$ns_srv" addr add "$srv_ip/24" dev "$veth_srv"
ip -n "$ns_wrk" addr add "$wrk_ip/24" dev "$veth_wrk"
for ns in "$ns_srv" "$ns_wrk"; do ip -n "$ns" link set lo up; done
ip -n "$ns_srv" link set "$veth_srv" up
ip -n "$ns_wrk" link set "$veth_wrk" up
if ! ip netns exec "$ns_srv" tc qdisc add dev "$veth_srv" root tbf rate "$rate" burst 32kbit latency 50ms ||
    ! ip netns exec "$ns_wrk" tc qdisc add dev "$veth_wrk" root tbf rate "$rate" burst 32kbit latency 50ms; then
    say "tc tbf is not available here; skipping"
    exit 0
fi
ip netns exec "$ns_wrk" tc qdisc show dev "$veth_wrk" | sed 's/^/  /'

# One config per run, written from scratch so nothing depends on local.toml.
write_config() { # kind density server_momentum file
    cat >"$4" <<EOF
[cluster]
servers = ["$srv_ip:7400"]
shards_per_server = 2
workers = 2
token = "stratus-netns-token"

[tls]
cert = "$PWD/$work/certs/server.pem"
key = "$PWD/$work/certs/server.key"
ca = "$PWD/$work/certs/ca.pem"
ca_key = "$PWD/$work/certs/ca.key"
worker_cert = "$PWD/$work/certs/worker-{rank}.pem"
worker_key = "$PWD/$work/certs/worker-{rank}.key"
server_name = "localhost"
generate_if_missing = false

[model]
kind = "mlp"
input = 64
hidden = [256]
classes = 10

[data]
url = "file://$PWD/$work/data/synthetic"

[training]
epochs = $epochs
metrics_dir = ""

[compression]
kind = "$1"
density = $2

[optimizer]
lr = 0.05
momentum = $3

[server]
connect_timeout_secs = 30
EOF
}

run_case() { # name kind density server_momentum
    local name=$1 cfg="$work/$2.toml" status=0
    write_config "$2" "$3" "$4" "$cfg"
    "$bin/ps-server" --config "$cfg" certs >/dev/null
    local t0
    t0=$(date +%s.%N)
    ip netns exec "$ns_srv" timeout 300 "$bin/ps-server" --config "$cfg" --index 0 run \
        >"$work/runs/server-$2.log" 2>&1 &
    local server=$!
    pids+=("$server")
    local workers=()
    for rank in 0 1; do
        ip netns exec "$ns_wrk" timeout 300 "$bin/ps-worker" --config "$cfg" train --rank "$rank" \
            --no-progress >"$work/runs/worker-$2-$rank.log" 2>&1 &
        workers+=($!)
        pids+=($!)
    done
    for pid in "${workers[@]}" "$server"; do wait "$pid" || status=$?; done
    pids=()
    local t1
    t1=$(date +%s.%N)
    if [[ $status -ne 0 ]]; then
        say "$name: a process failed (exit $status)" >&2
        tail -n 5 "$work/runs/server-$2.log" "$work/runs/worker-$2-"*.log >&2
        return 1
    fi
    say "$name: finished in $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s"
    grep -h "done:" "$work/runs/worker-$2-0.log" "$work/runs/worker-$2-1.log" | sed 's/^/  /'
}

run_case "dense (server momentum 0.9)" none 1.0 0.9
run_case "top-k 1% (server momentum 0)" topk 0.01 0.0
say "PASSED: both runs finished over the shaped link; logs in $work/runs"

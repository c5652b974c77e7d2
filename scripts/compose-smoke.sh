#!/usr/bin/env bash
# Smoke test of docker-compose.yml that needs no registry: take the release
# binaries ps-server, ps-worker and ps-data that `scripts/test.sh` (cargo test
# --release --workspace) builds, so after the test suite nothing is compiled
# again, put them with the shared libraries they link (ldd) and the host's
# dynamic loader in a FROM-scratch image (Dockerfile.scratch, nothing is
# pulled), run the compose cluster (certs and
# dataset one-shots, 2 servers, 2 workers) with an override that uses that
# image, wait for the training run to finish, check that every container
# exited 0, that `certs` wrote the cluster CA, the server certificate and the
# certificates of worker ranks 0 and 1, with the CA key in the `ca` volume
# that no server or worker mounts, and that both workers reached the
# accuracy bar, print a summary, and remove everything it created
# (containers, network, volumes, image), also on failure or Ctrl-C.
#
# Usage: scripts/compose-smoke.sh               docker-compose.yml
#        scripts/compose-smoke.sh --colocated   with docker-compose.colocated.yml
#                                               on top (each worker in its
#                                               server's network namespace,
#                                               checked to reach it through
#                                               its same-host socket)
# Environment: SMOKE_TIMEOUT    seconds allowed for the cluster run (default 600)
#              SMOKE_ACCURACY   test accuracy bar in percent (default 90)
#              SMOKE_KEEP_LOGS  keep target/compose-smoke/*.log (default 1)
# Exits 0 with a message when no Docker engine or compose tool is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."

timeout_s=${SMOKE_TIMEOUT:-600}
bar=${SMOKE_ACCURACY:-90}
keep_logs=${SMOKE_KEEP_LOGS:-1}
files=(-f docker-compose.yml)
case "${1:-}" in
    "") ;;
    --colocated) files+=(-f docker-compose.colocated.yml) ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "compose-smoke: unknown argument $1 (try --help)" >&2; exit 2 ;;
esac

say() { echo "compose-smoke: $*"; }

if ! command -v docker >/dev/null 2>&1; then
    say "no docker client installed; skipping"
    exit 0
fi
if ! timeout 30 docker info >/dev/null 2>&1; then
    say "no Docker engine reachable (docker info failed); skipping"
    exit 0
fi
if command -v docker-compose >/dev/null 2>&1; then
    compose_tool=(docker-compose)
elif timeout 30 docker compose version >/dev/null 2>&1; then
    compose_tool=(docker compose)
else
    say "neither docker-compose nor the docker compose plugin is installed; skipping"
    exit 0
fi
command -v cargo >/dev/null 2>&1 || { say "cargo (Rust toolchain) is required" >&2; exit 1; }

started=$(date +%s)
id="$(date +%s)-$$"
project="stratus-smoke-${id//-/}"
image="stratus-smoke:$id"
work=target/compose-smoke
context="$work/context"
override="$work/override.yml"
mkdir -p "$work"
rm -rf "$context"

compose() {
    "${compose_tool[@]}" -p "$project" "${files[@]}" -f "$override" "$@"
}

image_built=0
cluster_started=0
cleanup() {
    local rc=$?
    set +e
    if [[ $cluster_started -eq 1 ]]; then
        timeout 120 "${compose_tool[@]}" -p "$project" "${files[@]}" -f "$override" \
            down --volumes --remove-orphans --timeout 5 >"$work/down.log" 2>&1 ||
            say "warning: compose down failed; see $work/down.log"
    fi
    if [[ $image_built -eq 1 ]]; then
        timeout 60 docker rmi -f "$image" >/dev/null 2>&1 || say "warning: could not remove $image"
    fi
    rm -rf "$context"
    [[ $keep_logs == 1 ]] || rm -f "$work"/*.log
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. the release binaries -------------------------------------------------
# The same command and features as scripts/test.sh, so after the test suite
# this compiles nothing (a separate `cargo build -p ...` would resolve other
# features and build most crates again).
say "building (or reusing) the release binaries of cargo test --release --workspace"
cargo test --release --workspace --no-run >"$work/build.log" 2>&1 || {
    say "the release build failed; see $work/build.log" >&2
    tail -n 20 "$work/build.log" >&2
    exit 1
}
bin="${CARGO_TARGET_DIR:-target}/release"
binaries=(ps-server ps-worker ps-data)
for b in "${binaries[@]}"; do
    [[ -x $bin/$b ]] || { say "$bin/$b was not built" >&2; exit 1; }
done
# The shared libraries they link and the dynamic loader, by absolute path.
libs=$(for b in "${binaries[@]}"; do ldd "$bin/$b"; done |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
[[ -n $libs ]] || { say "ldd listed no libraries for $bin/ps-server" >&2; exit 1; }

# --- 2. offline image ---------------------------------------------------------
mkdir -p "$context/rootfs/usr/local/bin" "$context/rootfs/stratus/configs" \
    "$context/rootfs/stratus/ca" "$context/rootfs/stratus/certs" "$context/rootfs/stratus/data" \
    "$context/rootfs/stratus/runs" "$context/rootfs/stratus/run" "$context/rootfs/tmp"
chmod 1777 "$context/rootfs/tmp"
for b in "${binaries[@]}"; do cp "$bin/$b" "$context/rootfs/usr/local/bin/"; done
strip "$context"/rootfs/usr/local/bin/* 2>/dev/null || true
for lib in $libs; do cp -L --parents "$lib" "$context/rootfs/"; done
say "image contents: ${binaries[*]}, $(wc -w <<<"$libs") libraries ($(tr '\n' ' ' <<<"$libs"))"
cp configs/*.toml "$context/rootfs/stratus/configs/"
cp Dockerfile.scratch "$context/Dockerfile"
say "building image $image from scratch (no pulls)"
image_built=1
timeout 300 docker build --pull=false -q -t "$image" "$context" >/dev/null
size_bytes=$(docker image inspect -f '{{.Size}}' "$image")
say "image $image: $((size_bytes / 1000000)) MB"

# --- 3. the compose cluster ---------------------------------------------------
services=(certs dataset ps-server-0 ps-server-1 ps-worker-0 ps-worker-1)
{
    echo "# generated by scripts/compose-smoke.sh: use the offline image"
    echo "services:"
    for s in "${services[@]}"; do
        echo "  $s:"
        echo "    image: $image"
    done
} >"$override"

say "starting the cluster (project $project, ${compose_tool[*]})"
cluster_started=1
run_started=$(date +%s)
timeout "$timeout_s" env STRATUS_IMAGE="$image" "${compose_tool[@]}" -p "$project" \
    "${files[@]}" -f "$override" up -d --no-build "${services[@]}" \
    >"$work/up.log" 2>&1 || {
    say "compose up failed; see $work/up.log" >&2
    tail -n 20 "$work/up.log" >&2
    compose logs --no-color >"$work/cluster.log" 2>&1 || true
    tail -n 40 "$work/cluster.log" >&2
    exit 1
}

waited=()
for s in ps-worker-0 ps-worker-1 ps-server-0 ps-server-1; do
    cid=$(compose ps -q "$s")
    [[ -n $cid ]] || { say "no container for $s" >&2; exit 1; }
    waited+=("$cid")
done
left=$((timeout_s - ($(date +%s) - run_started)))
((left > 10)) || left=10
say "waiting up to ${left}s for both workers and both servers to finish"
if ! codes=$(timeout "$left" docker wait "${waited[@]}"); then
    say "the cluster did not finish within ${timeout_s}s" >&2
    compose logs --no-color >"$work/cluster.log" 2>&1 || true
    tail -n 40 "$work/cluster.log" >&2
    exit 1
fi
run_s=$(($(date +%s) - run_started))
compose logs --no-color >"$work/cluster.log" 2>&1 || true
mapfile -t codes_arr <<<"$codes"

# --- 4. checks ----------------------------------------------------------------
fail=0
names=(ps-worker-0 ps-worker-1 ps-server-0 ps-server-1)
for i in "${!names[@]}"; do
    code=${codes_arr[$i]:-missing}
    if [[ $code != 0 ]]; then
        say "${names[$i]} exited with $code" >&2
        fail=1
    fi
done
for one_shot in certs dataset; do
    cid=$(compose ps -q "$one_shot")
    code=$(docker inspect -f '{{.State.ExitCode}}' "$cid" 2>/dev/null || echo missing)
    [[ $code == 0 ]] || { say "$one_shot exited with $code" >&2; fail=1; }
done
# `ps-server certs` prints "wrote PATH" or "kept PATH ..." for every file.
certs_log=$(docker logs "$(compose ps -q certs)" 2>&1 || true)
cert_files=(ca/ca.key certs/ca.pem certs/server.pem certs/server.key certs/worker-0.pem
    certs/worker-0.key certs/worker-1.pem certs/worker-1.key)
for f in "${cert_files[@]}"; do
    if ! grep -qE "^(wrote|kept) /stratus/$f( |\$)" <<<"$certs_log"; then
        say "certs did not write /stratus/$f" >&2
        fail=1
    fi
done
# What the servers and workers can read: the certificates, never the CA key.
for i in "${!names[@]}"; do
    seen=$(for dir in certs ca; do
        docker cp "${waited[$i]}:/stratus/$dir" - 2>/dev/null | tar -t 2>/dev/null
    done)
    if ! grep -qx "certs/ca.pem" <<<"$seen"; then
        say "${names[$i]} does not see /stratus/certs/ca.pem" >&2
        fail=1
    fi
    if grep -q "ca.key" <<<"$seen"; then
        say "${names[$i]} can read the CA key:" $(grep "ca.key" <<<"$seen") >&2
        fail=1
    fi
done
accuracies=()
for rank in 0 1; do
    cid=${waited[$rank]}
    line=$(docker logs "$cid" 2>&1 | grep -E "^worker $rank done:" | tail -n 1 || true)
    if [[ -z $line ]]; then
        say "worker $rank printed no summary" >&2
        fail=1
        continue
    fi
    echo "  $line"
    acc=$(sed -E 's/.*test accuracy ([0-9.]+)%.*/\1/' <<<"$line")
    accuracies+=("$acc")
    if ! awk -v a="$acc" -v b="$bar" 'BEGIN { exit !(a + 0 >= b + 0) }'; then
        say "worker $rank test accuracy $acc% is below the bar of $bar%" >&2
        fail=1
    fi
    docker cp "$cid:/stratus/runs/report-$rank.json" "$work/report-$rank.json" >/dev/null 2>&1 ||
        { say "worker $rank wrote no report JSON" >&2; fail=1; }
done
grep -h "epoch" "$work/cluster.log" | grep -E "ps-worker-0" | sed 's/^/  /' || true
# Colocated, worker i reaches server i through its same-host socket (the
# volume the colocated file shares between them), never falling back to QUIC.
if [[ ${#files[@]} -gt 2 ]]; then
    for rank in 0 1; do
        if ! grep -E "ps-worker-${rank}[-_]" "$work/cluster.log" | grep -q "requests go through its Unix socket"; then
            say "worker $rank did not take server $rank's same-host socket" >&2
            fail=1
        fi
    done
    if grep -q "same-host path unusable" "$work/cluster.log"; then
        say "a worker fell back from the same-host socket:" >&2
        grep "same-host path unusable" "$work/cluster.log" >&2
        fail=1
    fi
fi

total_s=$(($(date +%s) - started))
echo
say "summary"
echo "  compose tool:     ${compose_tool[*]} ($("${compose_tool[@]}" version --short 2>/dev/null || echo '?'))"
echo "  image:            $image, $((size_bytes / 1000000)) MB (FROM scratch: the release binaries, their libraries and loader)"
layout="separate network namespaces"
[[ ${#files[@]} -gt 2 ]] && layout="colocated: worker i in server i's network namespace, requests to it through its Unix socket"
echo "  cluster:          2 ps-server (1 shard each) + 2 ps-worker, configs/compose.toml ($layout)"
echo "  certificates:     ${cert_files[*]} (ca and certs volumes; servers and workers see no CA key)"
echo "  exit codes:       workers ${codes_arr[0]:-?} ${codes_arr[1]:-?}, servers ${codes_arr[2]:-?} ${codes_arr[3]:-?}"
echo "  test accuracy:    ${accuracies[*]:-none} % (bar $bar%)"
echo "  cluster run:      ${run_s}s (compose up to last exit); whole smoke test ${total_s}s"
echo "  logs and reports: $work/"
if [[ $fail -ne 0 ]]; then
    say "FAILED" >&2
    exit 1
fi
say "PASSED"

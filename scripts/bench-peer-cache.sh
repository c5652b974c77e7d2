#!/usr/bin/env bash
# The peer cache benchmark through a real S3 API: a local S3-compatible
# server (moto, from PyPI, in its own venv) holds the dataset, and every GET
# the ranks send crosses its HTTP API behind the simulated bucket's latency
# and bandwidth. Arguments go to bench-peer-cache (see its --help).
#
#   scripts/bench-peer-cache.sh                 # 3 ranks, 3 epochs
#   scripts/bench-peer-cache.sh --workers 4 --epochs 4
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${STRATUS_S3_VENV:-target/venv-s3}
PORT=${STRATUS_S3_PORT:-5077}
if [ ! -x "$VENV/bin/moto_server" ]; then
  echo "installing a local S3 server (moto) into $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "moto[server]"
fi
cargo build --release -p ps-worker --bin bench-peer-cache

mkdir -p target
"$VENV/bin/moto_server" -H 127.0.0.1 -p "$PORT" >target/s3-server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
# Wait (at most 30 s) until the server answers, then create the bucket.
"$VENV/bin/python" - "$PORT" <<'PY'
import sys, time, urllib.request
port = sys.argv[1]
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
        break
    except Exception:
        time.sleep(0.1)
else:
    sys.exit("the S3 server did not start; see target/s3-server.log")
req = urllib.request.Request(f"http://127.0.0.1:{port}/stratus-bench", method="PUT")
urllib.request.urlopen(req, timeout=10)
PY

export AWS_ENDPOINT="http://127.0.0.1:$PORT" AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
       AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench
target/release/bench-peer-cache --url s3://stratus-bench/peer-cache "$@"

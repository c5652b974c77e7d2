#!/usr/bin/env bash
# GPT convergence against torch (docs/gpt.md, "Convergence against torch"):
# the same GPT, initial weights (one safetensors file per seed), batches in
# the same order and AdamW schedule, trained by torch in one process and by
# a Stratus cluster (1 ps-server, dense AdamW, then top-k 1% with lazy
# AdamW on the server, then top-k 1% of each worker's AdamW direction,
# optimizer.moments = "worker"); prints each validation loss, dense/torch
# (target <= 1.02) and top-k/dense (target <= 1.03) with PASS/MISS.
# Asserts nothing. --modes picks the Stratus runs.
#
# Python: $PYTHON when set, else venv/bin/python, made here on first use
# (python3 -m venv venv && pip install torch numpy safetensors, from PyPI).
# The corpus is the repository's own README, docs and Rust sources: no
# download. Extra arguments go to scripts/gpt_convergence.py (--help), e.g.
#   scripts/bench-gpt-convergence.sh --seeds 2,3 --steps 200
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z ${PYTHON:-} ]]; then
    if [[ ! -x venv/bin/python ]] || ! venv/bin/python -c 'import torch, numpy, safetensors' 2>/dev/null; then
        echo "==> making venv/ with torch, numpy and safetensors (PyPI)"
        python3 -m venv venv
        venv/bin/pip install --quiet torch numpy safetensors
    fi
    PYTHON=venv/bin/python
fi

echo "==> building ps-server, ps-worker and ps-data (release)"
cargo build --quiet --release --bin ps-server --bin ps-worker --bin ps-data
bin=${CARGO_TARGET_DIR:-target}/release

exec "$PYTHON" scripts/gpt_convergence.py --bin "$bin" "$@"

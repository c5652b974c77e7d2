#!/usr/bin/env bash
# Check the CUDA worker on a machine with an NVIDIA GPU, from the binaries of
# scripts/build-cuda.sh alone (nothing is built or downloaded here), and print
# one table, each line PASS or MISS:
#   1. every layer kind's forward pass, gradients and parameter writes on
#      CUDA against the CPU (relative error <= 1e-3): conv 1x1 / 3x3 /
#      stride 2 / bias, batch norm (train and eval), relu, max / average /
#      global pooling, residual blocks, linear, dropout, the MLP, the CNN,
#      ResNet-20 and a narrow ResNet-18 (`gpu-check`);
#   2. ResNet-20 and ResNet-18 forward + backward step times at batch 32 and
#      128 on the GPU, against torch on the same GPU when --python (default
#      python3) has torch with CUDA (target: ResNet-20 <= 1.5x torch); without
#      one it says so and reports the times alone;
#   3. a local cluster, 1 ps-server (2 shards) and 2 ps-workers on loopback,
#      configs/local.toml with training.device = "cuda" on the synthetic set
#      (made here, nothing is downloaded): both workers must end at >= 90% test
#      accuracy.
# It takes a few minutes of GPU time. The exit status is 0 when every part
# ran, whatever the rows say, and non-zero when something could not run
# (binaries or CUDA libraries missing, no GPU, a process failing).
#
# The binaries need the CUDA 13 shared libraries (libcudart, libcublas,
# libcublasLt, libcurand, libnvrtc) and the driver's libcuda.so.1. They are
# looked for, in order, in --cuda-lib, the build's venv (target/cuda-venv),
# the nvidia wheels of --python (e.g. torch built for CUDA 13), and
# /usr/local/cuda/lib64.
#
# Usage: scripts/gpu-check.sh [--bin DIR] [--python PYTHON] [--cuda-lib DIR]
#            [--device cuda|cuda:N|cpu] [--quick] [--no-bench] [--no-cluster]
#   --bin      directory of ps-worker, ps-server, ps-data and gpu-check
#              (default: $CUDA_TARGET_DIR/release, else target/cuda/release)
#   --device   the device checked (cpu runs every part on the CPU, which
#              exercises this script on a machine with no GPU)
#   --quick    the single-layer cases only, batch 32 only, 5 timed steps
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

bin=${CUDA_TARGET_DIR:-$root/target/cuda}/release
python=python3
cuda_lib=""
device=cuda
quick=0
bench=1
cluster=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --bin) bin=$2; shift ;;
        --python) python=$2; shift ;;
        --cuda-lib) cuda_lib=$2; shift ;;
        --device) device=$2; shift ;;
        --quick) quick=1 ;;
        --no-bench) bench=0 ;;
        --no-cluster) cluster=0 ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done
bin=$(cd "$bin" 2>/dev/null && pwd) || { echo "gpu-check: no directory $bin (run scripts/build-cuda.sh, or give --bin)" >&2; exit 2; }
for b in ps-worker ps-server ps-data gpu-check; do
    [[ -x $bin/$b ]] || { echo "gpu-check: $bin/$b is missing (run scripts/build-cuda.sh)" >&2; exit 2; }
done
say() { echo "gpu-check: $*" >&2; }

# The CUDA libraries.
dirs=()
[[ -n $cuda_lib ]] && dirs+=("$cuda_lib")
for py in "$root/target/cuda-venv/bin/python" "$python"; do
    d=$("$py" -c 'import nvidia, os; print(":".join(p for p in (os.path.join(d, "cu13", "lib") for d in nvidia.__path__) if os.path.isdir(p)))' 2>/dev/null) || continue
    [[ -n $d ]] && dirs+=("$d")
done
[[ -d /usr/local/cuda/lib64 ]] && dirs+=(/usr/local/cuda/lib64)
libpath=$(IFS=:; echo "${dirs[*]}")
export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
missing=$(ldd "$bin/gpu-check" 2>/dev/null | sed -n 's/^\s*\(\S*\) => not found/\1/p' | tr '\n' ' ')
if [[ -n $missing ]]; then
    say "cannot run: shared libraries not found: $missing(looked in: ${libpath:-nothing}; give --cuda-lib DIR)"
    exit 2
fi
if [[ $device == cuda* ]] && command -v nvidia-smi >/dev/null; then
    say "GPU: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n 1)"
fi
[[ -f $bin/cuda-compute-cap ]] && say "kernels built for compute capability $(cat "$bin/cuda-compute-cap")"

work=$root/target/gpu-check
rm -rf "$work"
mkdir -p "$work"
rows=$work/rows.md
: >"$rows"
failed=()

quick_args=()
[[ $quick -eq 1 ]] && quick_args=(--quick)

say "1/3 layers on $device against the CPU"
if ! "$bin/gpu-check" --device "$device" --reference cpu "${quick_args[@]}" \
    >"$work/compare.md" 2>"$work/compare.log"; then
    say "the comparison could not run: $(tail -n 3 "$work/compare.log")"
    failed+=(comparison)
fi
grep '^| ' "$work/compare.md" | grep -v '^| check ' >>"$rows" || true

if [[ $bench -eq 1 ]]; then
    torch_args=()
    want="torch.cuda.is_available()"
    [[ $device == cpu ]] && want=True
    if "$python" -c "import torch, sys; sys.exit(0 if $want else 1)" 2>/dev/null; then
        torch_args=(--python "$python" --torch-script "$root/scripts/gpu_torch.py")
        say "2/3 step times on $device, torch $("$python" -c 'import torch; print(torch.__version__)') beside"
    else
        say "2/3 step times on $device; torch comparison skipped: $python has no torch with CUDA"
        echo "| torch comparison | skipped: $python has no torch with CUDA | - | - |" >>"$rows"
    fi
    bench_args=(--batches 32,128 --steps 20)
    [[ $quick -eq 1 ]] && bench_args=(--batches 32 --steps 5)
    if ! "$bin/gpu-check" --device "$device" --no-compare --bench "${bench_args[@]}" \
        "${torch_args[@]}" >"$work/bench.md" 2>"$work/bench.log"; then
        say "the timings could not run: $(tail -n 3 "$work/bench.log")"
        failed+=(timings)
    fi
    grep '^| ' "$work/bench.md" | grep -v '^| check ' >>"$rows" || true
fi

if [[ $cluster -eq 1 ]]; then
    say "3/3 local cluster (1 server, 2 workers) with training.device = \"$device\""
    c=$work/cluster
    mkdir -p "$c"
    sed -e "s|^device = .*|device = \"$device\"|" configs/local.toml >"$c/cluster.toml"
    pids=()
    cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
    trap cleanup EXIT
    status=0
    (
        cd "$c" || exit 1
        "$bin/ps-data" synthetic --out file://data/synthetic >dataset.log 2>&1 &&
            "$bin/ps-server" --config cluster.toml certs >certs.log 2>&1
    ) || status=$?
    if [[ $status -eq 0 ]]; then
        (cd "$c" && exec timeout 600 "$bin/ps-server" --config cluster.toml >server.log 2>&1) &
        pids+=($!)
        for r in 0 1; do
            (cd "$c" && exec timeout 600 "$bin/ps-worker" --config cluster.toml train --rank "$r" \
                --no-progress --report "report-$r.json" >"worker-$r.log" 2>&1) &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
        pids=()
    fi
    if [[ $status -ne 0 ]]; then
        say "the cluster failed (exit $status); logs in $c"
        tail -n 3 "$c"/*.log >&2 || true
        failed+=(cluster)
    else
        for r in 0 1; do
            acc=$(grep -o '"final_accuracy": *[0-9.eE+-]*' "$c/report-$r.json" | sed 's/.*: *//')
            pass=$(awk -v a="${acc:-0}" 'BEGIN { print (a >= 0.90) ? "PASS" : "MISS" }')
            echo "| cluster 1 server + 2 workers on $device (MLP, top-k 1%, 5 epochs): worker $r test accuracy | ${acc:-none} | >= 0.90 | $pass |" >>"$rows"
        done
    fi
fi

echo
echo "| check | value | bar | result |"
echo "|---|---|---|---|"
cat "$rows"
echo
npass=$(grep -c '| PASS |$' "$rows" || true)
nmiss=$(grep -c '| MISS |$' "$rows" || true)
echo "gpu-check: $npass PASS, $nmiss MISS${failed[*]:+; could not run: ${failed[*]}} (files in $work)"
[[ ${#failed[@]} -eq 0 ]]

#!/usr/bin/env bash
# Build the CUDA worker (`ps-worker --features cuda`, its `gpu-check` binary)
# with ps-server and ps-data, on any x86-64 Linux machine, with or without a GPU.
#
# The CUDA toolkit comes from pinned PyPI wheels installed into a Python venv
# (target/cuda-venv; made on the first run, reused after). CUDA 13.0, because
# the CUDA 12 wheels (nvidia-cuda-nvcc-cu12) ship no nvcc, only ptxas, while
# the CUDA 13 ones ship the whole compiler (nvcc, cicc, cudafe++, headers):
#   nvidia-cuda-nvcc, -crt, nvidia-nvvm   nvcc: candle-kernels compiles its
#                                         kernels to PTX (and a small static
#                                         library) at build time
#   nvidia-cuda-runtime, -cccl            headers; libcudart (linked)
#   nvidia-cublas, nvidia-curand,
#   nvidia-cuda-nvrtc                     linked by cudarc (candle's CUDA
#                                         binding, "dynamic-linking": the
#                                         shared libraries are needed at link
#                                         time and at run time)
# The driver library (libcuda.so.1) is not in any wheel: the link uses a stub
# made here from the symbol names in cuda.h (target/cuda-venv/sdk/lib); at run
# time the GPU machine's driver provides the real one (CUDA 13.0 needs driver
# 580 or newer).
#
# The kernels are compiled for one compute capability: CUDA_COMPUTE_CAP
# (default 90: H100/H200, built as sm_90a; 80 for A100, whose PTX the driver
# also JIT-compiles for newer GPUs). Set it to the GPU the binaries will run on.
#
# The build goes to its own target dir, target/cuda (override with
# CUDA_TARGET_DIR), so the CPU build is untouched; the binaries are
# $CUDA_TARGET_DIR/release/{ps-worker,ps-server,gpu-check}, with stripped
# copies in $CUDA_TARGET_DIR/gpu-bundle to carry to a GPU machine. Compiling candle's
# kernels takes tens of minutes on a 2-core machine (the first time only).
# Running them needs the CUDA 13 shared libraries on the library path:
# scripts/gpu-check.sh finds them (this venv, a Python's nvidia wheels, or
# /usr/local/cuda).
#
# Usage: scripts/build-cuda.sh [--python PYTHON] [--jobs N]
#   --python   the Python that makes the venv (default python3, 3.9 or newer)
#   --jobs     cargo's and nvcc's parallel jobs (default: all cores)
# It exits non-zero, naming the step, when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

python=python3
jobs=$(nproc)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) python=$2; shift ;;
        --jobs) jobs=$2; shift ;;
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        *) echo "build-cuda: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done

step=start
trap 'echo "build-cuda: FAILED at step: $step" >&2' ERR
say() { echo "build-cuda: $*"; }

# One consistent CUDA 13.0 set (the pins of the cuda-toolkit 13.0.3.0
# meta-package).
pins=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.1.1.3
    nvidia-curand==10.4.0.35
)
cap=${CUDA_COMPUTE_CAP:-90}
if ! [[ $cap =~ ^[0-9]{2,3}a?$ ]]; then
    step="check CUDA_COMPUTE_CAP"
    echo "build-cuda: CUDA_COMPUTE_CAP=$cap is not a compute capability like 80 or 90" >&2
    exit 2
fi
venv=$root/target/cuda-venv
target=${CUDA_TARGET_DIR:-$root/target/cuda}

step="make the venv ($venv)"
stamp=$venv/.stratus-pins
if [[ ! -x $venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "${pins[*]}" ]]; then
    say "installing the CUDA wheels into $venv: ${pins[*]}"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    step="pip install the CUDA wheels"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}"
    echo "${pins[*]}" >"$stamp"
else
    say "CUDA wheels already in $venv"
fi

step="find the CUDA toolkit in the venv"
cuda=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
for f in bin/nvcc nvvm/bin/cicc include/cuda.h lib/libcudart.so.13 lib/libcublas.so.13 \
    lib/libcublasLt.so.13 lib/libcurand.so.10 lib/libnvrtc.so.13; do
    [[ -e $cuda/$f ]] || { echo "build-cuda: $cuda/$f is missing from the wheels" >&2; false; }
done
version=$("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
say "nvcc $version at $cuda/bin/nvcc; compute capability $cap"

step="make the link directory (unversioned names, libcuda stub)"
sdk=$venv/sdk
mkdir -p "$sdk/lib"
for lib in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
    ln -sfn "$cuda/lib/lib$lib" "$sdk/lib/lib${lib%.so.*}.so"
done
if [[ ! -e $sdk/lib/libcuda.so || $cuda/include/cuda.h -nt $sdk/lib/libcuda.so ]]; then
    grep -oE '\bcu[A-Z][A-Za-z0-9_]*\b' "$cuda/include/cuda.h" | sort -u |
        sed 's/.*/void &(void) {}/' >"$sdk/cuda-stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$sdk/lib/libcuda.so" "$sdk/cuda-stub.c"
fi

step="cargo build (ps-worker --features cuda, ps-server, ps-data) into $target"
export CUDA_HOME=$cuda CUDA_ROOT=$cuda CUDA_PATH=$cuda CUDA_TOOLKIT_ROOT_DIR=$sdk
export NVCC=$cuda/bin/nvcc PATH=$cuda/bin:$PATH CUDA_COMPUTE_CAP=$cap
export CUDAFORGE_THREADS=$jobs
export CARGO_TARGET_DIR=$target
say "building; logs of nvcc appear as cargo warnings"
start=$(date +%s)
cargo build --release --jobs "$jobs" -p ps-worker --features cuda --bins
cargo build --release --jobs "$jobs" -p ps-server -p ps-data
step="check the binaries"
for bin in ps-worker ps-server ps-data gpu-check; do
    [[ -x $target/release/$bin ]] || { echo "build-cuda: $target/release/$bin was not built" >&2; false; }
done
echo "$cap" >"$target/release/cuda-compute-cap"
say "built in $(($(date +%s) - start)) s (compute capability $cap, CUDA $version):"
ls -l "$target/release/ps-worker" "$target/release/ps-server" "$target/release/ps-data" "$target/release/gpu-check"
step="make the stripped bundle"
bundle=$target/gpu-bundle
mkdir -p "$bundle"
for bin in ps-worker ps-server ps-data gpu-check; do
    strip -o "$bundle/$bin" "$target/release/$bin"
done
cp "$target/release/cuda-compute-cap" "$bundle/"
say "stripped copies to carry to a GPU machine: $bundle ($(du -sh "$bundle" | cut -f1)); there: scripts/gpu-check.sh --bin $bundle"
say "run them with LD_LIBRARY_PATH=$cuda/lib (scripts/gpu-check.sh finds it)"

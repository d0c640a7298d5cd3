#!/usr/bin/env bash
# The GPU checks in one run, on a CUDA node: the CUDA tests (tests/loader/test_gpu.py and the CUDA cases of
# tests/transforms/test_transforms.py), the synthetic-vs-fed training rates (benchmarks.gpu), and `dlstore bench`
# on the same shards. Then the peers on the node's cores (benchmarks.peers, one round) where webdataset
# is there, and decode threads against worker processes (benchmarks.gpu workers). Results go to $OUT
# (default ./gpu-check).
#
#   bash benchmarks/gpu_check.sh --wheels               # here, with pip: wheels a bare GPU image lacks -> .whl/
#   bash benchmarks/gpu_check.sh --wheels --with-torch  # ... and the pinned torch pair with its CUDA libraries
#   bash benchmarks/gpu_check.sh                        # on the GPU node (installs what .whl/ holds and it lacks)
#   DLSTORE_GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh  # a dry run: every step on the CPU, small and short
#
# It fails, with the reason, when there is no GPU or torch sees none, when torch and torchvision are
# not tools/setup.sh's pinned pair (or DLSTORE_TORCH_SPEC, e.g. "torch torchvision" for any), when a
# CUDA test is skipped for want of a device, or when a step fails.
# The interpreter is setup.sh's: .venv/bin/python when there is one, else python3 (or $PYTHON).
# The steps' timeouts add up to 10 minutes, a lent machine's limit for one command; DLSTORE_FEW_CORES=0
# leaves out the 4-core pass (taskset), for a rerun in less time.
# On a lent device machine: carry [".whl"] (ignored by git). It writes more files than such a
# machine sends back: set OUT=/tmp/gc, then tar /tmp/gc into $OUT. The torch wheels do not travel
# there: the image's torch must be the pair, or DLSTORE_TORCH_SPEC must say which it is.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "" 2>/dev/null; then
        PYTHON=.venv/bin/python
    fi
fi
# The pinned pair, read from tools/setup.sh (one place says it).
TORCH_SPEC=${DLSTORE_TORCH_SPEC:-$(sed -n 's/^TORCH_SPEC=\${DLSTORE_TORCH_SPEC:-"\(.*\)"}$/\1/p' tools/setup.sh)}
[[ -n $TORCH_SPEC ]] || { echo "gpu_check: cannot read the pinned torch pair from tools/setup.sh" >&2; exit 1; }

if [[ ${1:-} == "--wheels" ]]; then
    # For the Python of the GPU node (3.12 unless DLSTORE_WHEEL_PY says otherwise), manylinux x86-64.
    version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
    target=(--only-binary=:all: --python-version "${DLSTORE_WHEEL_PY:-3.12}" --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    # What dlstore's local-store path needs beyond torch, numpy, pillow and tqdm (their own
    # dependencies are in any torch image), then the test tools with theirs.
    "$PYTHON" -m pip download -q --no-deps "${target[@]}" -d .whl \
        "tenacity==$(version tenacity)" "simplejpeg==$(version simplejpeg)" "xxhash==$(version xxhash)" \
        "webdataset==$(version webdataset)" "braceexpand==$(version braceexpand)" \
        "psutil==$(version psutil)"  # for benchmarks/
    "$PYTHON" -m pip download -q "${target[@]}" -d .whl \
        "pytest==$(version pytest)" "pytest-timeout==$(version pytest-timeout)"
    # nvImageCodec for the CUDA tests of device_decoder="nvimgcodec" (~29 MB), with the nvJPEG it
    # loads; for CUDA 13 images, as the torch pair's.
    "$PYTHON" -m pip download -q --no-deps "${target[@]}" -d .whl \
        "nvidia-nvimgcodec-cu13==${DLSTORE_NVIMGCODEC_VERSION:-0.9.0.20}" "nvidia-nvjpeg==${DLSTORE_NVJPEG_VERSION:-13.3.2.43}"
    if [[ ${2:-} == "--with-torch" ]]; then
        # shellcheck disable=SC2086
        "$PYTHON" -m pip download -q "${target[@]}" -d .whl/torch $TORCH_SPEC
    fi
    ls -l .whl
    exit
fi

# -- preflight: a GPU, a torch that sees it, the pinned pair ----------------------------------
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
DRY=${DLSTORE_GPU_CHECK_DRY:-0}
device=cuda
# Per step: the sizes of a real run, or of a dry run, which checks the script and not the figures.
gpu_sizes=(--images 8000 --steps 150)
gil_sizes=(--images 1000 --seconds 4)
bench_sizes=(--batches 10)
peers_sizes=(--images 8000 --shards 32 --batch-size 256 --single-core-samples 300)
engines_sizes=(--images 4000)
if [[ $DRY == 1 ]]; then
    device=cpu
    gpu_sizes=(--images 512 --steps 20 --skip-steps 5 --demand-steps 4 --model resnet18 --batch-size 16 --decode worker)
    gil_sizes=(--images 200 --seconds 1)
    bench_sizes=(--quick)
    peers_sizes=(--images 400 --shards 4 --batch-size 32 --single-core-samples 40)
    engines_sizes=(--images 256 --batch-size 32)
    echo "gpu_check: a dry run on the CPU (DLSTORE_GPU_CHECK_DRY=1): the steps, not the figures"
elif ! command -v nvidia-smi >/dev/null; then
    echo "gpu_check: no GPU here (no nvidia-smi): run it on a GPU node" >&2
    exit 2
elif ! nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; then
    echo "gpu_check: nvidia-smi fails (no usable GPU or driver):" >&2
    cat "$OUT/nvidia-smi.txt" >&2
    exit 2
fi

torch_matches() {  # whether this interpreter's torch and torchvision satisfy TORCH_SPEC
    "$PYTHON" - "$TORCH_SPEC" <<'EOF' >/dev/null 2>&1
import importlib.metadata as metadata
import sys

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for requirement in map(Requirement, sys.argv[1].split()):
    if not requirement.specifier.contains(metadata.version(requirement.name), prereleases=True):
        sys.exit(1)
EOF
}

site=$(mktemp -d -t dlstore-site-XXXXXX)
work=$(mktemp -d -t dlstore-gpu-XXXXXX)
trap 'rm -rf "$work" "$site"' EXIT
wheels=()
if compgen -G ".whl/*.whl" >/dev/null; then
    wheels+=(.whl/*.whl)
fi
if ! torch_matches && compgen -G ".whl/torch/*.whl" >/dev/null; then
    echo "gpu_check: this torch is not $TORCH_SPEC: installing the pair from .whl/torch"
    wheels+=(.whl/torch/*.whl)
fi
if ((${#wheels[@]})); then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}"
fi
export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DLSTORE_SKIP_SWIFT=1
# The crop-only JPEG decode (dlstore/transforms/jpeg_region.c), built in place where the node has a compiler
# and libjpeg-turbo's headers; without them dlstore decodes whole JPEGs (versions.txt says which).
"$PYTHON" setup.py -q build_ext --inplace >"$OUT/build_ext.txt" 2>&1 ||
    echo "gpu_check: dlstore.transforms.jpeg_region not built here (see $OUT/build_ext.txt): whole JPEGs are decoded"
"$PYTHON" -c "import tenacity, simplejpeg, xxhash, psutil, pytest, pytest_timeout" ||
    { echo "gpu_check: packages missing: bash benchmarks/gpu_check.sh --wheels (with pip), then carry .whl/" >&2; exit 1; }
"$PYTHON" - <<'EOF' | tee "$OUT/versions.txt"
import sys

import simplejpeg
import torch
import torchvision

print(sys.executable, "torch", torch.__version__, "torchvision", torchvision.__version__, "CUDA", torch.version.cuda)
try:
    import cv2

    opencv = cv2.__version__
except ImportError:
    opencv = "missing (dlstore resizes with Pillow then: slower; pip install opencv-python-headless)"
print("opencv", opencv, "simplejpeg", simplejpeg.__version__)
try:
    from dlstore.transforms import jpeg_region

    rows = "batches built in C" if hasattr(jpeg_region, "crop_rows") else "image by image"
    print("crop-only decode: libjpeg-turbo", jpeg_region.libjpeg_turbo_version, "-", rows)
except ImportError:
    print("crop-only decode: not built (whole JPEGs are decoded)")
EOF
if [[ $DRY == 1 ]]; then
    :
elif ! torch_matches; then
    echo "gpu_check: torch and torchvision are not $TORCH_SPEC (tools/setup.sh's pair, or DLSTORE_TORCH_SPEC):" \
        "put that pair's wheels in .whl/torch (--wheels --with-torch), or set DLSTORE_TORCH_SPEC to the pair to check" >&2
    exit 3
fi
if [[ $DRY != 1 ]] && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
    echo "gpu_check: torch sees no CUDA device, though nvidia-smi does (driver ${driver:-?}, this torch" \
        "built for CUDA $("$PYTHON" -c "import torch; print(torch.version.cuda)")): a wheel newer than the" \
        "driver, CUDA_VISIBLE_DEVICES, or a CPU-only torch; see $OUT/nvidia-smi.txt" >&2
    exit 3
fi
"$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" |
    tee -a "$OUT/versions.txt"
# The batch slots live in /dev/shm (prefetch x workers + 2 batches per rank).
{ nproc; df -h /dev/shm; ulimit -n; } >"$OUT/host.txt" 2>&1

# -- the checks: each runs to its end, the exit status says whether all passed ----------------
echo "== CUDA tests"
tests=0
timeout -k 15 100 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/loader/test_gpu.py tests/transforms/test_transforms.py 2>&1 |
    tee "$OUT/gpu-tests.txt" || tests=$?
if [[ $DRY != 1 ]] && { grep -q "needs a CUDA device" "$OUT/gpu-tests.txt" || ! grep -Eq "[0-9]+ passed" "$OUT/gpu-tests.txt"; }; then
    echo "gpu_check: CUDA tests were skipped or none passed: they did not run on the GPU" >&2
    if [[ $tests == 0 ]]; then tests=1; fi
fi

echo "== synthetic vs fed training rate, decode threads and worker processes"
bench=0
workers=$(($(nproc) > 3 ? $(nproc) - 2 : 1))
counts="4,8,$workers"
if [[ $DRY == 1 ]]; then counts="1,$workers"; fi
timeout -k 15 200 "$PYTHON" -m benchmarks.gpu --workdir "$work" --stored full "${gpu_sizes[@]}" --device $device \
    --engines threads,processes --workers "$workers" --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt" || bench=$?
if [[ ${DLSTORE_FEW_CORES:-1} == 1 ]] && command -v taskset >/dev/null; then
    # A node with few cores per GPU: the loader on 4 of them, CPU decode against nvJPEG (the decode modes).
    echo "== the same on 4 cores (taskset -c 0-3)"
    timeout -k 15 120 taskset -c 0-3 "$PYTHON" -m benchmarks.gpu --workdir "$work" --stored full "${gpu_sizes[@]}" \
        --device $device --engines threads --workers 4 --json "$OUT/bench_gpu_4cores.json" 2>&1 | tee "$OUT/bench_gpu_4cores.txt" || bench=$?
fi

echo "== one decode thread beside a Python-busy thread (benchmarks.gil)"
timeout -k 10 40 "$PYTHON" -m benchmarks.gil --workdir "$work/gil" "${gil_sizes[@]}" --rounds 1 2>&1 |
    tee "$OUT/gil.txt" || bench=$?

echo "== dlstore bench (stage split, beside Python, verdict)"
verdict=0
timeout -k 15 60 "$PYTHON" -m dlstore bench "file://$work/store/train" --device $device --workers "$workers" \
    "${bench_sizes[@]}" --json "$OUT/dlstore_bench.json" 2>&1 | tee "$OUT/dlstore_bench.txt" || verdict=$?

echo "== the peers on this node's cores (benchmarks.peers)"
peers=0
if "$PYTHON" -c "import webdataset" 2>/dev/null; then
    timeout -k 15 90 "$PYTHON" -m benchmarks.peers --workdir "$work/peers" --workers "$workers" "${peers_sizes[@]}" \
        --rounds 1 --epochs 2 --rss-workers "$workers" --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.txt" || peers=$?
else
    echo "no webdataset here: skipped (bash benchmarks/gpu_check.sh --wheels fetches it)"
fi

echo "== decode threads against worker processes (benchmarks.gpu workers)"
engines=0
timeout -k 10 70 "$PYTHON" -m benchmarks.gpu workers --workers "$counts" "${engines_sizes[@]}" --rounds 1 \
    --json "$OUT/workers.json" 2>&1 | tee "$OUT/workers.txt" || engines=$?

echo "exit codes: tests $tests, bench_gpu $bench, dlstore bench $verdict, peers $peers, engines $engines"
[[ $tests == 0 && $bench == 0 && $verdict == 0 && $peers == 0 && $engines == 0 ]]

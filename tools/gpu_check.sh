#!/usr/bin/env bash
# The GPU checks in one run, on a CUDA node: the CUDA tests (tests/test_gpu.py), the
# synthetic-vs-fed training rates (tools/bench_gpu.py), and `dlstore bench` on the same
# shards (the stage split and verdict on this GPU). Results go to $OUT (default ./gpu-check).
#
#   bash tools/gpu_check.sh --wheels   # here, with pip: wheels of what a bare GPU image lacks -> .whl/
#   bash tools/gpu_check.sh            # on the GPU node (installs .whl/*.whl first, if any)
#
# Budget: about 5 minutes on an H100 node with 16 cores; the steps' timeouts add up to 9 minutes.
# On the lent device machine: run `bash tools/gpu_check.sh` with carry [".whl"] (ignored by git).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--wheels" ]; then
    # The packages dlstore's local-store path needs beyond torch, numpy, pillow and tqdm, for
    # the Python of the GPU node (3.12 unless DLSTORE_WHEEL_PY says otherwise).
    version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${DLSTORE_WHEEL_PY:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "tenacity==$(version tenacity)" "simplejpeg==$(version simplejpeg)"
    ls -l .whl
    exit
fi

OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/dlstore-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/dlstore-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DLSTORE_SKIP_SWIFT=1
python3 -c "import tenacity, simplejpeg, pytest" || { echo "missing packages: see --wheels"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# The batch slots live in /dev/shm (prefetch x workers + 2 batches per rank).
{ nproc; df -h /dev/shm; ulimit -n; } > "$OUT/host.txt" 2>&1
python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/versions.txt"

echo "== CUDA tests"
timeout -k 15 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.txt"
tests=${PIPESTATUS[0]}

echo "== synthetic vs fed training rate"
timeout -k 15 300 python3 tools/bench_gpu.py --workdir "$work" --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.txt"
bench=${PIPESTATUS[0]}

echo "== dlstore bench (stage split, verdict)"
workers=$(( $(nproc) - 2 ))
timeout -k 15 90 python3 -m dlstore bench "file://$work/store/train" --device cuda --workers "$workers" --batches 10 \
    --json "$OUT/dlstore_bench.json" 2>&1 | tee "$OUT/dlstore_bench.txt"
verdict=${PIPESTATUS[0]}

echo "exit codes: tests $tests, bench_gpu $bench, dlstore bench $verdict"
[ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$verdict" = 0 ]

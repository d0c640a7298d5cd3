#!/usr/bin/env bash
# Install dlstore and what it needs on a fresh Debian/Ubuntu machine with Python >= 3.10.
#   bash tools/setup.sh          # the package, torch + torchvision, the trainer's extras
#   bash tools/setup.sh --test   # also the test tools, memcached and the local Swift server
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# torch 2.14.1 + torchvision 0.29.1: the pair that imports together here (see README, "Install").
# Override with DLSTORE_TORCH_SPEC, e.g. "torch torchvision" to take the newest.
TORCH_SPEC=${DLSTORE_TORCH_SPEC:-"torch==2.14.1 torchvision==0.29.1"}
if ! "$PYTHON" -c "import torch, torchvision" >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install --quiet $TORCH_SPEC
fi
"$PYTHON" -m pip install --quiet -e ".[train,fast]"

if [[ "${1:-}" == "--test" ]]; then
    "$PYTHON" -m pip install --quiet -e ".[train,fast,test]"
    "$PYTHON" tools/swift_server.py install
    "$PYTHON" tools/swift_server.py install --flavor debian
fi

#!/usr/bin/env bash
# Run the tests against a local Swift server that this script starts and stops.
#   bash tools/run_tests.sh [pytest args...]          # ruff, every test, then the compat pass
#   bash tools/run_tests.sh --quick [pytest args...]  # ruff, the unit tier, a Swift smoke test
# The compat pass runs the `compat` tests again against Debian's Swift 2.30, whose s3api
# differs; DLSTORE_COMPAT_PASS=0 skips it. The unit tier needs no Swift, Slurm or torchrun.
# Runs with .venv/bin/python (what `bash tools/setup.sh --test` installs), else $PYTHON or python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
else
    PYTHON=${PYTHON:-python3}
fi
SWIFT_SERVER=(-m tests.support.swift_server)
data_dirs=()
cleanup() {
    for d in "${data_dirs[@]}"; do
        timeout -k 10 120 "$PYTHON" "${SWIFT_SERVER[@]}" stop --data-dir "$d" >/dev/null 2>&1 || true
        rm -rf "$d"
    done
}
trap cleanup EXIT

start_swift() {  # flavor -> sets env_file (not in a $(...) subshell: data_dirs must reach the trap)
    local d
    d=$(mktemp -d -t dlstore-swift-XXXXXX)
    data_dirs+=("$d")
    "$PYTHON" "${SWIFT_SERVER[@]}" start --flavor "$1" --data-dir "$d" --listing-limit 100 >/dev/null
    env_file="$d/env.sh"
}

"$PYTHON" -m ruff check .

if [[ "${1:-}" == "--quick" ]]; then
    shift
    "$PYTHON" -m pytest -q -m "not swift and not slurm and not torchrun and not slow" "$@"
    echo "== Swift smoke test: the storage contract on the Swift and S3 APIs"
    start_swift "${DLSTORE_SWIFT_FLAVOR:-pypi}"
    DLSTORE_SWIFT_ENV=$env_file "$PYTHON" -m pytest -q -m "swift and not slow" tests/storage/test_store_contract.py
    exit
fi

start_swift "${DLSTORE_SWIFT_FLAVOR:-pypi}"
DLSTORE_SWIFT_ENV=$env_file "$PYTHON" -m pytest "$@"

if [[ "${DLSTORE_COMPAT_PASS:-1}" != "0" && "${DLSTORE_SWIFT_FLAVOR:-pypi}" != "debian" ]]; then
    echo "== the compat tests against Debian's Swift 2.30"
    start_swift debian
    DLSTORE_SWIFT_ENV=$env_file "$PYTHON" -m pytest -q -m "compat and not slow" tests
fi

#!/usr/bin/env bash
# Start the local Swift server (Swift API + S3 API), run the whole test suite, stop the server.
# Then, unless DLSTORE_COMPAT_PASS=0, run the storage and conversion tests once more against
# Debian's older Swift 2.30 (what many testbeds run; its s3api differs: see README).
#   bash tools/run_tests.sh [pytest args...]
# Runs with .venv/bin/python, what `bash tools/setup.sh --test` installed into; without a .venv
# (a checkout installed by hand), with $PYTHON or python3.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
else
    PYTHON=${PYTHON:-python3}
fi
data_dirs=()
cleanup() {
    for d in "${data_dirs[@]}"; do
        timeout -k 10 120 "$PYTHON" tools/swift_server.py stop --data-dir "$d" >/dev/null 2>&1 || true
        rm -rf "$d"
    done
}
trap cleanup EXIT

start_swift() {  # flavor -> sets env_file (not in a $(...) subshell: data_dirs must reach the trap)
    local d
    d=$(mktemp -d -t dlstore-swift-XXXXXX)
    data_dirs+=("$d")
    "$PYTHON" tools/swift_server.py start --flavor "$1" --data-dir "$d" --listing-limit 100 >/dev/null
    env_file="$d/env.sh"
}

"$PYTHON" -m ruff check dlstore tests tools

start_swift "${DLSTORE_SWIFT_FLAVOR:-pypi}"
DLSTORE_SWIFT_ENV=$env_file "$PYTHON" -m pytest "$@"

if [[ "${DLSTORE_COMPAT_PASS:-1}" != "0" && "${DLSTORE_SWIFT_FLAVOR:-pypi}" != "debian" ]]; then
    echo "== storage and conversion tests against Debian's Swift 2.30"
    start_swift debian
    DLSTORE_SWIFT_ENV=$env_file "$PYTHON" -m pytest -q -m "not slow" \
        tests/test_store_contract.py tests/test_storage_integration.py tests/test_convert.py tests/test_swift_server.py \
        tests/test_reliability_faults.py::test_a_server_that_ignores_range_still_gives_the_bytes_asked_for \
        tests/test_reliability_faults.py::test_an_object_replaced_between_a_cut_and_its_resume_is_an_error \
        tests/test_reliability_faults.py::test_a_large_object_read_resumes_on_the_same_version
fi

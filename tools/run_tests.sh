#!/usr/bin/env bash
# Start the local Swift server (Swift API + S3 API), run the whole test suite, stop the server.
#   bash tools/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
data_dir=$(mktemp -d -t dlstore-swift-XXXXXX)
cleanup() { "$PYTHON" tools/swift_server.py stop --data-dir "$data_dir" >/dev/null 2>&1 || true; rm -rf "$data_dir"; }
trap cleanup EXIT
"$PYTHON" tools/swift_server.py start --data-dir "$data_dir" --listing-limit 100 >/dev/null
export DLSTORE_SWIFT_ENV="$data_dir/env.sh"
"$PYTHON" -m ruff check dlstore tests tools
"$PYTHON" -m pytest "$@"

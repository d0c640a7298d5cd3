#!/usr/bin/env bash
# Stop the local Swift server that tools/start-swift.sh started (only the processes it recorded).
#   tools/stop-swift.sh [--data-dir DIR]      (default: $DLSTORE_SWIFT_DIR or ~/.cache/dlstore/swift-data)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/swift_server.py" stop "$@"

#!/usr/bin/env bash
# Install (when missing) and start the local Swift server; the export lines go to stdout.
#   eval "$(tools/start-swift.sh [swift_server.py start options])"
# Flavor: $DLSTORE_SWIFT_FLAVOR (pypi or debian). See tools/swift_server.py for everything else.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
"$python" "$here/swift_server.py" install >&2
exec "$python" "$here/swift_server.py" start "$@"

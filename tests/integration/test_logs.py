"""Output a user can read: the storage SDKs' request logs stay out of `-v` runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _cp_missing(swift_server, container: str, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **swift_server.swift_env()}
    for name in [k for k in env if k.startswith(("OS_", "AWS_"))]:
        del env[name]
    cmd = [sys.executable, "-m", "dlstore", *flags, "cp", f"swift://{container}/missing.bin", str(tmp_path / "out")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags", [(), ("-v",)])
def test_a_404_probe_prints_no_sdk_request_lines(swift_server, swift_container, tmp_path, flags):
    done = _cp_missing(swift_server, swift_container, tmp_path, *flags)
    assert done.returncode != 0 and "NotFound" in done.stderr
    assert "REQ: curl" not in done.stderr and "RESP STATUS" not in done.stderr
    assert swift_server.key not in done.stderr


def test_the_sdk_request_lines_come_back_with_vv(swift_server, swift_container, tmp_path):
    # The check above can see them: -vv (debug) lets the SDKs speak, secrets still hidden.
    done = _cp_missing(swift_server, swift_container, tmp_path, "-vv")
    assert "REQ: curl" in done.stderr

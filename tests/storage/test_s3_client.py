"""make_s3_client against a botocore older than dlstore's floor: a ConfigError naming the
version (no server: building a client talks to nobody); and the S3 store against a server
that ignores Range headers, which the local Swift does not (and a proxy cannot make it:
S3 signs the Range header).
"""

from __future__ import annotations

import http.server
import threading

import botocore.config
import pytest

from dlstore.config import S3Config, Secret, StoreConfig
from dlstore.errors import ConfigError
from dlstore.storage.s3 import S3Store, make_s3_client

CHECKSUM_OPTIONS = ("request_checksum_calculation", "response_checksum_validation")


class Botocore135Config(botocore.config.Config):
    """botocore.config.Config as botocore 1.35 has it: without the checksum options (new in 1.36)."""

    OPTION_DEFAULTS = {k: v for k, v in botocore.config.Config.OPTION_DEFAULTS.items() if k not in CHECKSUM_OPTIONS}


@pytest.fixture
def old_botocore(monkeypatch):
    monkeypatch.setattr(botocore.config, "Config", Botocore135Config)


def test_old_botocore_gives_a_config_error_naming_the_version(old_botocore):
    config = S3Config(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    with pytest.raises(ConfigError, match=r"botocore >= 1\.36"):
        make_s3_client(config)


def test_current_botocore_builds_a_client():
    config = S3Config(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    client = make_s3_client(config)
    assert client.meta.config.request_checksum_calculation == "when_required"


OBJECT = bytes(range(256)) * 4096  # 1 MiB


class _IgnoresRange(http.server.BaseHTTPRequestHandler):
    """Every GET answered 200 with the whole object, whatever its Range header."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(OBJECT)))
        self.send_header("ETag", '"abc"')
        self.end_headers()
        self.wfile.write(OBJECT)

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_ignores_range_still_gives_the_bytes_asked_for():
    """It used to hand back the object from byte 0 for any range."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _IgnoresRange)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        s3 = S3Config(
            endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
            region="us-east-1",
            access_key_id="id",
            secret_access_key=Secret("key"),
        )
        store = S3Store("s3://bucket", StoreConfig(s3=s3))
        assert store.get_range("obj", 1000, 10) == OBJECT[1000:1010]
        assert store.get_range("obj", len(OBJECT) - 5, 100) == OBJECT[-5:]
        assert store.get_bytes("obj") == OBJECT
    finally:
        server.shutdown()
        server.server_close()

"""make_s3_client against a botocore older than dlstore's floor: a ConfigError naming the version.

No server: building a client talks to nobody.
"""

from __future__ import annotations

import botocore.config
import pytest

from dlstore.config import S3Config
from dlstore.errors import ConfigError
from dlstore.storage.s3 import make_s3_client

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

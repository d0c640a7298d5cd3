"""Configuration as frozen dataclasses; the one place the environment is read.

`store` holds what the storage backends need, `data` what a rank's batches hold, and
`values` the sizes and paths that settings take.
"""

from dlstore.config.data import DATA_FLAGS, DEVICE_DECODERS, DataConfig, TransformConfig, repr_hiding_credentials
from dlstore.config.store import RetryConfig, S3Config, Secret, StoreConfig, SwiftConfig
from dlstore.config.values import default_cache_dir, format_size, parse_size, writable_dir, writable_file

__all__ = ["DATA_FLAGS", "DEVICE_DECODERS", "DataConfig", "TransformConfig", "repr_hiding_credentials"]
__all__ += ["RetryConfig", "S3Config", "Secret", "StoreConfig", "SwiftConfig"]
__all__ += ["default_cache_dir", "format_size", "parse_size", "writable_dir", "writable_file"]

"""Decode and augmentation presets: bytes in, uint8 HWC arrays out.

Images stay uint8, a quarter of float32's bytes, until the GPU normalises them. HWC samples
make NHWC batches, which are `channels_last` NCHW memory: a `permute` away.

- `crops`: crop planning, from a per-sample generator, so a resumed run crops the same.
- `cpu_decode`: decode and resize on the CPU, with optional native parts.
- `device_decode`: decode, crop and resize on the GPU, in batches.
"""

from dlstore.config import DEVICE_DECODERS, TransformConfig
from dlstore.transforms.cpu_decode import (
    CropSource,
    augment_image,
    builds_rows_natively,
    can_check_decodes,
    check_decodes,
    check_kept_size,
    crop_params,
    crop_rows,
    decode_for_crop,
    decode_image,
    is_jpeg,
    resize_crop,
    transform_image,
)
from dlstore.transforms.crops import SampleRngs, crop_plan, sample_rng
from dlstore.transforms.device_decode import (
    DeviceJpegDecoder,
    NvImageCodecJpegDecoder,
    TorchvisionJpegDecoder,
    decode_on_device,
    device_jpeg,
    device_jpeg_decoder,
    jpeg_frame,
)

__all__ = [
    "DEVICE_DECODERS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "CropSource",
    "DeviceJpegDecoder",
    "NvImageCodecJpegDecoder",
    "SampleRngs",
    "TorchvisionJpegDecoder",
    "TransformConfig",
    "augment_image",
    "builds_rows_natively",
    "can_check_decodes",
    "check_decodes",
    "check_kept_size",
    "crop_plan",
    "crop_params",
    "crop_rows",
    "decode_for_crop",
    "decode_image",
    "is_jpeg",
    "decode_on_device",
    "device_jpeg",
    "device_jpeg_decoder",
    "jpeg_frame",
    "resize_crop",
    "sample_rng",
    "transform_image",
]

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)

"""The compiled parts: dlstore.transforms.jpeg_region, the crop-only JPEG decode and the batch rows
built from it with the GIL released, and dlstore.format.tar_headers, a sample's tar headers read in
C (see their sources).

Optional: without a C compiler or libjpeg-turbo's headers (Debian/Ubuntu `libjpeg-dev`) the
install goes on without them. dlstore then decodes whole images and reads headers in Python
(`dlstore doctor` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dlstore.transforms.jpeg_region",
            [
                "dlstore/transforms/jpeg_region.c",
                "dlstore/transforms/crop_draw.c",
                "dlstore/transforms/resample.c",
                "dlstore/transforms/row_workers.c",
            ],
            depends=[
                "dlstore/transforms/crop_draw.h",
                "dlstore/transforms/resample.h",
                "dlstore/transforms/row_workers.h",
            ],
            libraries=["jpeg"],
            optional=True,
        ),
        Extension("dlstore.format.tar_headers", ["dlstore/format/tar_headers.c"], optional=True),
    ]
)

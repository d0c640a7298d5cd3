"""The one compiled part: dlstore.transforms.jpeg_region, the crop-only JPEG decode and the batch rows
built from it with the GIL released (see its source).

Optional: without a C compiler or libjpeg-turbo's headers (Debian/Ubuntu `libjpeg-dev`) the
install goes on without it, and dlstore decodes whole images instead (`dlstore doctor` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dlstore.transforms.jpeg_region",
            ["dlstore/transforms/jpeg_region.c", "dlstore/transforms/resample.c"],
            depends=["dlstore/transforms/resample.h"],
            libraries=["jpeg"],
            optional=True,
        ),
    ]
)

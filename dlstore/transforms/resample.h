/* An antialiased bilinear resize of an RGB crop, in C with no Python: see resample.c. */
#ifndef DLSTORE_RESAMPLE_H
#define DLSTORE_RESAMPLE_H

#include <stddef.h>

/* Bytes of scratch `resize_crop` needs for a crop of `rows` source rows to a `size` square. */
size_t resize_scratch_size(int rows, int size);

/* Bytes past a source's last pixel that the resize may read, and weigh 0. */
#define SOURCE_SLACK 32

/* Resize the box (left, top, right, bottom) of `src`, RGB rows of `stride` bytes, to `size` x
 * `size` into `dst` (size * size * 3 bytes), mirrored left to right when `flip`. Taps read only
 * the box's whole pixels, floor(left) .. ceil(right) - 1, which must lie in the source; `src`
 * must have SOURCE_SLACK readable bytes past its last pixel. Returns 0, or -1 when out of memory. */
int resize_crop(const unsigned char *src, size_t stride, double left, double top, double right, double bottom,
                int size, int flip, unsigned char *dst, unsigned char *scratch);

/* Choose the SIMD path by name, "avx2", "sse2" or "c", or the best this CPU has for NULL. All give
 * the same bytes. Returns -1 for a path this build or CPU lacks. Not while a resize runs. */
int resample_choose(const char *name);

/* The name of the path in use. */
const char *resample_path(void);

#endif

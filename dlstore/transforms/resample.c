/* An antialiased bilinear resize of an RGB crop: the resize of torchvision's RandomResizedCrop.
 *
 * Why here: the loader's decode threads build whole chunks of a batch in one C call, with the
 * GIL released once. torch's SIMD kernel cannot be called from C without linking libtorch.
 *
 * The filter is the triangle of Pillow's and torch's antialiased bilinear: a shrink by s
 * widens it to 2s source pixels. It runs in two passes, rows then columns, each through 8-bit
 * pixels, in 14-bit fixed point. SSE2 (every x86-64) multiplies two taps at once; elsewhere
 * plain C runs. Taps stop at the box's edge, as a resize of the cropped image does.
 */
#include "resample.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define PRECISION 14

/* The taps of every output pixel along one axis, in pairs: pixel i reads `pairs` pairs of
 * source pixels from first[i], weights packed as (w1 << 16) | w0 for SSE2's madd. */
typedef struct {
    int *first;
    int32_t *weights; /* size * pairs entries */
    int pairs;
} Taps;

static void free_taps(Taps *taps) {
    free(taps->first);
    free(taps->weights);
}

static double triangle(double x) {
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Output pixel i of `size` covers in0 + i * scale .. in0 + (i + 1) * scale; taps lie in lo .. hi - 1. */
static int make_taps(Taps *taps, double in0, double in1, int lo, int hi, int size) {
    double scale = (in1 - in0) / size;
    double filter_scale = scale > 1.0 ? scale : 1.0;
    double support = filter_scale; /* the triangle's half-width, 1, widened by the shrink */
    int max_taps = (int)ceil(support) * 2 + 2;
    taps->pairs = (max_taps + 1) / 2;
    taps->first = malloc(sizeof(int) * (size_t)size);
    taps->weights = calloc((size_t)size * (size_t)taps->pairs, sizeof(int32_t));
    double *w = malloc(sizeof(double) * (size_t)(taps->pairs * 2));
    if (taps->first == NULL || taps->weights == NULL || w == NULL) {
        free(w);
        free_taps(taps);
        return -1;
    }
    for (int i = 0; i < size; i++) {
        double centre = in0 + (i + 0.5) * scale;
        int x0 = (int)floor(centre - support + 0.5), x1 = (int)floor(centre + support + 0.5);
        if (x0 < lo)
            x0 = lo;
        if (x1 > hi)
            x1 = hi;
        if (x1 - x0 > taps->pairs * 2)
            x1 = x0 + taps->pairs * 2;
        if (x1 <= x0) { /* never for a box inside lo .. hi; kept safe */
            x0 = centre < lo ? lo : (centre >= hi ? hi - 1 : (int)centre);
            x1 = x0 + 1;
        }
        double total = 0.0;
        for (int k = 0; k < x1 - x0; k++)
            total += w[k] = triangle((k + x0 - centre + 0.5) / filter_scale);
        /* The window of 2 * pairs taps starts early where it would pass hi: the extra taps
         * weigh 0, and reads past the box stay inside the source but for the narrowest boxes. */
        int start = x0 + taps->pairs * 2 > hi ? hi - taps->pairs * 2 : x0;
        if (start < lo)
            start = lo;
        taps->first[i] = start;
        int32_t *packed = taps->weights + (size_t)i * taps->pairs;
        for (int k = 0; k < x1 - x0; k++) {
            int slot = k + x0 - start;
            uint16_t fixed = (uint16_t)(int16_t)lround((total > 0 ? w[k] / total : 1.0) * (1 << PRECISION));
            packed[slot / 2] |= (int32_t)((uint32_t)fixed << (16 * (slot % 2)));
        }
    }
    free(w);
    return 0;
}

static inline unsigned char clip8(int32_t v) {
    v >>= PRECISION;
    return (unsigned char)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

/* Each of `rows` rows of `src` (from column 0 of the box's pixels) to `size` pixels in `dst`. */
static void horizontal(const unsigned char *src, size_t stride, int rows, const Taps *taps, int size, int flip,
                       unsigned char *dst, size_t dst_stride) {
    for (int r = 0; r < rows; r++) {
        const unsigned char *in = src + (size_t)r * stride;
        unsigned char *out = dst + (size_t)r * dst_stride;
        for (int pos = 0; pos < size; pos++) {
            int i = flip ? size - 1 - pos : pos;
            const int32_t *weights = taps->weights + (size_t)i * taps->pairs;
            const unsigned char *p = in + (size_t)taps->first[i] * 3;
#if defined(__SSE2__)
            __m128i zero = _mm_setzero_si128();
            __m128i acc = _mm_set1_epi32(1 << (PRECISION - 1));
            for (int k = 0; k < taps->pairs; k++, p += 6) {
                int32_t a, b;
                memcpy(&a, p, 4);
                memcpy(&b, p + 3, 4);
                __m128i both = _mm_unpacklo_epi8(_mm_cvtsi32_si128(a), _mm_cvtsi32_si128(b));
                acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_unpacklo_epi8(both, zero), _mm_set1_epi32(weights[k])));
            }
            acc = _mm_srai_epi32(acc, PRECISION);
            acc = _mm_packus_epi16(_mm_packs_epi32(acc, acc), zero);
            int32_t pixel = _mm_cvtsi128_si32(acc);
            memcpy(out + (size_t)pos * 3, &pixel, 4); /* the 4th byte is the next pixel's, written next */
#else
            int32_t acc[3] = {1 << (PRECISION - 1), 1 << (PRECISION - 1), 1 << (PRECISION - 1)};
            for (int k = 0; k < taps->pairs; k++, p += 6) {
                int32_t w0 = (int16_t)(weights[k] & 0xFFFF), w1 = (int16_t)(weights[k] >> 16);
                for (int c = 0; c < 3; c++)
                    acc[c] += w0 * p[c] + w1 * p[3 + c];
            }
            for (int c = 0; c < 3; c++)
                out[(size_t)pos * 3 + c] = clip8(acc[c]);
#endif
        }
    }
}

/* `size` output rows of `width` bytes, each from the rows of `src` that its taps name. */
static void vertical(const unsigned char *src, size_t stride, const Taps *taps, int size, size_t width,
                     unsigned char *dst) {
    for (int i = 0; i < size; i++) {
        const int32_t *weights = taps->weights + (size_t)i * taps->pairs;
        const unsigned char *first = src + (size_t)taps->first[i] * stride;
        unsigned char *out = dst + (size_t)i * width;
        size_t x = 0;
#if defined(__SSE2__)
        __m128i zero = _mm_setzero_si128();
        for (; x + 16 <= width; x += 16) {
            __m128i acc[4];
            for (int q = 0; q < 4; q++)
                acc[q] = _mm_set1_epi32(1 << (PRECISION - 1));
            const unsigned char *p = first + x;
            for (int k = 0; k < taps->pairs; k++, p += 2 * stride) {
                __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadu_si128((const __m128i *)(p + stride));
                __m128i w = _mm_set1_epi32(weights[k]);
                __m128i lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
                acc[0] = _mm_add_epi32(acc[0], _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), w));
                acc[1] = _mm_add_epi32(acc[1], _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), w));
                acc[2] = _mm_add_epi32(acc[2], _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), w));
                acc[3] = _mm_add_epi32(acc[3], _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), w));
            }
            for (int q = 0; q < 4; q++)
                acc[q] = _mm_srai_epi32(acc[q], PRECISION);
            __m128i packed = _mm_packus_epi16(_mm_packs_epi32(acc[0], acc[1]), _mm_packs_epi32(acc[2], acc[3]));
            _mm_storeu_si128((__m128i *)(out + x), packed);
        }
#endif
        for (; x < width; x++) {
            int32_t acc = 1 << (PRECISION - 1);
            const unsigned char *p = first + x;
            for (int k = 0; k < taps->pairs; k++, p += 2 * stride) {
                int32_t w0 = (int16_t)(weights[k] & 0xFFFF), w1 = (int16_t)(weights[k] >> 16);
                acc += w0 * p[0] + w1 * p[stride];
            }
            out[x] = clip8(acc);
        }
    }
}

/* The horizontal pass's rows and SPARE_ROWS more: a tap of weight 0 may name them. */
#define SPARE_ROWS 4
size_t resize_scratch_size(int rows, int size) { return ((size_t)rows + SPARE_ROWS) * ((size_t)size * 3 + 16); }

int resize_crop(const unsigned char *src, size_t stride, double left, double top, double right, double bottom,
                int size, int flip, unsigned char *dst, unsigned char *scratch) {
    int x_lo = (int)floor(left), x_hi = (int)ceil(right), y_lo = (int)floor(top), y_hi = (int)ceil(bottom);
    Taps columns = {0}, rows = {0};
    if (make_taps(&columns, left - x_lo, right - x_lo, 0, x_hi - x_lo, size) < 0)
        return -1;
    if (make_taps(&rows, top - y_lo, bottom - y_lo, 0, y_hi - y_lo, size) < 0) {
        free_taps(&columns);
        return -1;
    }
    size_t mid_stride = (size_t)size * 3 + 16;
    int mid_rows = y_hi - y_lo;
    horizontal(src + (size_t)y_lo * stride + (size_t)x_lo * 3, stride, mid_rows, &columns, size, flip, scratch,
               mid_stride);
    memset(scratch + (size_t)mid_rows * mid_stride, 0, SPARE_ROWS * mid_stride);
    vertical(scratch, mid_stride, &rows, size, (size_t)size * 3, dst);
    free_taps(&columns);
    free_taps(&rows);
    return 0;
}

/* An antialiased bilinear resize of an RGB crop: the resize of torchvision's RandomResizedCrop.
 *
 * Why here: the loader's decode threads build whole chunks of a batch in one C call, with the
 * GIL released once. torch's SIMD kernel cannot be called from C without linking libtorch.
 *
 * The filter is the triangle of Pillow's and torch's antialiased bilinear: a shrink by s
 * widens it to 2s source pixels. It runs in two passes, rows then columns, each through 8-bit
 * pixels, in 14-bit fixed point. Taps stop at the box's edge, as a resize of the cropped image does.
 *
 * Three paths give the same bytes: AVX2, chosen at run time where the CPU has it (two rows and
 * four taps per step, about 2x SSE2); SSE2, which every x86-64 has; and plain C elsewhere.
 */
#include "resample.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2 1
#include <immintrin.h>
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

/* The source pixels x0 .. x1 - 1 that a tap centred at `centre` weighs above 0, inside lo .. hi. */
static void window(double centre, double support, double filter_scale, int lo, int hi, int *x0, int *x1) {
    int a = (int)floor(centre - support + 0.5), b = (int)floor(centre + support + 0.5);
    a = a < lo ? lo : a;
    b = b > hi ? hi : b;
    while (a < b && triangle((a - centre + 0.5) / filter_scale) == 0.0)
        a++;
    while (b > a && triangle((b - 1 - centre + 0.5) / filter_scale) == 0.0)
        b--;
    if (b <= a) { /* never for a box inside lo .. hi; kept safe */
        a = centre < lo ? lo : (centre >= hi ? hi - 1 : (int)centre);
        b = a + 1;
    }
    *x0 = a, *x1 = b;
}

/* Output pixel i of `size` covers in0 + i * scale .. in0 + (i + 1) * scale; taps lie in lo .. hi - 1.
 * Every pixel gets the pairs of the widest window, rounded up to a multiple of `pairs_step`
 * (AVX2's horizontal pass takes two at once); the extra taps weigh 0. */
static int make_taps(Taps *taps, double in0, double in1, int lo, int hi, int size, int pairs_step) {
    double scale = (in1 - in0) / size;
    double filter_scale = scale > 1.0 ? scale : 1.0;
    double support = filter_scale; /* the triangle's half-width, 1, widened by the shrink */
    int widest = 1, x0, x1;
    for (int i = 0; i < size; i++) {
        window(in0 + (i + 0.5) * scale, support, filter_scale, lo, hi, &x0, &x1);
        widest = x1 - x0 > widest ? x1 - x0 : widest;
    }
    taps->pairs = ((widest + 1) / 2 + pairs_step - 1) / pairs_step * pairs_step;
    if (size <= 0 || taps->pairs <= 0)
        return -1;
    taps->first = malloc(sizeof(int) * (size_t)size);
    taps->weights = calloc((size_t)size * (size_t)taps->pairs, sizeof(int32_t));
    double *w = malloc(sizeof(double) * 2 * (size_t)taps->pairs);
    if (taps->first == NULL || taps->weights == NULL || w == NULL) {
        free(w);
        free_taps(taps);
        return -1;
    }
    for (int i = 0; i < size; i++) {
        double centre = in0 + (i + 0.5) * scale;
        window(centre, support, filter_scale, lo, hi, &x0, &x1);
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

enum { PATH_C, PATH_SSE2, PATH_AVX2 };
static const char *const path_names[] = {"c", "sse2", "avx2"};
static int path = PATH_C; /* set once by resample_choose, at import */

static int has_path(int p) {
#if defined(HAVE_AVX2)
    if (p == PATH_AVX2)
        return __builtin_cpu_supports("avx2");
#endif
#if defined(__SSE2__)
    if (p == PATH_SSE2)
        return 1;
#endif
    return p == PATH_C;
}

int resample_choose(const char *name) {
    for (int p = PATH_AVX2; p >= PATH_C; p--)
        if ((name == NULL || strcmp(name, path_names[p]) == 0) && has_path(p)) {
            path = p;
            return 0;
        }
    return -1;
}

const char *resample_path(void) { return path_names[path]; }

/* Output pixel i of one row, in plain C: taps->pairs pairs of source pixels from p. */
static void pixel_c(const unsigned char *p, const int32_t *weights, int pairs, unsigned char *out) {
    int32_t acc[3] = {1 << (PRECISION - 1), 1 << (PRECISION - 1), 1 << (PRECISION - 1)};
    for (int k = 0; k < pairs; k++, p += 6) {
        int32_t w0 = (int16_t)(weights[k] & 0xFFFF), w1 = (int16_t)(weights[k] >> 16);
        for (int c = 0; c < 3; c++)
            acc[c] += w0 * p[c] + w1 * p[3 + c];
    }
    for (int c = 0; c < 3; c++)
        out[c] = clip8(acc[c]);
}

#if defined(__SSE2__)
/* The same in SSE2: one madd takes two taps of the three channels. Writes a 4th byte, the next
 * pixel's, which the next pixel writes over. */
static void pixel_sse2(const unsigned char *p, const int32_t *weights, int pairs, unsigned char *out) {
    __m128i zero = _mm_setzero_si128();
    __m128i acc = _mm_set1_epi32(1 << (PRECISION - 1));
    for (int k = 0; k < pairs; k++, p += 6) {
        int32_t a, b;
        memcpy(&a, p, 4);
        memcpy(&b, p + 3, 4);
        __m128i both = _mm_unpacklo_epi8(_mm_cvtsi32_si128(a), _mm_cvtsi32_si128(b));
        acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_unpacklo_epi8(both, zero), _mm_set1_epi32(weights[k])));
    }
    acc = _mm_srai_epi32(acc, PRECISION);
    acc = _mm_packus_epi16(_mm_packs_epi32(acc, acc), zero);
    int32_t pixel = _mm_cvtsi128_si32(acc);
    memcpy(out, &pixel, 4);
}
#endif

#if defined(HAVE_AVX2)
/* Two rows at once, one per 128-bit lane, four taps per 16-byte load: a shuffle spreads taps
 * k, k + 1 (or k + 2, k + 3) to 16-bit pairs R R G G B B 0 0 for madd. Taps come in pairs of
 * pairs (make_taps' pairs_step 2); reads reach 4 bytes past the window, into SOURCE_SLACK. */
__attribute__((target("avx2"))) static void horizontal_avx2(const unsigned char *src, size_t stride, int rows,
                                                             const Taps *taps, int size, int flip,
                                                             unsigned char *dst, size_t dst_stride) {
    const __m256i first_two = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1, 0, -1, 3,
                                               -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i next_two = _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1, 6, -1, 9,
                                              -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1);
    const __m256i zero = _mm256_setzero_si256();
    for (int r = 0; r < rows; r += 2) {
        const unsigned char *in0 = src + (size_t)r * stride, *in1 = r + 1 < rows ? in0 + stride : in0;
        unsigned char *out0 = dst + (size_t)r * dst_stride, *out1 = r + 1 < rows ? out0 + dst_stride : out0;
        for (int pos = 0; pos < size; pos++) {
            int i = flip ? size - 1 - pos : pos;
            const int32_t *weights = taps->weights + (size_t)i * taps->pairs;
            size_t at = (size_t)taps->first[i] * 3;
            __m256i acc = _mm256_set1_epi32(1 << (PRECISION - 1));
            for (int k = 0; k < taps->pairs; k += 2, at += 12) {
                __m256i pixels = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(in0 + at))),
                    _mm_loadu_si128((const __m128i *)(in1 + at)), 1);
                acc = _mm256_add_epi32(
                    acc, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, first_two), _mm256_set1_epi32(weights[k])));
                acc = _mm256_add_epi32(
                    acc, _mm256_madd_epi16(_mm256_shuffle_epi8(pixels, next_two), _mm256_set1_epi32(weights[k + 1])));
            }
            acc = _mm256_srai_epi32(acc, PRECISION);
            acc = _mm256_packus_epi16(_mm256_packs_epi32(acc, acc), zero);
            int32_t pixel0 = _mm256_cvtsi256_si32(acc), pixel1 = _mm256_extract_epi32(acc, 4);
            memcpy(out0 + (size_t)pos * 3, &pixel0, 4); /* the 4th byte is the next pixel's, written next */
            memcpy(out1 + (size_t)pos * 3, &pixel1, 4);
        }
    }
}
#endif

/* Each of `rows` rows of `src` (from column 0 of the box's pixels) to `size` pixels in `dst`. */
static void horizontal(const unsigned char *src, size_t stride, int rows, const Taps *taps, int size, int flip,
                       unsigned char *dst, size_t dst_stride) {
#if defined(HAVE_AVX2)
    if (path == PATH_AVX2) {
        horizontal_avx2(src, stride, rows, taps, size, flip, dst, dst_stride);
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        const unsigned char *in = src + (size_t)r * stride;
        unsigned char *out = dst + (size_t)r * dst_stride;
        for (int pos = 0; pos < size; pos++) {
            int i = flip ? size - 1 - pos : pos;
            const unsigned char *p = in + (size_t)taps->first[i] * 3;
            const int32_t *weights = taps->weights + (size_t)i * taps->pairs;
#if defined(__SSE2__)
            if (path == PATH_SSE2) {
                pixel_sse2(p, weights, taps->pairs, out + (size_t)pos * 3);
                continue;
            }
#endif
            pixel_c(p, weights, taps->pairs, out + (size_t)pos * 3);
        }
    }
}

/* Bytes x .. width - 1 of output row `out`, in plain C, from the rows of `first` on. */
static void column_tail(const unsigned char *first, size_t stride, const int32_t *weights, int pairs, size_t x,
                        size_t width, unsigned char *out) {
    for (; x < width; x++) {
        int32_t acc = 1 << (PRECISION - 1);
        const unsigned char *p = first + x;
        for (int k = 0; k < pairs; k++, p += 2 * stride) {
            int32_t w0 = (int16_t)(weights[k] & 0xFFFF), w1 = (int16_t)(weights[k] >> 16);
            acc += w0 * p[0] + w1 * p[stride];
        }
        out[x] = clip8(acc);
    }
}

/* Bytes 0 .. returned - 1 of an output row, 16 at a time: two taps per madd, four madds a step. */
#if defined(__SSE2__)
static size_t columns_sse2(const unsigned char *first, size_t stride, const int32_t *weights, int pairs,
                           size_t width, unsigned char *out) {
    __m128i zero = _mm_setzero_si128();
    size_t x = 0;
    for (; x + 16 <= width; x += 16) {
        __m128i acc[4];
        for (int q = 0; q < 4; q++)
            acc[q] = _mm_set1_epi32(1 << (PRECISION - 1));
        const unsigned char *p = first + x;
        for (int k = 0; k < pairs; k++, p += 2 * stride) {
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
    return x;
}
#endif

#if defined(HAVE_AVX2)
/* The same, 32 bytes at a time: every step works within a 128-bit lane, so the bytes keep their order. */
__attribute__((target("avx2"))) static size_t columns_avx2(const unsigned char *first, size_t stride,
                                                           const int32_t *weights, int pairs, size_t width,
                                                           unsigned char *out) {
    __m256i zero = _mm256_setzero_si256();
    size_t x = 0;
    for (; x + 32 <= width; x += 32) {
        __m256i acc[4];
        for (int q = 0; q < 4; q++)
            acc[q] = _mm256_set1_epi32(1 << (PRECISION - 1));
        const unsigned char *p = first + x;
        for (int k = 0; k < pairs; k++, p += 2 * stride) {
            __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + stride));
            __m256i w = _mm256_set1_epi32(weights[k]);
            __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
            acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), w));
            acc[1] = _mm256_add_epi32(acc[1], _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), w));
            acc[2] = _mm256_add_epi32(acc[2], _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), w));
            acc[3] = _mm256_add_epi32(acc[3], _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), w));
        }
        for (int q = 0; q < 4; q++)
            acc[q] = _mm256_srai_epi32(acc[q], PRECISION);
        __m256i packed =
            _mm256_packus_epi16(_mm256_packs_epi32(acc[0], acc[1]), _mm256_packs_epi32(acc[2], acc[3]));
        _mm256_storeu_si256((__m256i *)(out + x), packed);
    }
    return x;
}
#endif

/* `size` output rows of `width` bytes, each from the rows of `src` that its taps name. */
static void vertical(const unsigned char *src, size_t stride, const Taps *taps, int size, size_t width,
                     unsigned char *dst) {
    for (int i = 0; i < size; i++) {
        const int32_t *weights = taps->weights + (size_t)i * taps->pairs;
        const unsigned char *first = src + (size_t)taps->first[i] * stride;
        unsigned char *out = dst + (size_t)i * width;
        size_t x = 0;
#if defined(HAVE_AVX2)
        if (path == PATH_AVX2)
            x = columns_avx2(first, stride, weights, taps->pairs, width, out);
#endif
#if defined(__SSE2__)
        if (path >= PATH_SSE2)
            x += columns_sse2(first + x, stride, weights, taps->pairs, width - x, out + x);
#endif
        column_tail(first, stride, weights, taps->pairs, x, width, out);
    }
}

/* The horizontal pass's rows and SPARE_ROWS more: a tap of weight 0 may name them. */
#define SPARE_ROWS 4
size_t resize_scratch_size(int rows, int size) { return ((size_t)rows + SPARE_ROWS) * ((size_t)size * 3 + 16); }

int resize_crop(const unsigned char *src, size_t stride, double left, double top, double right, double bottom,
                int size, int flip, unsigned char *dst, unsigned char *scratch) {
    int x_lo = (int)floor(left), x_hi = (int)ceil(right), y_lo = (int)floor(top), y_hi = (int)ceil(bottom);
    Taps columns = {0}, rows = {0};
    if (make_taps(&columns, left - x_lo, right - x_lo, 0, x_hi - x_lo, size, path == PATH_AVX2 ? 2 : 1) < 0)
        return -1;
    if (make_taps(&rows, top - y_lo, bottom - y_lo, 0, y_hi - y_lo, size, 1) < 0) {
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

/* The random crops of the presets, drawn in C: the same numbers as crops.py's `crop_plan` with
 * `sample_rng`, so a C thread draws a sample's crop without the GIL.
 *
 * `sample_rng` is numpy's Generator over Philox-4x64-10, keyed (seed, (epoch << 40) ^ sample_id),
 * counter 0. Below are the parts of it `crop_plan` uses: Philox's 64-bit and 32-bit outputs,
 * `random` and `uniform` (53-bit doubles), and `integers` below 2 ** 32 (Lemire's bounded draw).
 * tests/transforms/test_crop_rows.py checks them against numpy over many keys and sizes.
 */
#include "crop_draw.h"

#include <math.h>

#define PHILOX_M0 0xD2E7470EE14C6C93ULL
#define PHILOX_M1 0xCA5A826395121157ULL
#define PHILOX_W0 0x9E3779B97F4A7C15ULL
#define PHILOX_W1 0xBB67AE8584CAA73BULL

typedef struct {
    uint64_t counter[4], key[2], buffer[4];
    int used; /* of buffer's 4 words */
    int has_half;
    uint32_t half; /* the upper half of the word a 32-bit draw split */
} Philox;

static void philox_block(const uint64_t counter[4], const uint64_t key_in[2], uint64_t out[4]) {
    uint64_t c[4] = {counter[0], counter[1], counter[2], counter[3]}, key[2] = {key_in[0], key_in[1]};
    for (int round = 0; round < 10; round++) {
        if (round > 0)
            key[0] += PHILOX_W0, key[1] += PHILOX_W1;
        unsigned __int128 p0 = (unsigned __int128)PHILOX_M0 * c[0], p1 = (unsigned __int128)PHILOX_M1 * c[2];
        uint64_t hi0 = (uint64_t)(p0 >> 64), lo0 = (uint64_t)p0, hi1 = (uint64_t)(p1 >> 64), lo1 = (uint64_t)p1;
        uint64_t next[4] = {hi1 ^ c[1] ^ key[0], lo1, hi0 ^ c[3] ^ key[1], lo0};
        for (int k = 0; k < 4; k++)
            c[k] = next[k];
    }
    for (int k = 0; k < 4; k++)
        out[k] = c[k];
}

static uint64_t next64(Philox *g) {
    if (g->used < 4)
        return g->buffer[g->used++];
    for (int k = 0; k < 4 && ++g->counter[k] == 0; k++) /* the counter steps first, with carry */
        ;
    philox_block(g->counter, g->key, g->buffer);
    g->used = 1;
    return g->buffer[0];
}

static uint32_t next32(Philox *g) {
    if (g->has_half) {
        g->has_half = 0;
        return g->half;
    }
    uint64_t word = next64(g);
    g->has_half = 1, g->half = (uint32_t)(word >> 32);
    return (uint32_t)word;
}

static double next_double(Philox *g) { return (double)(next64(g) >> 11) * (1.0 / 9007199254740992.0); }

static double uniform(Philox *g, double low, double high) { return low + (high - low) * next_double(g); }

/* An int in 0 .. n - 1, for 1 <= n <= 2 ** 32: numpy's `integers(0, n)`. n == 1 draws nothing. */
static int64_t below(Philox *g, uint64_t n) {
    if (n <= 1)
        return 0;
    uint64_t m = (uint64_t)next32(g) * n;
    uint32_t leftover = (uint32_t)m;
    if (leftover < n) {
        uint32_t threshold = (uint32_t)((UINT32_MAX - (n - 1)) % n);
        while (leftover < threshold) {
            m = (uint64_t)next32(g) * n;
            leftover = (uint32_t)m;
        }
    }
    return (int64_t)(m >> 32);
}

/* torchvision's RandomResizedCrop box (crops.py's `_random_resized_box`). */
static void random_resized_box(const CropParams *p, int width, int height, Philox *g, double box[4]) {
    double area = (double)width * (double)height, log_ratio[2] = {log(p->ratio[0]), log(p->ratio[1])};
    for (int attempt = 0; attempt < 10; attempt++) {
        double target_area = area * uniform(g, p->scale[0], p->scale[1]);
        double aspect = exp(uniform(g, log_ratio[0], log_ratio[1]));
        double w = nearbyint(sqrt(target_area * aspect)), h = nearbyint(sqrt(target_area / aspect)); /* half to even */
        if (w > 0 && w <= width && h > 0 && h <= height) {
            double left = (double)below(g, (uint64_t)(width - w + 1)), top = (double)below(g, (uint64_t)(height - h + 1));
            box[0] = left, box[1] = top, box[2] = left + w, box[3] = top + h;
            return;
        }
    }
    double in_ratio = (double)width / height, w = width, h = height;
    if (in_ratio < p->ratio[0])
        h = nearbyint(width / p->ratio[0]);
    else if (in_ratio > p->ratio[1])
        w = nearbyint(height * p->ratio[1]);
    double left = floor((width - w) / 2), top = floor((height - h) / 2);
    box[0] = left, box[1] = top, box[2] = left + w, box[3] = top + h;
}

void draw_crop(const CropParams *p, int width, int height, uint64_t seed, uint64_t epoch, uint64_t sample_id,
               double box[4], int *flip) {
    *flip = 0;
    if (!p->train) { /* eval: the centre crop of crops.py's `_centre_box` */
        double crop = (width < height ? width : height) * p->crop_ratio;
        box[0] = (width - crop) / 2, box[1] = (height - crop) / 2, box[2] = box[0] + crop, box[3] = box[1] + crop;
        return;
    }
    Philox g = {{0, 0, 0, 0}, {seed, (epoch << 40) ^ sample_id}, {0, 0, 0, 0}, 4, 0, 0};
    random_resized_box(p, width, height, &g, box);
    *flip = p->hflip && next_double(&g) < 0.5;
}

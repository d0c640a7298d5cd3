/* The random crops of the presets, drawn in C exactly as dlstore.transforms.crops draws them: see crop_draw.c. */
#ifndef DLSTORE_CROP_DRAW_H
#define DLSTORE_CROP_DRAW_H

#include <stdint.h>

/* A TransformConfig's crop, as `cpu_decode.crop_params` gives it. */
typedef struct {
    int size, train, hflip;
    double scale[2], ratio[2], crop_ratio;
} CropParams;

/* The box (left, top, right, bottom) and flip that `crop_plan` gives a width x height image
 * with `sample_rng(seed, epoch, sample_id)`: the same numbers, bit for bit. The ints are taken
 * modulo 2 ** 64, as `sample_rng`'s key is. */
void draw_crop(const CropParams *params, int width, int height, uint64_t seed, uint64_t epoch, uint64_t sample_id,
               double box[4], int *flip);

#endif

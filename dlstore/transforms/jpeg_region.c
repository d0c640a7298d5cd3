/* dlstore.transforms.jpeg_region: decode only the rows and columns of a JPEG that a crop needs
 * (libjpeg-turbo's jpeg_skip_scanlines and jpeg_crop_scanline, as djpeg -crop and DALI's ROI decode do).
 *
 * Why: a RandomResizedCrop box covers about half of the image on average, yet a full decode runs the
 * inverse DCT, upsampling and colour conversion over every pixel. No maintained Python binding offers
 * this decode, so it is this small module against the system's libjpeg-turbo. dlstore.transforms
 * falls back to a whole-image decode when the module is not built or a JPEG is one it does not take.
 *
 *   decode_region(data, left, top, width, height, denom, check_all=True) -> (bytearray, x0, out_width)
 *
 * Rows top .. top+height-1 and columns from x0 (<= left, an iMCU boundary) for out_width
 * (>= left - x0 + width) pixels of the image scaled by 1/denom, as RGB, row after row. The pixels are
 * those of a whole-image decode at that scale, except in the outermost column on either side, whose
 * upsampling sees the edge of the decoded columns: ask for one column more on each side than you keep.
 *
 * The rows above the region are entropy-decoded only. With check_all so are those below it, so the
 * whole stream is checked: it raises ValueError for what libjpeg rejects anywhere in the JPEG (corrupt
 * data, warnings included, as simplejpeg's strict default does; a CMYK image), and for a region outside
 * the image. Without check_all the rows below are never read: for a JPEG known to decode. The GIL is
 * released while libjpeg works.
 *
 *   crop_rows(jobs, out, crop) -> [None or an error string, one per job]
 *
 * `crop` is a TransformConfig's crop (cpu_decode.crop_params: size, train, scale, ratio, hflip,
 * crop_ratio). A job is (data, seed, epoch, sample_id, check_all, row), whose box and flip are drawn
 * from the header's size as crops.py's `crop_plan` draws them (crop_draw.c), or (data, left, top,
 * right, bottom, flip, check_all, row). Each is decoded as above at cpu_decode's `_decode_scale`,
 * resized to size x size with an antialiased triangle filter (resample.c), flipped when asked, and
 * written into row `row` of `out`, a C-contiguous uint8 buffer of rows of size x size x 3. The GIL is
 * released once for the whole list: beside a training loop's Python, each release costs a decode
 * thread a wait of up to the switch interval. A job that fails leaves its row to the caller.
 *
 *   row_queue, start_rows, serve_rows, next_done, stop_rows
 *
 * The same lists, built by threads that never take the GIL back (row_workers.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <setjmp.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#include "crop_draw.h"
#include "resample.h"
#include "row_workers.h"

#ifndef LIBJPEG_TURBO_VERSION
#error "needs libjpeg-turbo's jpeglib.h (jpeg_skip_scanlines and jpeg_crop_scanline)"
#endif

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void raise_error(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) /* a warning: corrupt data libjpeg could go past */
        raise_error(cinfo);
}

static void fail(ErrorManager *err, const char *message) {
    snprintf(err->message, sizeof err->message, "%s", message);
    longjmp(err->jump, 1);
}

/* Whether to crop the columns: not a region so narrow that its chroma is under two samples wide
 * (libjpeg then upsamples it the simple way, not the smooth one), and, before libjpeg-turbo 3.0,
 * not a scaled decode of a JPEG with a 4x sampling factor (2.1's jpeg_crop_scanline sizes the
 * chroma rows without the scaling then: libjpeg-turbo #669). */
static int crop_columns(const struct jpeg_decompress_struct *cinfo, JDIMENSION x0, JDIMENSION width) {
    if (x0 == 0 && width >= cinfo->output_width)
        return 0;
    if (width < 32)
        return 0;
#if LIBJPEG_TURBO_VERSION_NUMBER < 3000000
    if (cinfo->scale_denom != 1 && (cinfo->max_h_samp_factor > 2 || cinfo->max_v_samp_factor > 2))
        return 0;
#endif
    return 1;
}

/* One region decode, with no Python: what to decode, and what came out. */
typedef struct {
    const unsigned char *data;
    size_t length;
    int denom, check_all;
    int has_box;        /* the region is `box`, in the whole image's pixels, and a pixel more around */
    double box[4];      /* left, top, right, bottom */
    const CropParams *crop; /* with has_box: the output size, and how to draw `box` */
    int drawn, flip;    /* drawn: `box` and `flip` are drawn from `key` once the header is read */
    uint64_t key[3];    /* seed, epoch, sample_id */
    int region[4];      /* else this: left, top, width, height, at the scale */
    size_t slack;       /* bytes malloc'd past the pixels */
    unsigned char *pixels; /* malloc'd: rows of out_width RGB pixels from column x0, row y0 */
    int x0, y0, out_width, rows;
    char message[JMSG_LENGTH_MAX];
} Decode;

/* cpu_decode's `_decode_scale`: the smallest of 1/8, 1/4 and 1/2 at which the box still covers
 * the output size, else 1. */
static int decode_denom(const double box[4], int size) {
    double short_side = fmin(box[2] - box[0], box[3] - box[1]);
    for (int denom = 8; denom > 1; denom /= 2)
        if (short_side * (1.0 / denom) >= size)
            return denom;
    return 1;
}

/* Decode `job`'s region: 0, or -1 with `job->message` set (pixels then NULL). Takes no GIL. */
static int decode_rows(Decode *job) {
    /* cinfo and err are written after setjmp; their addresses escape to libjpeg, as in
     * libjpeg's own example.c. Locals changed after setjmp and read after a longjmp: volatile. */
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    unsigned char *volatile pixels = NULL;

    memset(&cinfo, 0, sizeof cinfo); /* jpeg_destroy_decompress does nothing before create */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = raise_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    job->pixels = NULL;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        free(pixels);
        snprintf(job->message, sizeof job->message, "%s", err.message);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->length);
    jpeg_read_header(&cinfo, TRUE);
    if (job->has_box) {
        if (job->drawn)
            draw_crop(job->crop, (int)cinfo.image_width, (int)cinfo.image_height, job->key[0], job->key[1],
                      job->key[2], job->box, &job->flip);
        job->denom = decode_denom(job->box, job->crop->size);
    }
    if (job->denom != 1 && job->denom != 2 && job->denom != 4 && job->denom != 8)
        fail(&err, "denom must be 1, 2, 4 or 8");
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->denom;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3)
        fail(&err, "not an RGB decode");
    int left = job->region[0], top = job->region[1], width = job->region[2], height = job->region[3];
    if (job->has_box) {
        double scale = 1.0 / job->denom, *box = job->box;
        for (int k = 0; k < 4; k++)
            box[k] *= scale;
        if (!(box[0] >= 0 && box[1] >= 0 && box[2] <= cinfo.output_width && box[3] <= cinfo.output_height &&
              box[2] - box[0] > 0 && box[3] - box[1] > 0))
            fail(&err, "box outside the image");
        int right = (int)ceil(box[2]) + 1, bottom = (int)ceil(box[3]) + 1;
        left = (int)floor(box[0]) - 1, top = (int)floor(box[1]) - 1;
        left = left < 0 ? 0 : left, top = top < 0 ? 0 : top;
        right = right > (int)cinfo.output_width ? (int)cinfo.output_width : right;
        bottom = bottom > (int)cinfo.output_height ? (int)cinfo.output_height : bottom;
        width = right - left, height = bottom - top;
    }
    if (left < 0 || top < 0 || width <= 0 || height <= 0 || (JDIMENSION)left + (JDIMENSION)width > cinfo.output_width ||
        (JDIMENSION)top + (JDIMENSION)height > cinfo.output_height)
        fail(&err, "region outside the image");
    JDIMENSION x0 = (JDIMENSION)left, out_width = (JDIMENSION)width;
    if (crop_columns(&cinfo, x0, out_width))
        jpeg_crop_scanline(&cinfo, &x0, &out_width); /* widened to iMCU boundaries */
    else
        x0 = 0, out_width = cinfo.output_width;
    /* With check_all, one row more than the region: the image's last row is read into it. */
    size_t row_bytes = (size_t)out_width * 3;
    pixels = malloc(row_bytes * (size_t)(height + 1) + job->slack);
    if (pixels == NULL)
        fail(&err, "out of memory");
    if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top)
        fail(&err, "the image ended before the region");
    while (cinfo.output_scanline < (JDIMENSION)top + (JDIMENSION)height) {
        JSAMPROW row = pixels + (size_t)(cinfo.output_scanline - (JDIMENSION)top) * row_bytes;
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1)
            fail(&err, "the image ended inside the region");
    }
    if (job->check_all) {
        /* The rows below are skipped too (entropy-decoded, not transformed) but for the last,
         * which is read: a skip to the very end would only mark the end reached, unread. So bad
         * data anywhere in the JPEG fails it, as a whole-image decode would. */
        JDIMENSION rest = cinfo.output_height - cinfo.output_scanline;
        if (rest > 1 && jpeg_skip_scanlines(&cinfo, rest - 1) != rest - 1)
            fail(&err, "the image ended early");
        if (rest > 0) {
            JSAMPROW row = pixels + (size_t)height * row_bytes;
            if (jpeg_read_scanlines(&cinfo, &row, 1) != 1)
                fail(&err, "the image ended early");
        }
        jpeg_finish_decompress(&cinfo);
    } else {
        jpeg_abort_decompress(&cinfo); /* the rows below the region are never read */
    }
    jpeg_destroy_decompress(&cinfo);
    job->pixels = pixels;
    job->x0 = (int)x0, job->y0 = top, job->out_width = (int)out_width, job->rows = height;
    return 0;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer source;
    Decode job = {0};
    job.check_all = 1;
    if (!PyArg_ParseTuple(args, "y*iiiii|p", &source, &job.region[0], &job.region[1], &job.region[2],
                          &job.region[3], &job.denom, &job.check_all))
        return NULL;
    job.data = (const unsigned char *)source.buf, job.length = (size_t)source.len;
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = decode_rows(&job);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&source);
    if (failed) {
        PyErr_SetString(PyExc_ValueError, job.message);
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize((const char *)job.pixels, (Py_ssize_t)job.out_width * 3 * job.rows);
    free(job.pixels);
    return out == NULL ? NULL : Py_BuildValue("(Nii)", out, job.x0, job.out_width);
}

/* One row of crop_rows: a region decode, then its resize into the batch. */
typedef struct {
    Decode decode;
    Py_buffer source;
    int row, failed;
} Crop;

struct Crops {
    Crop *crops;
    Py_ssize_t n, parsed;
    Py_buffer out;
    CropParams params;
    int size, has_out;
};

/* A TransformConfig's crop from cpu_decode.crop_params' tuple: 0, or -1 with an exception set. */
static int parse_crop(PyObject *crop, CropParams *p) {
    if (!PyArg_ParseTuple(crop, "ippddddd;crop is (size, train, hflip, scale_lo, scale_hi, ratio_lo, ratio_hi, "
                          "crop_ratio)", &p->size, &p->train, &p->hflip, &p->scale[0], &p->scale[1], &p->ratio[0],
                          &p->ratio[1], &p->crop_ratio))
        return -1;
    if (p->size <= 0 || !(p->ratio[0] > 0 && p->ratio[1] > 0)) {
        PyErr_SetString(PyExc_ValueError, "the crop's size and ratios must be positive");
        return -1;
    }
    return 0;
}

/* One job of crop_rows' list into `crop`: 0, or -1 with an exception set and no buffer held. */
static int parse_job(PyObject *job, Crop *crop) {
    Decode *d = &crop->decode;
    if (!PyTuple_Check(job) || (PyTuple_GET_SIZE(job) != 6 && PyTuple_GET_SIZE(job) != 8)) {
        PyErr_SetString(PyExc_TypeError, "a job is (data, seed, epoch, sample_id, check_all, row) or (data, left, "
                                         "top, right, bottom, flip, check_all, row)");
        return -1;
    }
    d->drawn = PyTuple_GET_SIZE(job) == 6;
    if (d->drawn) /* K: modulo 2 ** 64, as sample_rng's key */
        return PyArg_ParseTuple(job, "y*KKKpi", &crop->source, &d->key[0], &d->key[1], &d->key[2], &d->check_all,
                                &crop->row) ? 0 : -1;
    return PyArg_ParseTuple(job, "y*ddddppi", &crop->source, &d->box[0], &d->box[1], &d->box[2], &d->box[3],
                            &d->flip, &d->check_all, &crop->row) ? 0 : -1;
}

void crops_free(Crops *c) {
    if (c == NULL)
        return;
    for (Py_ssize_t i = 0; i < c->parsed; i++)
        PyBuffer_Release(&c->crops[i].source);
    if (c->has_out)
        PyBuffer_Release(&c->out);
    free(c->crops);
    free(c);
}

Crops *crops_parse(PyObject *jobs, PyObject *out, PyObject *crop_params) {
    Crops *c = calloc(1, sizeof(Crops));
    if (c == NULL)
        return (Crops *)PyErr_NoMemory();
    if (!PyList_Check(jobs)) {
        PyErr_SetString(PyExc_TypeError, "jobs must be a list");
        goto fail;
    }
    if (parse_crop(crop_params, &c->params) < 0 ||
        PyObject_GetBuffer(out, &c->out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    c->has_out = 1, c->size = c->params.size, c->n = PyList_GET_SIZE(jobs);
    c->crops = calloc((size_t)(c->n > 0 ? c->n : 1), sizeof(Crop));
    if (c->crops == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    size_t image_bytes = (size_t)c->size * c->size * 3;
    for (; c->parsed < c->n; c->parsed++) {
        Crop *crop = &c->crops[c->parsed];
        Decode *d = &crop->decode;
        if (parse_job(PyList_GET_ITEM(jobs, c->parsed), crop) < 0)
            goto fail;
        if (crop->row < 0 || (size_t)(crop->row + 1) * image_bytes > (size_t)c->out.len) {
            PyBuffer_Release(&crop->source);
            PyErr_Format(PyExc_ValueError, "row %d lies outside out", crop->row);
            goto fail;
        }
        d->data = (const unsigned char *)crop->source.buf, d->length = (size_t)crop->source.len;
        d->has_box = 1, d->slack = SOURCE_SLACK, d->crop = &c->params;
    }
    return c;
fail:
    crops_free(c);
    return NULL;
}

void crops_run(Crops *c) {
    size_t image_bytes = (size_t)c->size * c->size * 3;
    unsigned char *scratch = NULL;
    size_t scratch_size = 0;
    for (Py_ssize_t i = 0; i < c->n; i++) {
        Crop *crop = &c->crops[i];
        Decode *d = &crop->decode;
        if (decode_rows(d) < 0) {
            crop->failed = 1;
            continue;
        }
        size_t need = resize_scratch_size(d->rows, c->size);
        if (need > scratch_size) {
            free(scratch);
            scratch = malloc(need), scratch_size = scratch == NULL ? 0 : need;
        }
        double *box = d->box;
        if (scratch == NULL ||
            resize_crop(d->pixels, (size_t)d->out_width * 3, box[0] - d->x0, box[1] - d->y0, box[2] - d->x0,
                        box[3] - d->y0, c->size, d->flip,
                        (unsigned char *)c->out.buf + (size_t)crop->row * image_bytes, scratch) < 0) {
            snprintf(d->message, sizeof d->message, "out of memory");
            crop->failed = 1;
        }
        free(d->pixels);
        d->pixels = NULL;
    }
    free(scratch);
}

PyObject *crops_results(Crops *c) {
    PyObject *results = PyList_New(c->n);
    for (Py_ssize_t i = 0; results != NULL && i < c->n; i++) {
        PyObject *r = c->crops[i].failed ? PyUnicode_FromString(c->crops[i].decode.message) : Py_NewRef(Py_None);
        if (r == NULL)
            Py_CLEAR(results);
        else
            PyList_SET_ITEM(results, i, r);
    }
    return results;
}

static PyObject *crop_rows(PyObject *self, PyObject *args) {
    PyObject *jobs, *out, *crop;
    if (!PyArg_ParseTuple(args, "O!OO", &PyList_Type, &jobs, &out, &crop))
        return NULL;
    Crops *c = crops_parse(jobs, out, crop);
    if (c == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    crops_run(c);
    Py_END_ALLOW_THREADS
    PyObject *results = crops_results(c);
    crops_free(c);
    return results;
}

static PyObject *draw_crop_py(PyObject *self, PyObject *args) {
    PyObject *crop;
    int width, height, flip;
    unsigned long long seed, epoch, sample_id;
    CropParams params;
    double box[4];
    if (!PyArg_ParseTuple(args, "OiiKKK", &crop, &width, &height, &seed, &epoch, &sample_id) ||
        parse_crop(crop, &params) < 0)
        return NULL;
    if (width <= 0 || height <= 0)
        return PyErr_Format(PyExc_ValueError, "an image of %d x %d pixels", width, height);
    draw_crop(&params, width, height, seed, epoch, sample_id, box, &flip);
    return Py_BuildValue("((dddd)O)", box[0], box[1], box[2], box[3], flip ? Py_True : Py_False);
}

static PyObject *resize(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    int height, width, size, flip;
    double box[4];
    if (!PyArg_ParseTuple(args, "y*iiddddipw*", &src, &height, &width, &box[0], &box[1], &box[2], &box[3], &size,
                          &flip, &out))
        return NULL;
    PyObject *result = NULL;
    size_t stride = (size_t)(width > 0 ? width : 0) * 3;
    unsigned char *scratch = NULL;
    if (height <= 0 || width <= 0 || size <= 0 || (size_t)src.len < (size_t)height * stride + SOURCE_SLACK ||
        (size_t)out.len < (size_t)size * size * 3)
        PyErr_SetString(PyExc_ValueError, "src must hold height x width x 3 bytes and SOURCE_SLACK more, "
                                          "out size x size x 3");
    else if (!(box[0] >= 0 && box[1] >= 0 && box[0] < box[2] && box[1] < box[3] && box[2] <= width &&
               box[3] <= height))
        PyErr_SetString(PyExc_ValueError, "the box must lie in the image");
    else if ((scratch = malloc(resize_scratch_size(height, size))) == NULL)
        PyErr_NoMemory();
    else {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = resize_crop(src.buf, stride, box[0], box[1], box[2], box[3], size, flip, out.buf, scratch);
        Py_END_ALLOW_THREADS
        result = failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
    }
    free(scratch);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *resize_path(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
    if (name != NULL && resample_choose(name) < 0)
        return PyErr_Format(PyExc_ValueError, "no resize path %s in this build or CPU", name);
    return PyUnicode_FromString(resample_path());
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, left, top, width, height, denom, check_all=True) -> (bytearray, x0, out_width): the rows and "
     "columns of a JPEG that a region needs, scaled by 1/denom, RGB (see the module's source)."},
    {"crop_rows", crop_rows, METH_VARARGS,
     "crop_rows(jobs, out, crop) -> [None or error]: each job's crop, drawn or given, decoded crop-only, resized and "
     "written into its row of `out`, with the GIL released once for all (see the module's source)."},
    {"draw_crop", draw_crop_py, METH_VARARGS,
     "draw_crop(crop, width, height, seed, epoch, sample_id) -> (box, flip): the crop crop_rows draws for a job."},
    {"resize", resize, METH_VARARGS,
     "resize(src, height, width, left, top, right, bottom, size, flip, out): the box of an RGB image resized to size x "
     "size into out, as crop_rows does; src holds SOURCE_SLACK readable bytes past its pixels."},
    {"resize_path", resize_path, METH_VARARGS,
     "resize_path(name=None) -> str: the resize's SIMD path, 'avx2', 'sse2' or 'c' (the same bytes); a name chooses "
     "it, for tests and benchmarks, while no resize runs."},
    ROW_WORKER_METHODS
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "jpeg_region", NULL, -1, methods};

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)

PyMODINIT_FUNC PyInit_jpeg_region(void) {
    resample_choose(NULL);
    PyObject *m = PyModule_Create(&module);
    /* The libjpeg-turbo it was built against (`dlstore doctor` shows it). */
    if (m != NULL && (PyModule_AddStringConstant(m, "libjpeg_turbo_version", STRINGIFY(LIBJPEG_TURBO_VERSION)) < 0 ||
                      PyModule_AddIntConstant(m, "SOURCE_SLACK", SOURCE_SLACK) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

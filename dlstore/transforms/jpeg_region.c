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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

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

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer source;
    int left, top, width, height, denom, check_all = 1;
    if (!PyArg_ParseTuple(args, "y*iiiii|p", &source, &left, &top, &width, &height, &denom, &check_all))
        return NULL;
    /* cinfo and err are written after setjmp; their addresses escape to libjpeg, as in
     * libjpeg's own example.c. Locals changed after setjmp and read after a longjmp: volatile. */
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    PyObject *volatile out = NULL;
    PyThreadState *volatile released = NULL;
    JDIMENSION x0 = 0, out_width = 0;

    memset(&cinfo, 0, sizeof cinfo); /* jpeg_destroy_decompress does nothing before create */
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = raise_error;
    err.pub.emit_message = on_message;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        if (released != NULL)
            PyEval_RestoreThread(released);
        Py_XDECREF(out);
        PyBuffer_Release(&source);
        PyErr_SetString(PyExc_ValueError, err.message);
        return NULL;
    }
    released = PyEval_SaveThread();
    jpeg_create_decompress(&cinfo);
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8)
        fail(&err, "denom must be 1, 2, 4 or 8");
    jpeg_mem_src(&cinfo, (const unsigned char *)source.buf, (unsigned long)source.len);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3)
        fail(&err, "not an RGB decode");
    if (left < 0 || top < 0 || width <= 0 || height <= 0 || (JDIMENSION)left + (JDIMENSION)width > cinfo.output_width ||
        (JDIMENSION)top + (JDIMENSION)height > cinfo.output_height)
        fail(&err, "region outside the image");
    x0 = (JDIMENSION)left;
    out_width = (JDIMENSION)width;
    if (crop_columns(&cinfo, x0, out_width))
        jpeg_crop_scanline(&cinfo, &x0, &out_width); /* widened to iMCU boundaries */
    else
        x0 = 0, out_width = cinfo.output_width;

    PyEval_RestoreThread(released);
    released = NULL;
    /* With check_all, one row more than the region: the image's last row is read into it. */
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)out_width * 3 * (height + (check_all ? 1 : 0)));
    if (out == NULL) { /* MemoryError set */
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&source);
        return NULL;
    }
    unsigned char *pixels = (unsigned char *)PyByteArray_AS_STRING(out);
    released = PyEval_SaveThread();
    if (top > 0 && jpeg_skip_scanlines(&cinfo, (JDIMENSION)top) != (JDIMENSION)top)
        fail(&err, "the image ended before the region");
    while (cinfo.output_scanline < (JDIMENSION)top + (JDIMENSION)height) {
        JSAMPROW row = pixels + (size_t)(cinfo.output_scanline - (JDIMENSION)top) * out_width * 3;
        if (jpeg_read_scanlines(&cinfo, &row, 1) != 1)
            fail(&err, "the image ended inside the region");
    }
    if (check_all) {
        /* The rows below are skipped too (entropy-decoded, not transformed) but for the last,
         * which is read: a skip to the very end would only mark the end reached, unread. So bad
         * data anywhere in the JPEG fails it, as a whole-image decode would. */
        JDIMENSION rest = cinfo.output_height - cinfo.output_scanline;
        if (rest > 1 && jpeg_skip_scanlines(&cinfo, rest - 1) != rest - 1)
            fail(&err, "the image ended early");
        if (rest > 0) {
            JSAMPROW row = pixels + (size_t)height * out_width * 3;
            if (jpeg_read_scanlines(&cinfo, &row, 1) != 1)
                fail(&err, "the image ended early");
        }
        jpeg_finish_decompress(&cinfo);
    } else {
        jpeg_abort_decompress(&cinfo); /* the rows below the region are never read */
    }
    jpeg_destroy_decompress(&cinfo);
    PyEval_RestoreThread(released);
    PyBuffer_Release(&source);
    if (check_all && PyByteArray_Resize(out, (Py_ssize_t)out_width * 3 * height) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return Py_BuildValue("(Nii)", out, (int)x0, (int)out_width);
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, left, top, width, height, denom, check_all=True) -> (bytearray, x0, out_width): the rows and "
     "columns of a JPEG that a region needs, scaled by 1/denom, RGB (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "jpeg_region", NULL, -1, methods};

#define STRINGIFY_(x) #x
#define STRINGIFY(x) STRINGIFY_(x)

PyMODINIT_FUNC PyInit_jpeg_region(void) {
    PyObject *m = PyModule_Create(&module);
    /* The libjpeg-turbo it was built against (`dlstore doctor` shows it). */
    if (m != NULL && PyModule_AddStringConstant(m, "libjpeg_turbo_version", STRINGIFY(LIBJPEG_TURBO_VERSION)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* dlstore.format.tar_headers: the members of one sample's span of a tar, read from its headers in C.
 *
 * Why: the Python reader (dlstore.format.shards) takes ~40 us a sample, with the GIL held. A decode
 * thread beside a training loop holds the GIL for that, and the loop waits. This walk takes ~1 us.
 *
 *   sample_members(buffer, offset, size) -> (key, ((ext, start, stop), ...)) or None
 *
 * The span buffer[offset:offset+size] is walked header by header. It answers only for the plain case:
 * every header a ustar or old-style one, of a regular file, with an ASCII name of at most 100 bytes and
 * no prefix, an octal size and checksum, an unsigned checksum that matches, and every member of one
 * key, each extension once, the span ending where the last member's padding ends. Otherwise it answers
 * None, and the Python reader decides: it reads what else is valid and raises `CorruptShard` for the
 * rest. Where this answers, the answer is the Python reader's, with `start:stop` the member's bytes.
 * Names that need a closer look go to Python too: a leading "./" or "/", ".." or "\" anywhere, a
 * leading "__", a basename that starts with a dot or has none.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#define BLOCK 512
#define MAX_MEMBERS 64
#define MAX_MEMBER_SIZE (1LL << 30) /* shards.MAX_MEMBER_SIZE */

/* An octal field as `shards._number` reads it: up to the first NUL, spaces stripped, empty is 0.
 * -1 for what it would refuse or read another way (base-256, another character). */
static long long octal(const unsigned char *field, int width) {
    if (field[0] & 0x80)
        return -1;
    int end = 0;
    while (end < width && field[end] != 0)
        end++;
    int start = 0;
    while (start < end && field[start] == ' ')
        start++;
    while (end > start && field[end - 1] == ' ')
        end--;
    long long value = 0;
    for (int i = start; i < end; i++) {
        if (field[i] < '0' || field[i] > '7')
            return -1;
        value = value * 8 + (field[i] - '0');
    }
    return value;
}

static int plain_header(const unsigned char *block, long long *size) {
    long long stored = octal(block + 148, 8);
    unsigned sum = 8 * ' ';
    for (int i = 0; i < BLOCK; i++) /* a loop the compiler vectorises; the checksum field then out */
        sum += block[i];
    for (int i = 148; i < 156; i++)
        sum -= block[i];
    char type = (char)block[156];
    if (stored < 0 || stored != (long long)sum || (type != '0' && type != '\0' && type != '7'))
        return 0;
    if (memcmp(block + 257, "ustar\0", 6) == 0 && block[345] != 0) /* a prefix: Python joins it */
        return 0;
    *size = octal(block + 124, 12);
    return *size >= 0 && *size <= MAX_MEMBER_SIZE;
}

/* The key and extension of a plain name, as `shards.split_member_name` splits it; 0 if not plain. */
static int split_name(const unsigned char *name, int length, int *key_length, int *ext_start) {
    if (length == 0 || name[0] == '/' || (name[0] == '.' && length > 1 && name[1] == '/'))
        return 0;
    if (length > 1 && name[0] == '_' && name[1] == '_')
        return 0;
    int base = 0;
    for (int i = 0; i < length; i++) {
        unsigned char c = name[i];
        if (c >= 0x80 || c == '\\' || (c == '.' && i + 1 < length && name[i + 1] == '.'))
            return 0;
        if (c == '/')
            base = i + 1;
    }
    if (base == length || name[base] == '.')
        return 0;
    for (int i = base; i < length; i++) {
        if (name[i] == '.') {
            *key_length = i;
            *ext_start = i + 1;
            return 1;
        }
    }
    return 0;
}

static PyObject *sample_members(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset, size;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &offset, &size))
        return NULL;
    PyObject *result = Py_None, *members = NULL, *key = NULL;
    Py_INCREF(Py_None);
    if (offset < 0 || size <= 0 || offset > view.len || size > view.len - offset)
        goto done;
    const unsigned char *data = (const unsigned char *)view.buf;
    Py_ssize_t position = offset, end = offset + size;
    struct { Py_ssize_t name, key_length, ext_start, length, start, stop; } found[MAX_MEMBERS];
    int count = 0;
    while (position < end) {
        long long member_size;
        if (count == MAX_MEMBERS || end - position < BLOCK || !plain_header(data + position, &member_size))
            goto done;
        const unsigned char *name = data + position;
        int length = 0;
        while (length < 100 && name[length] != 0)
            length++;
        int key_length, ext_start;
        if (!split_name(name, length, &key_length, &ext_start))
            goto done;
        Py_ssize_t start = position + BLOCK, padded = (Py_ssize_t)((member_size + BLOCK - 1) / BLOCK * BLOCK);
        if (padded > end - start)
            goto done;
        if (count > 0 && (key_length != found[0].key_length || memcmp(name, data + found[0].name, key_length) != 0))
            goto done;
        for (int i = 0; i < count; i++) {
            Py_ssize_t other = found[i].length - found[i].ext_start;
            if (other == length - ext_start) {
                const unsigned char *a = data + found[i].name + found[i].ext_start, *b = name + ext_start;
                Py_ssize_t same = 0;
                while (same < other && Py_TOLOWER(a[same]) == Py_TOLOWER(b[same]))
                    same++;
                if (same == other)
                    goto done; /* the same extension twice: Python says so */
            }
        }
        found[count].name = position;
        found[count].key_length = key_length;
        found[count].ext_start = ext_start;
        found[count].length = length;
        found[count].start = start;
        found[count].stop = start + (Py_ssize_t)member_size;
        count++;
        position = start + padded;
    }
    if (count == 0)
        goto done;
    key = PyUnicode_DecodeASCII((const char *)data + found[0].name, found[0].key_length, NULL);
    members = key == NULL ? NULL : PyTuple_New(count);
    if (members == NULL)
        goto fail;
    for (int i = 0; i < count; i++) {
        char ext[100];
        Py_ssize_t n = found[i].length - found[i].ext_start;
        for (Py_ssize_t j = 0; j < n; j++)
            ext[j] = (char)Py_TOLOWER(data[found[i].name + found[i].ext_start + j]);
        PyObject *item = Py_BuildValue("(s#nn)", ext, n, found[i].start, found[i].stop);
        if (item == NULL)
            goto fail;
        PyTuple_SET_ITEM(members, i, item);
    }
    Py_DECREF(result);
    result = Py_BuildValue("(OO)", key, members);
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_XDECREF(key);
    Py_XDECREF(members);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"sample_members", sample_members, METH_VARARGS,
     "sample_members(buffer, offset, size) -> (key, ((ext, start, stop), ...)) or None: one sample's members, "
     "from plain ustar headers only (see the module's source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tar_headers", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tar_headers(void) { return PyModule_Create(&module); }

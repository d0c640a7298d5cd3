/* Batch rows built by C threads that never take the GIL: see row_workers.c. */
#ifndef DLSTORE_ROW_WORKERS_H
#define DLSTORE_ROW_WORKERS_H

#include <Python.h>

/* A list of crop_rows jobs, parsed with the GIL held; run without it. (jpeg_region.c) */
typedef struct Crops Crops;
Crops *crops_parse(PyObject *jobs, PyObject *out, PyObject *crop); /* NULL with an exception set */
void crops_run(Crops *crops);                                 /* no GIL needed */
PyObject *crops_results(Crops *crops);                        /* [None or error], one per job */
void crops_free(Crops *crops);                                /* with the GIL: releases the buffers */

PyObject *row_queue(PyObject *self, PyObject *args);
PyObject *start_rows(PyObject *self, PyObject *args);
PyObject *serve_rows(PyObject *self, PyObject *args);
PyObject *next_done(PyObject *self, PyObject *args);
PyObject *stop_rows(PyObject *self, PyObject *args);

#define ROW_WORKER_METHODS                                                                                         \
    {"row_queue", row_queue, METH_NOARGS, "row_queue() -> a queue of crop_rows lists for serve_rows threads."},    \
    {"start_rows", start_rows, METH_VARARGS,                                                                       \
     "start_rows(queue, jobs, out, crop, token): queue crop_rows(jobs, out, crop) for the queue's threads."},      \
    {"serve_rows", serve_rows, METH_VARARGS,                                                                       \
     "serve_rows(queue): run the queue's lists without the GIL until stop_rows; the caller's thread is its."},     \
    {"next_done", next_done, METH_VARARGS,                                                                         \
     "next_done(queue) -> (token, results) of a list done, in any order; None once stopped and drained."},         \
    {"stop_rows", stop_rows, METH_VARARGS,                                                                         \
     "stop_rows(queue): serve_rows returns once the lists queued are done, next_done once they are handed out."},

#endif

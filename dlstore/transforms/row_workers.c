/* Batch rows built by C threads that never take the GIL.
 *
 * Why: a decode thread that calls crop_rows must take the GIL back when the call returns. Beside a
 * training loop's Python that costs it a wait of up to the switch interval (5 ms) for each chunk of a
 * batch: a tenth of its time at 64 images a chunk. Here the decode itself runs in threads that wait for
 * nothing but work. Python threads prepare each list of jobs and start it; another takes the results.
 *
 *   queue = row_queue()
 *   start_rows(queue, jobs, out, crop, token)   jobs as crop_rows takes them; the buffers are held
 *   serve_rows(queue)                           in a worker thread: runs lists, GIL released, till stopped
 *   next_done(queue) -> (token, results) | None the next list done, with crop_rows' results
 *   stop_rows(queue)                            workers end once the queue is empty; next_done once
 *                                               every done list was handed out
 *
 * The buffers of a list are released by next_done, with the GIL, when it hands the list out.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdlib.h>

#include "row_workers.h"

typedef struct Task {
    Crops *crops;
    PyObject *token;
    struct Task *next;
} Task;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    Task *queued, *queued_tail, *finished, *finished_tail;
    int running, stopping;
} Queue;

static const char *CAPSULE = "dlstore.transforms.jpeg_region.row_queue";

static void push(Task **head, Task **tail, Task *task) {
    task->next = NULL;
    if (*tail != NULL)
        (*tail)->next = task;
    else
        *head = task;
    *tail = task;
}

static Task *pop(Task **head, Task **tail) {
    Task *task = *head;
    if (task != NULL) {
        *head = task->next;
        if (*head == NULL)
            *tail = NULL;
    }
    return task;
}

static void free_queue(PyObject *capsule) {
    /* Once nothing refers to it, with the GIL: the threads that serve it hold it through their
     * arguments, so they have ended. Lists still queued or not handed out are dropped here. */
    Queue *q = PyCapsule_GetPointer(capsule, CAPSULE);
    if (q == NULL)
        return;
    Task *task;
    while ((task = pop(&q->queued, &q->queued_tail)) != NULL ||
           (task = pop(&q->finished, &q->finished_tail)) != NULL) {
        crops_free(task->crops);
        Py_DECREF(task->token);
        free(task);
    }
    pthread_cond_destroy(&q->work);
    pthread_cond_destroy(&q->done);
    pthread_mutex_destroy(&q->lock);
    free(q);
}

static Queue *queue_of(PyObject *args) {
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule))
        return NULL;
    return PyCapsule_GetPointer(capsule, CAPSULE);
}

PyObject *row_queue(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    Queue *q = calloc(1, sizeof(Queue));
    if (q == NULL)
        return PyErr_NoMemory();
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->work, NULL);
    pthread_cond_init(&q->done, NULL);
    PyObject *capsule = PyCapsule_New(q, CAPSULE, free_queue);
    if (capsule == NULL) {
        pthread_cond_destroy(&q->work);
        pthread_cond_destroy(&q->done);
        pthread_mutex_destroy(&q->lock);
        free(q);
    }
    return capsule;
}

PyObject *start_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *capsule, *jobs, *out, *crop, *token;
    if (!PyArg_ParseTuple(args, "OO!OOO", &capsule, &PyList_Type, &jobs, &out, &crop, &token))
        return NULL;
    Queue *q = PyCapsule_GetPointer(capsule, CAPSULE);
    if (q == NULL)
        return NULL;
    Task *task = calloc(1, sizeof(Task));
    if (task == NULL)
        return PyErr_NoMemory();
    task->crops = crops_parse(jobs, out, crop);
    if (task->crops == NULL) {
        free(task);
        return NULL;
    }
    task->token = Py_NewRef(token);
    pthread_mutex_lock(&q->lock); /* held for a few instructions: no wait worth letting go of the GIL for */
    int stopping = q->stopping;
    if (!stopping) {
        push(&q->queued, &q->queued_tail, task);
        pthread_cond_signal(&q->work);
    }
    pthread_mutex_unlock(&q->lock);
    if (stopping) {
        crops_free(task->crops);
        Py_DECREF(task->token);
        free(task);
        PyErr_SetString(PyExc_RuntimeError, "the row queue is stopped");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *serve_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Queue *q = queue_of(args);
    if (q == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    for (;;) {
        Task *task = pop(&q->queued, &q->queued_tail);
        if (task == NULL) {
            if (q->stopping)
                break;
            pthread_cond_wait(&q->work, &q->lock);
            continue;
        }
        q->running++;
        pthread_mutex_unlock(&q->lock);
        crops_run(task->crops);
        pthread_mutex_lock(&q->lock);
        q->running--;
        push(&q->finished, &q->finished_tail, task);
        pthread_cond_broadcast(&q->done);
    }
    pthread_cond_broadcast(&q->done); /* next_done may be waiting for the last of them */
    pthread_mutex_unlock(&q->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject *next_done(PyObject *Py_UNUSED(self), PyObject *args) {
    Queue *q = queue_of(args);
    if (q == NULL)
        return NULL;
    Task *task;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    while ((task = pop(&q->finished, &q->finished_tail)) == NULL &&
           !(q->stopping && q->queued == NULL && q->running == 0))
        pthread_cond_wait(&q->done, &q->lock);
    pthread_mutex_unlock(&q->lock);
    Py_END_ALLOW_THREADS
    if (task == NULL)
        Py_RETURN_NONE;
    PyObject *results = crops_results(task->crops);
    crops_free(task->crops);
    PyObject *handed = results == NULL ? NULL : Py_BuildValue("(ON)", task->token, results);
    Py_DECREF(task->token);
    free(task);
    return handed;
}

PyObject *stop_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Queue *q = queue_of(args);
    if (q == NULL)
        return NULL;
    pthread_mutex_lock(&q->lock);
    q->stopping = 1;
    pthread_cond_broadcast(&q->work);
    pthread_cond_broadcast(&q->done);
    pthread_mutex_unlock(&q->lock);
    Py_RETURN_NONE;
}

/*
fdreply.h: replies to READ requests from a file descriptor, sent by worker threads.

Added by ckptfs (not part of pyfuse3 3.5.0). A read handler that returns a `FileSlice`
(bytes of a local file) is answered by one of a few C threads that never take the GIL:
fuse_reply_data() with a FUSE_BUF_IS_FD buffer, which libfuse sends by splice (file ->
pipe -> /dev/fuse) when FUSE_CAP_SPLICE_WRITE was negotiated, else by pread + writev. The
thread that runs the file system's handlers then does per-request work only: the bytes are
copied into the kernel (and read from disk when they are not in the page cache) elsewhere,
in parallel.

Each job owns its descriptor (a dup the caller made) and its request: the worker replies,
which frees the request, and closes the descriptor.

This work may be distributed under the terms of the GNU LGPL.
*/

#include <errno.h>
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#define PYFUSE3_FDREPLY_MAX_THREADS 64

struct pyfuse3_fdjob {
    fuse_req_t req;
    int fd;
    off_t off;
    size_t size;
    struct pyfuse3_fdjob *next;
};

static pthread_mutex_t pyfuse3_fdjob_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pyfuse3_fdjob_cond = PTHREAD_COND_INITIALIZER;
static struct pyfuse3_fdjob *pyfuse3_fdjob_head = NULL, *pyfuse3_fdjob_tail = NULL;
static int pyfuse3_fdreply_threads = 0;  /* started so far; they never exit */
static int pyfuse3_fdreply_idle = 0;  /* waiting for a job */
static int pyfuse3_fdreply_max = 8;
static unsigned long long pyfuse3_fdreply_failed = 0;  /* replies that could not be sent */

static void *pyfuse3_fdreply_worker(void *arg) {
    sigset_t all;
    (void)arg;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals are for the loop's thread */
    for (;;) {
        struct pyfuse3_fdjob *job;
        pthread_mutex_lock(&pyfuse3_fdjob_lock);
        while (pyfuse3_fdjob_head == NULL) {
            pyfuse3_fdreply_idle++;
            pthread_cond_wait(&pyfuse3_fdjob_cond, &pyfuse3_fdjob_lock);
            pyfuse3_fdreply_idle--;
        }
        job = pyfuse3_fdjob_head;
        pyfuse3_fdjob_head = job->next;
        if (pyfuse3_fdjob_head == NULL)
            pyfuse3_fdjob_tail = NULL;
        pthread_mutex_unlock(&pyfuse3_fdjob_lock);

        struct fuse_bufvec buf = FUSE_BUFVEC_INIT(job->size);
        buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
        buf.buf[0].fd = job->fd;
        buf.buf[0].pos = job->off;
        /* An error reading the file is replied as that error; < 0: the reply could not
           be written (the request was interrupted, the connection is gone). */
        if (fuse_reply_data(job->req, &buf, 0) < 0) {
            pthread_mutex_lock(&pyfuse3_fdjob_lock);
            pyfuse3_fdreply_failed++;
            pthread_mutex_unlock(&pyfuse3_fdjob_lock);
        }
        close(job->fd);
        free(job);
    }
    return NULL;
}

/* Queue a reply of `size` bytes of `fd` at `off` to `req`; the job takes `fd` (closes it).
   0, or -errno (then nothing was queued: the caller still owns `req` and `fd`). */
static int pyfuse3_fdreply_queue(fuse_req_t req, int fd, off_t off, size_t size) {
    struct pyfuse3_fdjob *job = malloc(sizeof(*job));
    int ret = 0;
    if (job == NULL)
        return -ENOMEM;
    job->req = req;
    job->fd = fd;
    job->off = off;
    job->size = size;
    job->next = NULL;
    pthread_mutex_lock(&pyfuse3_fdjob_lock);
    if (pyfuse3_fdreply_idle == 0 && pyfuse3_fdreply_threads < pyfuse3_fdreply_max) {
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        ret = pthread_create(&tid, &attr, pyfuse3_fdreply_worker, NULL);
        pthread_attr_destroy(&attr);
        if (ret == 0)
            pyfuse3_fdreply_threads++;
        else if (pyfuse3_fdreply_threads > 0)
            ret = 0;  /* the threads there are will get to it */
        else {
            pthread_mutex_unlock(&pyfuse3_fdjob_lock);
            free(job);
            return -ret;
        }
    }
    if (pyfuse3_fdjob_tail != NULL)
        pyfuse3_fdjob_tail->next = job;
    else
        pyfuse3_fdjob_head = job;
    pyfuse3_fdjob_tail = job;
    pthread_cond_signal(&pyfuse3_fdjob_cond);
    pthread_mutex_unlock(&pyfuse3_fdjob_lock);
    return 0;
}

static void pyfuse3_fdreply_set_max(int n) {
    pthread_mutex_lock(&pyfuse3_fdjob_lock);
    pyfuse3_fdreply_max = n < 1 ? 1 : (n > PYFUSE3_FDREPLY_MAX_THREADS ? PYFUSE3_FDREPLY_MAX_THREADS : n);
    pthread_mutex_unlock(&pyfuse3_fdjob_lock);
}

static void pyfuse3_fdreply_stats(int *threads, unsigned long long *failed) {
    pthread_mutex_lock(&pyfuse3_fdjob_lock);
    *threads = pyfuse3_fdreply_threads;
    *failed = pyfuse3_fdreply_failed;
    pthread_mutex_unlock(&pyfuse3_fdjob_lock);
}

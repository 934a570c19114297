/* pd_framepool: bounded pool of page-locked KV frame buffers (framepool.h). */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "framepool.h"
#include "node.h"

struct pd_framepool {
  pd_backend *be;
  size_t buf_bytes;
  pthread_mutex_t mu; /* guards everything below */
  size_t max_bufs;    /* cap in buffers */
  size_t n_bufs;      /* allocated (or being allocated by get) and not freed */
  void **idle;        /* [cap_slots]: released buffers, a stack */
  size_t n_idle, cap_slots;
  uint64_t n_gets, n_misses;
  bool closed; /* pd_framepool_free ran with buffers out: the last release frees the pool */
};

pd_framepool *pd_framepool_new(pd_backend *be, size_t buf_bytes, size_t cap_bytes, pd_err *e) {
  if (!be || !buf_bytes) {
    pd_err_set(e, PD_EINVAL, "frame pool: no backend or a zero buffer size");
    return NULL;
  }
  pd_framepool *p = calloc(1, sizeof *p);
  if (!p) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  p->be = be;
  p->buf_bytes = buf_bytes;
  p->max_bufs = be->ops.host_alloc && be->ops.host_free ? cap_bytes / buf_bytes : 0;
  p->cap_slots = p->max_bufs;
  if (p->cap_slots && !(p->idle = calloc(p->cap_slots, sizeof *p->idle))) {
    free(p);
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  int rc = pthread_mutex_init(&p->mu, NULL);
  if (rc != 0) {
    free(p->idle);
    free(p);
    pd_err_set(e, PD_ENOMEM, "frame pool: pthread_mutex_init failed (%d)", rc);
    return NULL;
  }
  return p;
}

size_t pd_framepool_buf_bytes(const pd_framepool *p) { return p ? p->buf_bytes : 0; }

void *pd_framepool_get(pd_framepool *p) {
  if (!p) return NULL;
  void *buf = NULL;
  bool alloc = false;
  pthread_mutex_lock(&p->mu);
  p->n_gets++;
  if (p->n_idle) buf = p->idle[--p->n_idle];
  else if (p->n_bufs < p->max_bufs) {
    p->n_bufs++; /* the slot is ours while host_alloc runs (unlocked: it may take ms) */
    alloc = true;
  } else p->n_misses++;
  pthread_mutex_unlock(&p->mu);
  if (!alloc) return buf;
  buf = p->be->ops.host_alloc(p->be, p->buf_bytes);
  if (!buf) {
    pthread_mutex_lock(&p->mu);
    p->n_bufs--;
    p->max_bufs = p->n_bufs; /* the driver refused: do not ask again for every frame */
    p->n_misses++;
    size_t held = p->n_bufs;
    pthread_mutex_unlock(&p->mu);
    pd_log(PD_LOG_WARN,
           "page-locked allocation of %zu bytes failed with %zu held: further KV frames beyond "
           "those use pageable memory",
           p->buf_bytes, held);
  }
  return buf;
}

void pd_framepool_release(pd_framepool *p, void *buf) {
  if (!p || !buf) return;
  pthread_mutex_lock(&p->mu);
  PD_ASSERT(p->n_idle < p->n_bufs); /* more releases than buffers out: not one of ours */
  if (p->closed) {
    /* pd_framepool_free ran too early: leak buf (the backend may be gone); the last one out
     * frees the pool */
    p->n_bufs--;
    bool last = p->n_bufs == 0;
    pthread_mutex_unlock(&p->mu);
    if (last) {
      pthread_mutex_destroy(&p->mu);
      free(p->idle);
      free(p);
    }
    return;
  }
  p->idle[p->n_idle++] = buf;
  pthread_mutex_unlock(&p->mu);
}

void pd_framepool_release_cb(void *data, void *hint) { pd_framepool_release(hint, data); }

void pd_framepool_stats_get(pd_framepool *p, pd_framepool_stats *s) {
  *s = (pd_framepool_stats){0};
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  s->buf_bytes = p->buf_bytes;
  s->max_bufs = p->max_bufs;
  s->n_bufs = p->n_bufs;
  s->n_idle = p->n_idle;
  s->n_gets = p->n_gets;
  s->n_misses = p->n_misses;
  pthread_mutex_unlock(&p->mu);
}

void pd_framepool_free(pd_framepool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < p->n_idle; i++) p->be->ops.host_free(p->be, p->idle[i]);
  p->n_bufs -= p->n_idle;
  p->n_idle = 0;
  size_t out = p->n_bufs;
  if (out) p->closed = true;
  pthread_mutex_unlock(&p->mu);
  if (out) {
    pd_log(PD_LOG_WARN,
           "frame pool freed with %zu page-locked buffers still out (inside ZeroMQ?): they are "
           "leaked, not freed",
           out);
    return; /* the last release frees p */
  }
  pthread_mutex_destroy(&p->mu);
  free(p->idle);
  free(p);
}

/* Worker pool: a mutex-protected pair of job queues, worker threads waiting on a condition
 * variable, and a list of finished jobs handed to the loop through an eventfd. See workpool.h. */
#include "workpool.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#define POOL_MAX_THREADS 64
/* Workers run this much nicer than the process: when CPUs are short (tokenizing three 5 MB
 * prompts on a two-core machine), the loop thread, at the process's priority, still gets the CPU
 * within a scheduler tick instead of a fair third of it (nice 10 weighs 110 against 1024). */
#define POOL_NICE 10

typedef struct wqueue {
  pd_work *head, *tail;
} wqueue;

struct pd_workpool {
  pd_evloop *loop;
  int efd; /* eventfd: nonzero while finished jobs wait for the loop */
  pthread_t th[POOL_MAX_THREADS];
  int n_threads;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  /* under mu */
  wqueue small, big, done;
  int running_big;
  bool stop;
  /* loop thread only */
  size_t pending;
};

static void q_push(wqueue *q, pd_work *w) {
  w->next_ = NULL;
  if (q->tail) q->tail->next_ = w;
  else q->head = w;
  q->tail = w;
}

static pd_work *q_pop(wqueue *q) {
  pd_work *w = q->head;
  if (w) {
    q->head = w->next_;
    if (!q->head) q->tail = NULL;
    w->next_ = NULL;
  }
  return w;
}

/* Under mu: the next job this worker may take, or NULL. */
static pd_work *take(pd_workpool *p) {
  pd_work *w = q_pop(&p->small);
  if (w) return w;
  /* one worker stays free for small jobs while big ones queue (unless there is only one) */
  if (p->big.head && (p->n_threads == 1 || p->running_big < p->n_threads - 1)) {
    p->running_big++;
    return q_pop(&p->big);
  }
  return NULL;
}

static void *worker_main(void *arg) {
  pd_workpool *p = arg;
  /* Linux: a thread's own nice value (best effort: raising it needs no privilege) */
  errno = 0;
  int base = getpriority(PRIO_PROCESS, 0);
  if (errno == 0) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), base + POOL_NICE);
  pthread_mutex_lock(&p->mu);
  for (;;) {
    pd_work *w = NULL;
    while (!p->stop && !(w = take(p))) pthread_cond_wait(&p->cv, &p->mu);
    if (!w) break; /* stopping: jobs not yet started are handed back by pd_workpool_free */
    pthread_mutex_unlock(&p->mu);
    w->run(w);
    pthread_mutex_lock(&p->mu);
    w->ran = true;
    if (w->big) {
      p->running_big--;
      pthread_cond_signal(&p->cv); /* a big slot is free again */
    }
    bool was_empty = p->done.head == NULL;
    q_push(&p->done, w);
    if (was_empty) {
      /* The loop drains the whole list per wake-up, so only the first finished job writes. */
      uint64_t one = 1;
      ssize_t r = write(p->efd, &one, sizeof one);
      (void)r; /* EAGAIN: the counter is already nonzero, the loop is woken anyway */
    }
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* Runs done for every finished job (loop thread). */
static void deliver(pd_workpool *p) {
  pthread_mutex_lock(&p->mu);
  pd_work *w = p->done.head;
  p->done.head = p->done.tail = NULL;
  pthread_mutex_unlock(&p->mu);
  while (w) {
    pd_work *next = w->next_;
    w->next_ = NULL;
    p->pending--;
    w->done(w); /* may free w */
    w = next;
  }
}

static void on_wake(pd_evloop *loop, int fd, unsigned events, void *ud) {
  (void)loop;
  (void)events;
  uint64_t v;
  ssize_t r = read(fd, &v, sizeof v); /* resets the counter before the list is taken */
  (void)r;
  deliver(ud);
}

pd_workpool *pd_workpool_new(pd_evloop *loop, int threads, pd_err *e) {
  if (!loop || threads < 1 || threads > POOL_MAX_THREADS) {
    pd_err_set(e, PD_EINVAL, "workpool: %d threads (1..%d)", threads, POOL_MAX_THREADS);
    return NULL;
  }
  pd_workpool *p = calloc(1, sizeof *p);
  if (!p) {
    pd_err_set(e, PD_ENOMEM, "workpool: out of memory");
    return NULL;
  }
  p->loop = loop;
  p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (p->efd < 0) {
    pd_err_set(e, PD_EIO, "workpool: eventfd: %s", strerror(errno));
    free(p);
    return NULL;
  }
  if (pthread_mutex_init(&p->mu, NULL) != 0 || pthread_cond_init(&p->cv, NULL) != 0) {
    pd_err_set(e, PD_EIO, "workpool: cannot create a mutex or condition variable");
    close(p->efd);
    free(p);
    return NULL;
  }
  if (pd_evloop_add_fd(loop, p->efd, PD_EV_READ, on_wake, p, e) != PD_OK) {
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    close(p->efd);
    free(p);
    return NULL;
  }
  for (int i = 0; i < threads; i++) {
    int rc = pthread_create(&p->th[i], NULL, worker_main, p);
    if (rc != 0) {
      pd_err_set(e, PD_EIO, "workpool: pthread_create: %s", strerror(rc));
      pd_workpool_free(p);
      return NULL;
    }
    p->n_threads++;
    char name[16];
    snprintf(name, sizeof name, "pd-work-%d", i);
    pthread_setname_np(p->th[i], name); /* best effort: for top and debuggers */
  }
  return p;
}

pd_status pd_workpool_submit(pd_workpool *p, pd_work *w, pd_err *e) {
  if (!w || !w->run || !w->done) return pd_err_set(e, PD_EINVAL, "workpool: a job needs run and done");
  w->ran = false;
  p->pending++;
  pthread_mutex_lock(&p->mu);
  q_push(w->big ? &p->big : &p->small, w);
  pthread_cond_signal(&p->cv);
  pthread_mutex_unlock(&p->mu);
  return PD_OK;
}

size_t pd_workpool_pending(const pd_workpool *p) { return p->pending; }

void pd_workpool_free(pd_workpool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_threads; i++) pthread_join(p->th[i], NULL);
  pd_evloop_del_fd(p->loop, p->efd);
  deliver(p); /* those that ran */
  pd_work *w;
  while ((w = q_pop(&p->small)) || (w = q_pop(&p->big))) {
    p->pending--;
    w->done(w); /* ran is false */
  }
  close(p->efd);
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

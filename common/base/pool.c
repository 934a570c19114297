/* pd_pool (pd/pool.h): a persistent thread pool with low-latency dispatch.
 *
 * Decode runs ~60 small ops per token, so what matters is the time from pd_pool_run to every
 * worker being busy, and back. Workers spin on the job counter for a while after each job
 * (PD_POOL_SPIN_US = 300 us by default, or the CPU backend's --cpu-spin-us; yielding the core now and then after the first 20 us) and only
 * then sleep on a condition variable; the caller wakes sleepers only when there are any, so
 * back-to-back ops cost a few cache-line transfers (well under a microsecond).
 *
 * Job protocol. One 64-bit atomic word `ctr` holds (generation << 32 | next task index).
 * Job g is described by slot[g % 4] (fn, ctx, n_tasks), written before ctr is published with
 * generation g and index 0. A thread claims a task with a CAS that also checks the generation.
 * If that CAS succeeds, job g still had unclaimed tasks, so the caller had not begun job g + 1,
 * let alone rewritten slot[g % 4] for job g + 4: whatever a late, descheduled worker read from
 * the slot is job g's. Every finished task bumps `done`; the caller returns when
 * done == n_tasks, so no task outlives the call (ctx may live on the caller's stack). */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd/pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct pd_worker {
  pd_pool *pool;
  int id;
  pthread_t th;
} pd_worker;

struct pd_pool {
  int n; /* threads, the caller included */
  pd_worker *w;
  int n_started;
  int64_t spin_ns;

  _Atomic uint64_t ctr;        /* generation << 32 | next task */
  struct {
    _Atomic(pd_pool_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int n_tasks;
  } slot[4];                   /* job g lives in slot[g & 3] */
  _Atomic int done;            /* tasks of the current job finished */
  _Atomic int sleepers;        /* workers blocked on cv */
  _Atomic int stop;
  uint32_t gen;                /* caller-side copy of the current generation */

  pthread_mutex_t mu;
  pthread_cond_t cv;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claims and runs tasks of generation gen until none are left. */
static void run_tasks(pd_pool *p, uint32_t gen, int self) {
  pd_pool_fn fn = atomic_load_explicit(&p->slot[gen & 3].fn, memory_order_relaxed);
  void *ctx = atomic_load_explicit(&p->slot[gen & 3].ctx, memory_order_relaxed);
  int n_tasks = atomic_load_explicit(&p->slot[gen & 3].n_tasks, memory_order_relaxed);
  for (;;) {
    uint64_t c = atomic_load_explicit(&p->ctr, memory_order_acquire);
    for (;;) {
      if ((uint32_t)(c >> 32) != gen || (int)(uint32_t)c >= n_tasks) return;
      if (atomic_compare_exchange_weak_explicit(&p->ctr, &c, c + 1, memory_order_acq_rel,
                                                memory_order_acquire))
        break;
    }
    fn(ctx, (int)(uint32_t)c, self);
    atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
  }
}

static void *worker_main(void *arg) {
  pd_worker *w = arg;
  pd_pool *p = w->pool;
  uint32_t seen = 0;
  for (;;) {
    uint64_t c = atomic_load_explicit(&p->ctr, memory_order_acquire);
    if ((uint32_t)(c >> 32) == seen && !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
      /* Spin first: the next op usually follows within microseconds. After the first 20 us,
       * yield now and then so that other runnable threads (another process on a busy machine)
       * get the core while we wait. */
      int64_t t0 = now_ns();
      for (unsigned it = 1;; it++) {
        cpu_relax();
        c = atomic_load_explicit(&p->ctr, memory_order_acquire);
        if ((uint32_t)(c >> 32) != seen || atomic_load_explicit(&p->stop, memory_order_relaxed))
          break;
        if ((it & 63) == 0) {
          int64_t dt = now_ns() - t0;
          if (dt > p->spin_ns) break;
          if (dt > 20000) sched_yield();
        }
      }
      if ((uint32_t)(c >> 32) == seen && !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
        pthread_mutex_lock(&p->mu);
        atomic_fetch_add(&p->sleepers, 1); /* seq_cst: pairs with the caller's load */
        for (;;) {
          c = atomic_load(&p->ctr);
          if ((uint32_t)(c >> 32) != seen || atomic_load(&p->stop)) break;
          pthread_cond_wait(&p->cv, &p->mu);
        }
        atomic_fetch_sub(&p->sleepers, 1);
        pthread_mutex_unlock(&p->mu);
      }
    }
    if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
    seen = (uint32_t)(c >> 32);
    run_tasks(p, seen, w->id);
  }
  return NULL;
}

static void wake_all(pd_pool *p) {
  pthread_mutex_lock(&p->mu);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

pd_pool *pd_pool_create(int n_threads, pd_err *e) {
  return pd_pool_create_spin(n_threads, PD_POOL_SPIN_US, e);
}

pd_pool *pd_pool_create_spin(int n_threads, int spin_us, pd_err *e) {
  if (n_threads < 1 || n_threads > 1024) {
    pd_err_set(e, PD_EINVAL, "thread pool: n_threads %d out of range [1, 1024]", n_threads);
    return NULL;
  }
  pd_pool *p = calloc(1, sizeof *p);
  if (!p) {
    pd_err_set(e, PD_ENOMEM, "thread pool: out of memory");
    return NULL;
  }
  p->n = n_threads;
  p->spin_ns = spin_us > 0 ? (int64_t)spin_us * 1000 : 0;
  atomic_init(&p->ctr, 0);
  for (int i = 0; i < 4; i++) {
    atomic_init(&p->slot[i].fn, NULL);
    atomic_init(&p->slot[i].ctx, NULL);
    atomic_init(&p->slot[i].n_tasks, 0);
  }
  atomic_init(&p->done, 0);
  atomic_init(&p->sleepers, 0);
  atomic_init(&p->stop, 0);
  if (pthread_mutex_init(&p->mu, NULL) != 0) {
    free(p);
    pd_err_set(e, PD_ENOMEM, "thread pool: pthread_mutex_init failed");
    return NULL;
  }
  if (pthread_cond_init(&p->cv, NULL) != 0) {
    pthread_mutex_destroy(&p->mu);
    free(p);
    pd_err_set(e, PD_ENOMEM, "thread pool: pthread_cond_init failed");
    return NULL;
  }
  if (n_threads > 1) {
    p->w = calloc((size_t)n_threads, sizeof *p->w);
    if (!p->w) {
      pd_pool_destroy(p);
      pd_err_set(e, PD_ENOMEM, "thread pool: out of memory");
      return NULL;
    }
    for (int i = 1; i < n_threads; i++) {
      p->w[i].pool = p;
      p->w[i].id = i;
      int rc = pthread_create(&p->w[i].th, NULL, worker_main, &p->w[i]);
      if (rc != 0) {
        pd_pool_destroy(p);
        pd_err_set(e, PD_EBACKEND, "thread pool: pthread_create failed: %s", strerror(rc));
        return NULL;
      }
      p->n_started = i;
    }
  }
  return p;
}

void pd_pool_destroy(pd_pool *p) {
  if (!p) return;
  atomic_store(&p->stop, 1);
  wake_all(p);
  for (int i = 1; i <= p->n_started; i++) pthread_join(p->w[i].th, NULL);
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  free(p->w);
  free(p);
}

int pd_pool_size(const pd_pool *p) { return p->n; }

void pd_pool_run(pd_pool *p, pd_pool_fn fn, void *ctx, int n_tasks) {
  if (n_tasks <= 0) return;
  if (p->n == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
    return;
  }
  uint32_t g = p->gen + 1;
  if (g == 0) g = 1; /* 0 is what a fresh worker has "seen" */
  p->gen = g;
  atomic_store_explicit(&p->slot[g & 3].fn, fn, memory_order_relaxed);
  atomic_store_explicit(&p->slot[g & 3].ctx, ctx, memory_order_relaxed);
  atomic_store_explicit(&p->slot[g & 3].n_tasks, n_tasks, memory_order_relaxed);
  atomic_store_explicit(&p->done, 0, memory_order_relaxed);
  atomic_store(&p->ctr, (uint64_t)g << 32); /* seq_cst: publishes the job */
  if (atomic_load(&p->sleepers) > 0) wake_all(p);
  run_tasks(p, g, 0);
  /* Wait for tasks other threads claimed; yield now and then in case one was descheduled. */
  for (unsigned it = 1; atomic_load_explicit(&p->done, memory_order_acquire) < n_tasks; it++) {
    cpu_relax();
    if ((it & 1023) == 0) sched_yield();
  }
}

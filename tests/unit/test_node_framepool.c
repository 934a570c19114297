/* pd_framepool (common/node/framepool.h) over a fake backend whose host_alloc / host_free are
 * malloc / free wrappers that count calls:
 *   - a backend without host_alloc: every get misses (the caller mallocs);
 *   - get allocates up to the cap, then misses; a released buffer is handed out again (LIFO)
 *     without a new host_alloc;
 *   - a refusing host_alloc lowers the cap: later gets do not ask it again;
 *   - release from another thread while the owner gets (a producer/consumer pair, like the
 *     node loop and ZeroMQ's I/O thread): no buffer is out twice, the cap holds;
 *   - free with everything released host_frees every buffer; free with a buffer still out
 *     leaks it (never host_frees it) and the late release frees the pool. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "framepool.h"
#include "pd_test.h"

static atomic_int n_alloc, n_free;
static atomic_bool refuse;

static void *fake_host_alloc(pd_backend *be, size_t bytes) {
  (void)be;
  if (atomic_load(&refuse)) return NULL;
  atomic_fetch_add(&n_alloc, 1);
  return calloc(1, bytes); /* zeroed: test_threads reads the tags */
}

static void fake_host_free(pd_backend *be, void *p) {
  (void)be;
  atomic_fetch_add(&n_free, 1);
  free(p);
}

static pd_backend *fake_backend(bool pinned) {
  pd_backend *be = calloc(1, sizeof *be);
  REQUIRE(be);
  be->ops.name = "fake";
  if (pinned) {
    be->ops.host_alloc = fake_host_alloc;
    be->ops.host_free = fake_host_free;
  }
  return be;
}

static void reset_counts(void) {
  atomic_store(&n_alloc, 0);
  atomic_store(&n_free, 0);
  atomic_store(&refuse, false);
}

enum { BUF = 1000 };

static void test_no_host_alloc(void) {
  reset_counts();
  pd_backend *be = fake_backend(false);
  pd_err e = {0};
  pd_framepool *p = pd_framepool_new(be, BUF, 1 << 20, &e);
  REQUIRE(p);
  CHECK(pd_framepool_get(p) == NULL);
  CHECK(pd_framepool_get(NULL) == NULL);
  CHECK(pd_framepool_buf_bytes(p) == BUF && pd_framepool_buf_bytes(NULL) == 0);
  pd_framepool_stats s;
  pd_framepool_stats_get(p, &s);
  CHECK(s.max_bufs == 0 && s.n_bufs == 0 && s.n_gets == 1 && s.n_misses == 1);
  pd_framepool_free(p);
  pd_framepool_free(NULL);
  CHECK(pd_framepool_new(be, 0, 1 << 20, &e) == NULL && e.code == PD_EINVAL);
  free(be);
}

static void test_reuse_and_cap(void) {
  reset_counts();
  pd_backend *be = fake_backend(true);
  pd_err e = {0};
  pd_framepool *p = pd_framepool_new(be, BUF, 3 * BUF + BUF / 2, &e); /* 3 buffers */
  REQUIRE(p);
  void *b[3];
  for (int i = 0; i < 3; i++) {
    b[i] = pd_framepool_get(p);
    REQUIRE(b[i]);
    memset(b[i], i + 1, BUF); /* the whole buffer is ours (ASan checks the size) */
  }
  CHECK(b[0] != b[1] && b[1] != b[2] && b[0] != b[2]);
  CHECK(atomic_load(&n_alloc) == 3);
  CHECK(pd_framepool_get(p) == NULL); /* at the cap */
  pd_framepool_release(p, b[1]);
  void *again = pd_framepool_get(p);
  CHECK(again == b[1]);
  CHECK(atomic_load(&n_alloc) == 3); /* reused, not allocated */
  pd_framepool_release(p, b[0]);
  pd_framepool_release(p, again);
  pd_framepool_release_cb(b[2], p); /* ZeroMQ's shape */
  pd_framepool_stats s;
  pd_framepool_stats_get(p, &s);
  CHECKF(s.n_bufs == 3 && s.n_idle == 3 && s.max_bufs == 3 && s.n_gets == 5 && s.n_misses == 1,
         "bufs %zu idle %zu max %zu gets %llu misses %llu", s.n_bufs, s.n_idle, s.max_bufs,
         (unsigned long long)s.n_gets, (unsigned long long)s.n_misses);
  CHECK(atomic_load(&n_free) == 0); /* nothing is freed before pd_framepool_free */
  pd_framepool_free(p);
  CHECK(atomic_load(&n_alloc) == 3 && atomic_load(&n_free) == 3);

  /* a cap below one buffer: off */
  p = pd_framepool_new(be, BUF, BUF - 1, &e);
  REQUIRE(p);
  CHECK(pd_framepool_get(p) == NULL);
  pd_framepool_free(p);
  free(be);
}

static void test_refusing_driver(void) {
  reset_counts();
  pd_backend *be = fake_backend(true);
  pd_err e = {0};
  pd_framepool *p = pd_framepool_new(be, BUF, 10 * BUF, &e);
  REQUIRE(p);
  void *a = pd_framepool_get(p);
  REQUIRE(a);
  atomic_store(&refuse, true);
  CHECK(pd_framepool_get(p) == NULL);
  atomic_store(&refuse, false);
  CHECK(pd_framepool_get(p) == NULL); /* the cap is now what the pool held: not asked again */
  CHECK(atomic_load(&n_alloc) == 1);
  pd_framepool_release(p, a);
  CHECK(pd_framepool_get(p) == a); /* what it holds still circulates */
  pd_framepool_release(p, a);
  pd_framepool_stats s;
  pd_framepool_stats_get(p, &s);
  CHECK(s.max_bufs == 1 && s.n_bufs == 1);
  pd_framepool_free(p);
  CHECK(atomic_load(&n_free) == 1);
  free(be);
}

/* ---- release from another thread ---- */

enum { CAP_BUFS = 4, QCAP = 64 };
#ifdef PD_SANITIZED
enum { ROUNDS = 5000 };
#else
enum { ROUNDS = 50000 };
#endif

typedef struct handoff {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  void *q[QCAP];
  int head, n;
  bool done;
  pd_framepool *pool;
  int bad; /* buffers that came with the wrong content */
} handoff;

static void *consumer(void *arg) {
  handoff *h = arg;
  for (;;) {
    pthread_mutex_lock(&h->mu);
    while (!h->n && !h->done) pthread_cond_wait(&h->cv, &h->mu);
    if (!h->n) {
      pthread_mutex_unlock(&h->mu);
      return NULL;
    }
    unsigned char *b = h->q[h->head];
    h->head = (h->head + 1) % QCAP;
    h->n--;
    pthread_mutex_unlock(&h->mu);
    /* the owner wrote a tag in byte 0 and its complement at the end */
    if ((unsigned char)(b[0] ^ 0xff) != b[BUF - 1]) h->bad++;
    b[0] = b[BUF - 1] = 0;
    pd_framepool_release(h->pool, b);
  }
}

static void test_threads(void) {
  reset_counts();
  pd_backend *be = fake_backend(true);
  pd_err e = {0};
  handoff h = {.pool = pd_framepool_new(be, BUF, CAP_BUFS * BUF, &e)};
  REQUIRE(h.pool);
  pthread_mutex_init(&h.mu, NULL);
  pthread_cond_init(&h.cv, NULL);
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, consumer, &h) == 0);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int sent = 0, misses = 0;
  bool timed_out = false;
  while (sent < ROUNDS) {
    unsigned char *b = pd_framepool_get(h.pool);
    if (!b) { /* all buffers are with the consumer: the caller would malloc; here we wait */
      misses++;
      struct timespec now;
      clock_gettime(CLOCK_MONOTONIC, &now);
      if (now.tv_sec - t0.tv_sec > 20) {
        timed_out = true;
        break;
      }
      sched_yield();
      continue;
    }
    /* a buffer out twice would show here: the consumer zeroes both tags before release */
    CHECK(b[0] == 0 && b[BUF - 1] == 0);
    unsigned char tag = (unsigned char)(1 + sent % 254);
    b[0] = tag;
    b[BUF - 1] = (unsigned char)(tag ^ 0xff);
    pthread_mutex_lock(&h.mu);
    REQUIRE(h.n < QCAP); /* at most CAP_BUFS are ever out */
    h.q[(h.head + h.n) % QCAP] = b;
    h.n++;
    pthread_cond_signal(&h.cv);
    pthread_mutex_unlock(&h.mu);
    sent++;
  }
  pthread_mutex_lock(&h.mu);
  h.done = true;
  pthread_cond_signal(&h.cv);
  pthread_mutex_unlock(&h.mu);
  pthread_join(t, NULL);
  CHECK(!timed_out);
  CHECK(h.bad == 0);
  pd_framepool_stats s;
  pd_framepool_stats_get(h.pool, &s);
  CHECKF(s.n_bufs <= CAP_BUFS && s.n_idle == s.n_bufs && atomic_load(&n_alloc) == (int)s.n_bufs,
         "bufs %zu idle %zu allocs %d", s.n_bufs, s.n_idle, atomic_load(&n_alloc));
  CHECK(s.n_misses == (uint64_t)misses);
  pd_framepool_free(h.pool);
  CHECK(atomic_load(&n_free) == atomic_load(&n_alloc));
  pthread_mutex_destroy(&h.mu);
  pthread_cond_destroy(&h.cv);
  free(be);
  printf("threads: %d frames through %zu buffers, %d misses\n", sent, s.n_bufs, misses);
}

/* pd_framepool_free too early (a buffer still "inside ZeroMQ"): that buffer is never
 * host_freed, the pool lives until it comes back. */
static void test_free_with_buffer_out(void) {
  reset_counts();
  pd_backend *be = fake_backend(true);
  pd_err e = {0};
  pd_framepool *p = pd_framepool_new(be, BUF, 4 * BUF, &e);
  REQUIRE(p);
  void *a = pd_framepool_get(p), *b = pd_framepool_get(p);
  REQUIRE(a && b);
  pd_framepool_release(p, a);
  pd_framepool_free(p); /* b is out: a is freed, b is not */
  CHECK(atomic_load(&n_free) == 1);
  memset(b, 7, BUF); /* still valid memory */
  pd_framepool_release(p, b); /* the last one out frees the pool (ASan: no leak of it) */
  CHECK(atomic_load(&n_free) == 1);
  free(b); /* the test's fake "page-locked" memory: the pool leaked it on purpose */
  free(be);
}

int main(void) {
  test_no_host_alloc();
  test_reuse_and_cap();
  test_refusing_driver();
  test_threads();
  test_free_with_buffer_out();
  return pd_test_finish("test_node_framepool");
}

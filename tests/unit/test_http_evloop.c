/* Event loop: timer order (deadline, then insertion), cancellation (before and after firing),
 * a self-re-arming zero-delay timer does not starve fd events, fd watchers (level and edge
 * triggered), stale events dropped after a watcher is removed or its fd number reused within
 * one batch, posts from several threads (all run, per-thread order kept), stop from another
 * thread, and queued posts run by pd_evloop_free. Every wait is bounded. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "evloop.h"
#include "pd_test.h"

static pd_evloop *mk(void) {
  pd_err e = {0};
  pd_evloop *l = pd_evloop_new(&e);
  if (!l) fprintf(stderr, "pd_evloop_new: %s\n", e.msg);
  REQUIRE(l);
  return l;
}

/* A watchdog: stops the loop after ms so a bug cannot hang the test (it then fails checks). */
static void on_watchdog(pd_evloop *l, uint64_t id, void *ud) {
  *(int *)ud = 1;
  pd_evloop_stop(l);
}

/* ---- timers ---- */

typedef struct {
  int order[16];
  int n;
} order_log;
typedef struct {
  order_log *log;
  int tag;
} tctx;

static void on_order(pd_evloop *l, uint64_t id, void *ud) {
  tctx *t = ud;
  t->log->order[t->log->n++] = t->tag;
  if (t->log->n == 5) pd_evloop_stop(l);
}

static void test_timer_order(void) {
  pd_evloop *l = mk();
  order_log log = {{0}, 0};
  tctx t[7];
  uint64_t ids[7];
  int delays[7] = {40, 10, 30, 10, 20, 15, 5};
  /* before the adds: a timer's deadline counts from its add (under ASan the adds and cancels
   * below took over a millisecond, and an end measured from after them read 39 ms) */
  const uint64_t t0 = pd_evloop_now_ms();
  for (int i = 0; i < 7; i++) {
    t[i] = (tctx){&log, i};
    CHECK(pd_evloop_timer_add(l, (uint64_t)delays[i], on_order, &t[i], &ids[i], NULL) == PD_OK);
    CHECK(ids[i] != 0);
  }
  CHECK(pd_evloop_timer_count(l) == 7);
  CHECK(pd_evloop_timer_cancel(l, ids[6])); /* 5 ms */
  CHECK(pd_evloop_timer_cancel(l, ids[5])); /* 15 ms */
  CHECK(!pd_evloop_timer_cancel(l, ids[5])); /* twice */
  CHECK(!pd_evloop_timer_cancel(l, 0));
  CHECK(!pd_evloop_timer_cancel(l, 12345678901ull));
  CHECK(pd_evloop_timer_count(l) == 5);
  int wd = 0;
  CHECK(pd_evloop_timer_add(l, 5000, on_watchdog, &wd, NULL, NULL) == PD_OK);
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  uint64_t el = pd_evloop_now_ms() - t0;
  CHECK(!wd);
  CHECK(log.n == 5);
  int want[5] = {1, 3, 4, 2, 0}; /* 10, 10 (added later), 20, 30, 40 */
  for (int i = 0; i < 5; i++) CHECKF(log.order[i] == want[i], "position %d: %d", i, log.order[i]);
  CHECKF(el >= 40, "ran %llu ms, the last timer was 40 ms", (unsigned long long)el);
  for (int i = 0; i < 5; i++) CHECK(!pd_evloop_timer_cancel(l, ids[i])); /* fired */
  CHECK(pd_evloop_timer_count(l) == 1);                                  /* the watchdog */
  pd_evloop_free(l);
}

/* A 0 ms timer that re-arms itself, and a pipe made readable: the fd event must still come. */
typedef struct {
  long spins;
  int rfd;
  bool got_fd;
} starve_ctx;

static void on_spin(pd_evloop *l, uint64_t id, void *ud) {
  starve_ctx *s = ud;
  if (++s->spins > 1000000) {
    pd_evloop_stop(l);
    return;
  }
  pd_evloop_timer_add(l, 0, on_spin, s, NULL, NULL);
}

static void on_pipe_stop(pd_evloop *l, int fd, unsigned ev, void *ud) {
  starve_ctx *s = ud;
  char b[16];
  CHECK(ev & PD_EV_READ);
  CHECK(read(fd, b, sizeof b) == 1);
  s->got_fd = true;
  pd_evloop_stop(l);
}

static void test_no_starvation(void) {
  pd_evloop *l = mk();
  int p[2];
  REQUIRE(pipe(p) == 0);
  starve_ctx s = {0, p[0], false};
  CHECK(pd_evloop_add_fd(l, p[0], PD_EV_READ, on_pipe_stop, &s, NULL) == PD_OK);
  CHECK(pd_evloop_timer_add(l, 0, on_spin, &s, NULL, NULL) == PD_OK);
  CHECK(write(p[1], "x", 1) == 1);
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  CHECK(s.got_fd);
  CHECKF(s.spins < 100, "%ld spins before the fd event", s.spins);
  pd_evloop_del_fd(l, p[0]);
  close(p[0]);
  close(p[1]);
  pd_evloop_free(l);
}

/* ---- fd watchers ---- */

typedef struct {
  pd_evloop *l;
  int a[2], b[2], c[2]; /* pipes */
  int calls_a, calls_b, calls_c;
  bool c_was_readable_when_called;
} fd_ctx;

static void on_c(pd_evloop *l, int fd, unsigned ev, void *ud) {
  fd_ctx *x = ud;
  x->calls_c++;
}

static void on_b(pd_evloop *l, int fd, unsigned ev, void *ud) {
  fd_ctx *x = ud;
  x->calls_b++;
}

/* a's callback removes b's watcher, closes b, and opens a fresh pipe c (likely reusing b's
 * number) watched with a different callback: b's already fetched event must reach nobody. */
static void on_a(pd_evloop *l, int fd, unsigned ev, void *ud) {
  fd_ctx *x = ud;
  x->calls_a++;
  char buf[8];
  CHECK(read(fd, buf, sizeof buf) == 1);
  pd_evloop_del_fd(l, x->b[0]);
  close(x->b[0]);
  close(x->b[1]);
  x->b[0] = x->b[1] = -1;
  REQUIRE(pipe(x->c) == 0);
  CHECK(pd_evloop_add_fd(l, x->c[0], PD_EV_READ, on_c, x, NULL) == PD_OK);
}

static void on_stop_timer(pd_evloop *l, uint64_t id, void *ud) { pd_evloop_stop(l); }

static void test_stale_events(void) {
  int hits_reused = 0, stale_cases = 0;
  for (int rep = 0; rep < 20; rep++) {
    pd_evloop *l = mk();
    fd_ctx x = {.l = l};
    REQUIRE(pipe(x.a) == 0);
    REQUIRE(pipe(x.b) == 0);
    /* Both readable before the wait so both events come in one batch; which one is dispatched
     * first is up to epoll, so each callback may run first; only "b after a" is the case of
     * interest, and it must never call b or c. */
    CHECK(pd_evloop_add_fd(l, x.a[0], PD_EV_READ, on_a, &x, NULL) == PD_OK);
    CHECK(pd_evloop_add_fd(l, x.b[0], PD_EV_READ, on_b, &x, NULL) == PD_OK);
    int bnum = x.b[0];
    CHECK(write(x.a[1], "x", 1) == 1); /* epoll's ready list is FIFO: a is reported first */
    CHECK(write(x.b[1], "y", 1) == 1);
    CHECK(pd_evloop_timer_add(l, 30, on_stop_timer, NULL, NULL, NULL) == PD_OK);
    CHECK(pd_evloop_run(l, NULL) == PD_OK);
    CHECK(x.calls_a == 1);
    /* b may have been dispatched before a (legitimately readable then), never after. */
    CHECK(x.calls_b <= 1);
    if (x.calls_b == 0) stale_cases++;
    CHECK(x.calls_c == 0); /* c was never written: any call is a stale event */
    if (x.c[0] == bnum) hits_reused++;
    pd_evloop_del_fd(l, x.a[0]);
    pd_evloop_del_fd(l, x.c[0]);
    close(x.a[0]);
    close(x.a[1]);
    close(x.c[0]);
    close(x.c[1]);
    pd_evloop_free(l);
  }
  CHECK(hits_reused > 0); /* the fd number really was reused */
  CHECK(stale_cases > 0); /* and b's event was fetched but dropped (not dispatched first) */
}

typedef struct {
  int calls;
} edge_ctx;

static void on_edge(pd_evloop *l, int fd, unsigned ev, void *ud) {
  ((edge_ctx *)ud)->calls++; /* deliberately not reading */
}

static void test_edge_and_level(void) {
  pd_evloop *l = mk();
  int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  REQUIRE(efd >= 0);
  edge_ctx ec = {0};
  CHECK(pd_evloop_add_fd(l, efd, PD_EV_READ | PD_EV_EDGE, on_edge, &ec, NULL) == PD_OK);
  CHECK(pd_evloop_add_fd(l, efd, PD_EV_READ, on_edge, &ec, NULL) == PD_EINVAL); /* twice */
  uint64_t one = 1;
  CHECK(write(efd, &one, sizeof one) == sizeof one);
  CHECK(pd_evloop_timer_add(l, 50, on_stop_timer, NULL, NULL, NULL) == PD_OK);
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  CHECK(ec.calls == 1); /* one edge, however many iterations */
  CHECK(write(efd, &one, sizeof one) == sizeof one);
  CHECK(pd_evloop_timer_add(l, 30, on_stop_timer, NULL, NULL, NULL) == PD_OK);
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  CHECK(ec.calls == 2);
  /* Level-triggered: an unread fd is reported on every iteration. */
  CHECK(pd_evloop_mod_fd(l, efd, PD_EV_READ, NULL) == PD_OK);
  CHECK(pd_evloop_timer_add(l, 30, on_stop_timer, NULL, NULL, NULL) == PD_OK);
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  CHECKF(ec.calls > 10, "level-triggered calls %d", ec.calls);
  /* Interest 0: nothing reported. */
  int before = ec.calls;
  CHECK(pd_evloop_mod_fd(l, efd, 0, NULL) == PD_OK);
  CHECK(pd_evloop_timer_add(l, 20, on_stop_timer, NULL, NULL, NULL) == PD_OK);
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  CHECK(ec.calls == before);
  pd_evloop_del_fd(l, efd);
  CHECK(pd_evloop_mod_fd(l, efd, PD_EV_READ, NULL) == PD_EINVAL);
  pd_evloop_del_fd(l, efd); /* no-op */
  close(efd);
  CHECK(pd_evloop_add_fd(l, -1, PD_EV_READ, on_edge, &ec, NULL) == PD_EINVAL);
  pd_evloop_free(l);
}

/* ---- posts and stop from other threads ---- */

enum { NTHREADS = 4, PER_THREAD = 2000 };

typedef struct {
  pd_evloop *l;
  int last[NTHREADS];
  int count;
  bool order_ok, on_loop_thread;
} post_state;

typedef struct {
  post_state *ps;
  int thread, seq;
} post_msg;

static void on_post(pd_evloop *l, void *ud) {
  post_msg *m = ud;
  post_state *ps = m->ps;
  if (m->seq != ps->last[m->thread] + 1) ps->order_ok = false;
  if (!pd_evloop_in_loop_thread(l)) ps->on_loop_thread = false;
  ps->last[m->thread] = m->seq;
  if (++ps->count == NTHREADS * PER_THREAD) pd_evloop_stop(l);
  free(m);
}

typedef struct {
  post_state *ps;
  int thread;
} poster_arg;

static void *poster(void *arg) {
  poster_arg *a = arg;
  for (int i = 0; i < PER_THREAD; i++) {
    post_msg *m = malloc(sizeof *m);
    m->ps = a->ps;
    m->thread = a->thread;
    m->seq = i;
    CHECK(pd_evloop_post(a->ps->l, on_post, m, NULL) == PD_OK);
    if (i % 256 == 0) usleep(100);
  }
  return NULL;
}

static void test_posts(void) {
  pd_evloop *l = mk();
  post_state ps = {.l = l, .order_ok = true, .on_loop_thread = true};
  for (int i = 0; i < NTHREADS; i++) ps.last[i] = -1;
  int wd = 0;
  CHECK(pd_evloop_timer_add(l, 10000, on_watchdog, &wd, NULL, NULL) == PD_OK);
  pthread_t th[NTHREADS];
  poster_arg args[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    args[i] = (poster_arg){&ps, i};
    REQUIRE(pthread_create(&th[i], NULL, poster, &args[i]) == 0);
  }
  CHECK(!pd_evloop_in_loop_thread(l));
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
  CHECK(!wd);
  CHECK(ps.count == NTHREADS * PER_THREAD);
  CHECK(ps.order_ok);
  CHECK(ps.on_loop_thread);
  pd_evloop_free(l);
}

typedef struct {
  pd_evloop *l;
  atomic_int started;
} stop_arg;

static void *stopper(void *arg) {
  stop_arg *a = arg;
  usleep(50 * 1000);
  pd_evloop_stop(a->l);
  return NULL;
}

static void on_free_me(pd_evloop *l, void *ud) { free(ud); }

static void test_stop_and_free(void) {
  pd_evloop *l = mk();
  int wd = 0;
  CHECK(pd_evloop_timer_add(l, 5000, on_watchdog, &wd, NULL, NULL) == PD_OK);
  stop_arg a = {.l = l};
  pthread_t th;
  REQUIRE(pthread_create(&th, NULL, stopper, &a) == 0);
  uint64_t t0 = pd_evloop_now_ms();
  CHECK(pd_evloop_run(l, NULL) == PD_OK); /* blocked in epoll_wait: woken by the eventfd */
  uint64_t el = pd_evloop_now_ms() - t0;
  pthread_join(th, NULL);
  CHECK(!wd);
  CHECKF(el >= 40 && el < 2000, "stopped after %llu ms", (unsigned long long)el);
  /* A stop before run makes run return at once. */
  pd_evloop_stop(l);
  t0 = pd_evloop_now_ms();
  CHECK(pd_evloop_run(l, NULL) == PD_OK);
  CHECK(pd_evloop_now_ms() - t0 < 1000);
  /* Posts still queued at free are run (the malloc'd payloads are freed: ASan checks). */
  for (int i = 0; i < 10; i++) CHECK(pd_evloop_post(l, on_free_me, malloc(32), NULL) == PD_OK);
  pd_evloop_free(l);
  pd_evloop_free(NULL);
}

int main(void) {
  test_timer_order();
  test_no_starvation();
  test_stale_events();
  test_edge_and_level();
  test_posts();
  test_stop_and_free();
  return pd_test_finish("test_http_evloop");
}

/* Worker pool (router/workpool.h) on a real event loop: every job runs once on a worker thread
 * and its done callback runs once on the loop thread; the pending count returns to zero; a small
 * job completes while big jobs hold every big slot (at most threads - 1 big jobs at once; with
 * one thread big jobs still run); workers run at nice +10; freeing the pool waits for running
 * jobs and hands queued ones back with ran = false; bad arguments. Every wait is bounded. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "pd_test.h"
#include "workpool.h"

typedef struct job {
  pd_work w;
  pd_evloop *loop;
  atomic_int *gate;     /* big jobs wait until it is nonzero (NULL: no wait) */
  int in, out;          /* run: out = in * in */
  bool ran_on_loop;     /* run was (wrongly) called on the loop thread */
  int nice;             /* the worker's nice value */
  bool done_on_loop;    /* done was called on the loop thread */
  int done_calls;
} job;

static atomic_int g_done;         /* done callbacks seen */
static atomic_int g_big_running;  /* big jobs inside run now */
static atomic_int g_big_max;      /* most big jobs seen inside run at once */
static int g_stop_after;          /* the loop stops when g_done reaches it */
static atomic_int g_small_done_while_big_blocked;

static void run_job(pd_work *w) {
  job *j = (job *)w;
  j->ran_on_loop = pd_evloop_in_loop_thread(j->loop);
  j->nice = getpriority(PRIO_PROCESS, 0); /* Linux: the calling thread's */
  if (w->big) {
    int now = atomic_fetch_add(&g_big_running, 1) + 1;
    int m = atomic_load(&g_big_max);
    while (now > m && !atomic_compare_exchange_weak(&g_big_max, &m, now)) {
    }
    for (int i = 0; j->gate && !atomic_load(j->gate) && i < 5000; i++) usleep(1000);
    atomic_fetch_sub(&g_big_running, 1);
  }
  j->out = j->in * j->in;
}

static void done_job(pd_work *w) {
  job *j = (job *)w;
  j->done_on_loop = pd_evloop_in_loop_thread(j->loop);
  j->done_calls++;
  if (!w->big && atomic_load(&g_big_running) > 0) atomic_store(&g_small_done_while_big_blocked, 1);
  if (atomic_fetch_add(&g_done, 1) + 1 == g_stop_after) pd_evloop_stop(j->loop);
}

static void on_watchdog(pd_evloop *l, uint64_t id, void *ud) {
  *(int *)ud = 1;
  pd_evloop_stop(l);
}

static void reset(int stop_after) {
  atomic_store(&g_done, 0);
  atomic_store(&g_big_running, 0);
  atomic_store(&g_big_max, 0);
  atomic_store(&g_small_done_while_big_blocked, 0);
  g_stop_after = stop_after;
}

static void run_loop(pd_evloop *l, int ms) {
  int fired = 0;
  uint64_t id;
  REQUIRE(pd_evloop_timer_add(l, (uint64_t)ms, on_watchdog, &fired, &id, NULL) == PD_OK);
  pd_err e = {0};
  CHECK(pd_evloop_run(l, &e) == PD_OK);
  CHECKF(!fired, "watchdog fired after %d ms (%d jobs done)", ms, atomic_load(&g_done));
  pd_evloop_timer_cancel(l, id);
}

static void test_many_small(void) {
  enum { N = 500 };
  pd_err e = {0};
  pd_evloop *l = pd_evloop_new(&e);
  REQUIRE(l);
  pd_workpool *p = pd_workpool_new(l, 4, &e);
  REQUIRE(p);
  static job jobs[N];
  memset(jobs, 0, sizeof jobs);
  reset(N);
  for (int i = 0; i < N; i++) {
    jobs[i] = (job){.w = {.run = run_job, .done = done_job}, .loop = l, .in = i};
    CHECK(pd_workpool_submit(p, &jobs[i].w, &e) == PD_OK);
  }
  CHECK(pd_workpool_pending(p) == N);
  run_loop(l, 10000);
  int bad = 0;
  for (int i = 0; i < N; i++)
    if (jobs[i].out != i * i || jobs[i].done_calls != 1 || !jobs[i].done_on_loop ||
        jobs[i].ran_on_loop || !jobs[i].w.ran)
      bad++;
  CHECKF(bad == 0, "%d of %d jobs wrong", bad, N);
  CHECK(pd_workpool_pending(p) == 0);
  /* the workers yield to the loop when CPUs are short */
  int base = getpriority(PRIO_PROCESS, 0), want = base + 10 > 19 ? 19 : base + 10;
  CHECKF(jobs[0].nice == want, "worker nice %d, want %d", jobs[0].nice, want);
  pd_workpool_free(p);
  pd_evloop_free(l);
}

/* Helper thread: opens the gate after ms. */
typedef struct {
  atomic_int *gate;
  int ms;
} opener;
static void *open_later(void *arg) {
  opener *o = arg;
  usleep((useconds_t)o->ms * 1000);
  atomic_store(o->gate, 1);
  return NULL;
}

static void test_lanes(int threads) {
  pd_err e = {0};
  pd_evloop *l = pd_evloop_new(&e);
  REQUIRE(l);
  pd_workpool *p = pd_workpool_new(l, threads, &e);
  REQUIRE(p);
  atomic_int gate;
  atomic_init(&gate, 0);
  enum { NB = 5 };
  job big[NB], small;
  reset(NB + 1);
  for (int i = 0; i < NB; i++) {
    big[i] = (job){.w = {.run = run_job, .done = done_job, .big = true}, .loop = l, .in = i,
                   .gate = &gate};
    CHECK(pd_workpool_submit(p, &big[i].w, &e) == PD_OK);
  }
  usleep(50 * 1000); /* the big jobs take their slots */
  small = (job){.w = {.run = run_job, .done = done_job}, .loop = l, .in = 7};
  CHECK(pd_workpool_submit(p, &small.w, &e) == PD_OK);
  pthread_t th;
  opener o = {&gate, 300};
  REQUIRE(pthread_create(&th, NULL, open_later, &o) == 0);
  run_loop(l, 10000);
  pthread_join(th, NULL);
  CHECK(small.out == 49 && small.done_calls == 1);
  for (int i = 0; i < NB; i++) CHECK(big[i].out == i * i && big[i].done_calls == 1);
  int want_max = threads == 1 ? 1 : threads - 1;
  CHECKF(atomic_load(&g_big_max) == want_max, "threads %d: %d big jobs at once", threads,
         atomic_load(&g_big_max));
  if (threads > 1)
    CHECKF(atomic_load(&g_small_done_while_big_blocked),
           "threads %d: the small job waited for the big ones", threads);
  pd_workpool_free(p);
  pd_evloop_free(l);
}

static void test_free_hands_back(void) {
  pd_err e = {0};
  pd_evloop *l = pd_evloop_new(&e);
  REQUIRE(l);
  pd_workpool *p = pd_workpool_new(l, 1, &e);
  REQUIRE(p);
  atomic_int gate;
  atomic_init(&gate, 0);
  enum { N = 6 };
  job jobs[N];
  reset(-1);
  for (int i = 0; i < N; i++) {
    jobs[i] = (job){.w = {.run = run_job, .done = done_job, .big = true}, .loop = l, .in = i,
                    .gate = &gate};
    CHECK(pd_workpool_submit(p, &jobs[i].w, &e) == PD_OK);
  }
  usleep(50 * 1000); /* the first is running, held at its gate */
  pthread_t th;
  opener o = {&gate, 100};
  REQUIRE(pthread_create(&th, NULL, open_later, &o) == 0);
  pd_workpool_free(p); /* the loop is not running: done callbacks run here */
  pthread_join(th, NULL);
  CHECK(atomic_load(&g_done) == N);
  CHECK(jobs[0].w.ran && jobs[0].out == 0 && jobs[0].done_calls == 1);
  int handed_back = 0;
  for (int i = 1; i < N; i++) {
    CHECK(jobs[i].done_calls == 1);
    if (!jobs[i].w.ran && jobs[i].out == 0) handed_back++;
  }
  CHECKF(handed_back == N - 1, "%d queued jobs handed back unrun", handed_back);
  pd_evloop_free(l);
}

static void test_bad_args(void) {
  pd_err e = {0};
  pd_evloop *l = pd_evloop_new(&e);
  REQUIRE(l);
  CHECK(pd_workpool_new(l, 0, &e) == NULL && e.code == PD_EINVAL);
  CHECK(pd_workpool_new(l, 1000, &e) == NULL && e.code == PD_EINVAL);
  pd_workpool *p = pd_workpool_new(l, 1, &e);
  REQUIRE(p);
  job j = {.w = {.run = run_job}};
  CHECK(pd_workpool_submit(p, &j.w, &e) == PD_EINVAL);
  CHECK(pd_workpool_pending(p) == 0);
  pd_workpool_free(p);
  pd_workpool_free(NULL);
  pd_evloop_free(l);
}

int main(void) {
  test_many_small();
  test_lanes(3);
  test_lanes(2);
  test_lanes(1);
  test_free_hands_back();
  test_bad_args();
  return pd_test_finish("test_workpool");
}

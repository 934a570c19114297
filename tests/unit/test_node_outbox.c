/* pd_outbox_send_owned (common/node/node.h): every payload frame is released exactly once with
 * the message's free function and hint, whatever becomes of it. Real ZeroMQ sockets over
 * tcp://127.0.0.1 and inproc://, every wait bounded:
 *   - sent: a ROUTER receives the messages; the frames come back through the free function,
 *     called by ZeroMQ's I/O thread; pd_outbox_send (free()) still works beside it;
 *   - dropped: a DEALER without a peer queues them in the outbox; the drop-oldest path and
 *     pd_outbox_clear release them on the caller's thread;
 *   - shutdown: frames from a pd_framepool sent over inproc:// to a peer that never reads them
 *     (its queue holds the very buffers) are all back in the pool once zmq_ctx_term returned, so pd_framepool_free after it frees every buffer
 *     (the rule pd_node_close follows). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "framepool.h"
#include "node.h"
#include "pd_test.h"

#define TIMEOUT_MS 5000

typedef struct counter {
  atomic_int calls, off_thread;
  pthread_t owner;
} counter;

static void counted_free(void *data, void *hint) {
  counter *c = hint;
  atomic_fetch_add(&c->calls, 1);
  if (!pthread_equal(pthread_self(), c->owner)) atomic_fetch_add(&c->off_thread, 1);
  free(data);
}

static int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Waits until *v reaches want (TIMEOUT_MS at most). */
static bool wait_for(atomic_int *v, int want) {
  int64_t end = now_ms() + TIMEOUT_MS;
  while (atomic_load(v) < want && now_ms() < end) sched_yield();
  return atomic_load(v) == want;
}

static void *sock_new(void *ctx, int type) {
  void *s = zmq_socket(ctx, type);
  REQUIRE(s);
  int zero = 0, one = 1;
  REQUIRE(zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero) == 0);
  if (type == ZMQ_DEALER) REQUIRE(zmq_setsockopt(s, ZMQ_IMMEDIATE, &one, sizeof one) == 0);
  return s;
}

/* A ROUTER on a free loopback port; its endpoint in ep. */
static void *router_bind(void *ctx, char *ep, size_t cap) {
  void *r = sock_new(ctx, ZMQ_ROUTER);
  REQUIRE(zmq_bind(r, "tcp://127.0.0.1:*") == 0);
  REQUIRE(zmq_getsockopt(r, ZMQ_LAST_ENDPOINT, ep, &cap) == 0);
  return r;
}

static void heartbeat_env(Pd__Envelope *env, Pd__Heartbeat *hb) {
  pd__heartbeat__init(hb);
  hb->node_id = "n1";
  pd_wire_envelope_init(env);
  env->body_case = PD__ENVELOPE__BODY_HEARTBEAT;
  env->heartbeat = hb;
}

/* Queues one message of n frames of bytes each, from malloc, released through c. */
static void send_counted(pd_outbox *o, counter *c, int n, size_t bytes) {
  void *f[4];
  size_t len[4];
  for (int i = 0; i < n; i++) {
    f[i] = malloc(bytes);
    REQUIRE(f[i]);
    memset(f[i], 0x5a, bytes);
    len[i] = bytes;
  }
  Pd__Envelope env;
  Pd__Heartbeat hb;
  heartbeat_env(&env, &hb);
  pd_err e = {0};
  CHECKF(pd_outbox_send_owned(o, &env, f, len, n, counted_free, c, &e) == PD_OK, "%s", e.msg);
  for (int i = 0; i < n; i++) CHECK(f[i] == NULL); /* taken over */
}

/* Flushes o until nothing is queued (TIMEOUT_MS at most). */
static bool flush_all(pd_outbox *o) {
  int64_t end = now_ms() + TIMEOUT_MS;
  while (pd_outbox_flush(o) > 0 && now_ms() < end) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  return o->n_msgs == 0;
}

/* Receives one message on r; returns its number of parts (routing id included), -1 on
 * timeout. sizes[i] = part sizes (cap of them). */
static int recv_msg(void *r, size_t *sizes, int cap) {
  zmq_pollitem_t it = {r, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&it, 1, TIMEOUT_MS) <= 0) return -1;
  int n = 0;
  for (;;) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, r, 0) < 0) {
      zmq_msg_close(&m);
      return -1;
    }
    if (n < cap) sizes[n] = zmq_msg_size(&m);
    n++;
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    if (!more) return n;
  }
}

static void test_sent(void) {
  void *ctx = zmq_ctx_new();
  REQUIRE(ctx);
  char ep[256];
  void *r = router_bind(ctx, ep, sizeof ep);
  void *d = sock_new(ctx, ZMQ_DEALER);
  REQUIRE(zmq_connect(d, ep) == 0);
  pd_outbox o;
  pd_outbox_init(&o, d, "n1");
  counter c = {.owner = pthread_self()};
  enum { MSGS = 8, FRAMES = 2 };
  const size_t bytes = 256 << 10; /* large: ZeroMQ sends it in place (zero copy) */
  for (int k = 0; k < MSGS; k++) {
    send_counted(&o, &c, FRAMES, bytes);
    pd_outbox_flush(&o);
  }
  /* and one through plain pd_outbox_send (free()): ASan sees it freed */
  {
    void *f = calloc(1, 100);
    size_t len = 100;
    Pd__Envelope env;
    Pd__Heartbeat hb;
    heartbeat_env(&env, &hb);
    pd_err e = {0};
    CHECK(pd_outbox_send(&o, &env, &f, &len, 1, &e) == PD_OK && f == NULL);
  }
  CHECK(flush_all(&o));
  for (int k = 0; k < MSGS; k++) {
    size_t sz[8];
    int n = recv_msg(r, sz, 8);
    CHECKF(n == 2 + FRAMES && sz[2] == bytes && sz[3] == bytes, "message %d: %d parts", k, n);
  }
  size_t sz[8];
  CHECK(recv_msg(r, sz, 8) == 3 && sz[2] == 100);
  CHECKF(wait_for(&c.calls, MSGS * FRAMES), "free function called %d times, want %d",
         atomic_load(&c.calls), MSGS * FRAMES);
  /* over tcp ZeroMQ's I/O thread lets go of a sent frame, not the sender */
  CHECKF(atomic_load(&c.off_thread) > 0, "%d of %d calls off the owner's thread",
         atomic_load(&c.off_thread), atomic_load(&c.calls));
  zmq_close(d);
  zmq_close(r);
  zmq_ctx_term(ctx);
  CHECK(atomic_load(&c.calls) == MSGS * FRAMES); /* exactly once */
}

static void test_dropped(void) {
  void *ctx = zmq_ctx_new();
  REQUIRE(ctx);
  void *d = sock_new(ctx, ZMQ_DEALER);
  /* not connected anywhere: every send is EAGAIN, the messages wait in the outbox */
  pd_outbox o;
  pd_outbox_init(&o, d, "n1");
  o.max_msgs = 2;
  counter c = {.owner = pthread_self()};
  send_counted(&o, &c, 2, 1000);
  send_counted(&o, &c, 3, 1000);
  CHECK(o.n_msgs == 2 && atomic_load(&c.calls) == 0);
  send_counted(&o, &c, 1, 1000); /* over the cap: the oldest (2 frames) goes */
  CHECKF(o.n_msgs == 2 && o.dropped == 1 && atomic_load(&c.calls) == 2, "queued %zu, calls %d",
         o.n_msgs, atomic_load(&c.calls));
  CHECK(pd_outbox_flush(&o) == 2);
  pd_outbox_clear(&o);
  CHECK(o.n_msgs == 0 && atomic_load(&c.calls) == 6);
  CHECK(atomic_load(&c.off_thread) == 0); /* dropped on the caller's thread */
  zmq_close(d);
  zmq_ctx_term(ctx);
  CHECK(atomic_load(&c.calls) == 6);
}

/* ---- shutdown with frames still inside ZeroMQ ---- */

static atomic_int n_alloc, n_free;
static void *fake_host_alloc(pd_backend *be, size_t bytes) {
  (void)be;
  atomic_fetch_add(&n_alloc, 1);
  return malloc(bytes);
}
static void fake_host_free(pd_backend *be, void *p) {
  (void)be;
  atomic_fetch_add(&n_free, 1);
  free(p);
}

static void test_pool_shutdown(void) {
  pd_backend *be = calloc(1, sizeof *be);
  REQUIRE(be);
  be->ops.host_alloc = fake_host_alloc;
  be->ops.host_free = fake_host_free;
  enum { BUF = 512 << 10, BUFS = 16, MSGS = 40 };
  pd_err e = {0};
  pd_framepool *pool = pd_framepool_new(be, BUF, (size_t)BUFS * BUF, &e);
  REQUIRE(pool);
  void *ctx = zmq_ctx_new();
  REQUIRE(ctx);
  /* inproc: the peer's queue holds the very buffers sent, until it reads or closes */
  void *r = sock_new(ctx, ZMQ_ROUTER); /* never reads */
  REQUIRE(zmq_bind(r, "inproc://pd-outbox-shutdown") == 0);
  void *d = sock_new(ctx, ZMQ_DEALER);
  REQUIRE(zmq_connect(d, "inproc://pd-outbox-shutdown") == 0);
  pd_outbox o;
  pd_outbox_init(&o, d, "n1");
  int pooled = 0, fallback = 0;
  for (int k = 0; k < MSGS; k++) {
    void *f = pd_framepool_get(pool);
    size_t len = k % 2 ? BUF : BUF / 3; /* a chunk's last frame is shorter */
    Pd__Envelope env;
    Pd__Heartbeat hb;
    heartbeat_env(&env, &hb);
    if (f) {
      memset(f, k, len);
      CHECK(pd_outbox_send_owned(&o, &env, &f, &len, 1, pd_framepool_release_cb, pool, &e) ==
            PD_OK);
      pooled++;
    } else { /* the pool is out (the peer does not read): malloc as before */
      f = calloc(1, len);
      REQUIRE(f);
      CHECK(pd_outbox_send(&o, &env, &f, &len, 1, &e) == PD_OK);
      fallback++;
    }
    pd_outbox_flush(&o);
  }
  CHECK(flush_all(&o)); /* all inside ZeroMQ now (the peer's HWM is far) */
  CHECK(pooled == BUFS && fallback == MSGS - BUFS);
  pd_framepool_stats s;
  pd_framepool_stats_get(pool, &s);
  CHECKF(s.n_bufs == BUFS && s.n_idle == 0, "bufs %zu idle %zu", s.n_bufs, s.n_idle);
  /* the node's shutdown order: sockets, context (joins ZeroMQ's threads), then the pool */
  pd_outbox_clear(&o);
  zmq_close(d);
  zmq_close(r);
  zmq_ctx_term(ctx);
  pd_framepool_stats_get(pool, &s);
  CHECKF(s.n_idle == s.n_bufs, "after zmq_ctx_term: %zu of %zu buffers back", s.n_idle,
         s.n_bufs);
  pd_framepool_free(pool);
  CHECK(atomic_load(&n_free) == atomic_load(&n_alloc) && atomic_load(&n_alloc) == BUFS);
  free(be);
}

int main(void) {
  test_sent();
  test_dropped();
  test_pool_shutdown();
  return pd_test_finish("test_node_outbox");
}

/* pd_crcpool (pd/crc32.h): one CRC-32 over several threads.
 *
 * Why: both nodes checksum every KV frame on their single loop thread (17 GB of KV in a serving
 * run: 1.4-2.5 s of each loop on the H200 host). pd_crc32 already runs at what one core can read
 * from memory (~10-15 GB/s), so the only way to go faster is to read with more cores.
 *
 * How: the concatenation of the call's buffers is cut into n parts of equal size (a multiple of
 * 64 bytes; the last takes the rest), n between 2 and 4 x threads with parts of at least
 * PD_CRCPOOL_MIN_BYTES / 2. The caller and the workers claim parts one at a time; part 0 is
 * chained from the incoming crc, the others start from 0, and the results are joined in order
 * with zlib's crc32_combine (CRC(A || B) = combine(CRC(A), CRC(B), |B|); the operator for the
 * common part length is computed once), so the result is bit for bit pd_crc32's.
 *
 * Why claimed parts rather than one part per thread: a woken worker may start late or, as on
 * a 2-vCPU VM where the scheduler puts it on the caller's own CPU, only when the caller stops
 * running (measured: it started 130-160 us after the call, on the caller's CPU, when the call
 * followed a sleep). With claims the caller just takes the parts nobody took, and waiting for a
 * part in flight yields the CPU, so a late worker costs little and an early one halves the time.
 *
 * Job protocol (as kernels/cpu/cpu_pool.c): one 64-bit atomic `ctr` holds (generation << 32 |
 * next part). The caller writes the parts, then under mu sets the job (buffers, n_parts), bumps
 * gen, publishes ctr = gen << 32 and broadcasts `go`. A worker reads gen and the job under mu
 * and claims parts with a CAS that also checks the generation: a successful CAS means job gen
 * still had an unclaimed part, so the caller has not returned from it, let alone set up the
 * next one; a worker that wakes late for a finished job finds another generation and goes back
 * to sleep without touching anything. Every finished part bumps n_done; the caller returns when
 * n_done == n_parts (polling, yielding the CPU, for up to CRCPOOL_WAIT_NS, then sleeping on
 * `done`), so no worker reads a buffer after the call. Workers sleep between calls (no
 * spinning: a node's cores have other work).
 *
 * Copy + CRC (pd_crcpool_copy_crc32v): the same parts, each also copied to dst + its offset in
 * the concatenation by pd_crc32_copy, which stores each block as the folding loads it: every
 * source byte is read once, and the copy's memory traffic overlaps the CRC's multiplies (one
 * core's CRC is compute-bound at ~14.5 GB/s on the 2-vCPU VM, hot or not, so copying pieces
 * and checksumming them from cache saved nothing there: 6.4 vs 6.2 GB/s). */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zlib.h>

#include "pd/crc32.h"

#define CRCPOOL_MAX_THREADS 256
#define CRCPOOL_MAX_PARTS 64 /* 4 x threads, at most */
/* How long the caller, out of parts to claim, polls for the ones in flight before it sleeps:
 * a part takes 20-200 us, and a wake-up of the caller costs tens of us on a VM. */
#define CRCPOOL_WAIT_NS 500000

typedef struct crc_part {
  int b;         /* first buffer */
  size_t off;    /* offset in it */
  size_t pos;    /* offset in the concatenation (where the part goes in dst) */
  size_t len;    /* bytes in all, possibly over several buffers */
  uint32_t crc;  /* in: the chaining value (part 0) or 0; out: the part's CRC */
} crc_part;

/* What a call asks of the threads (the pool's copy is guarded by mu). */
typedef struct crc_job {
  int n_parts;
  const void *const *bufs;
  const size_t *lens;
  unsigned char *dst; /* NULL: CRC only */
} crc_job;

struct pd_crcpool {
  int n_threads;       /* the caller's included */
  int n_started;       /* workers running */
  pthread_t *th;       /* [n_threads - 1] */
  crc_part parts[CRCPOOL_MAX_PARTS]; /* the current job's */
  _Atomic uint64_t ctr; /* gen << 32 | next part to claim */
  atomic_int n_done;    /* parts of the current job finished */
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  /* guarded by mu */
  uint32_t gen;        /* job counter */
  bool stop;
  bool caller_asleep;  /* the caller waits on `done` */
  crc_job job;
};

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* CRC of len bytes of the concatenation of bufs starting at (b, off), chained from crc; with
 * dst, the bytes are also copied to dst (in the same pass). */
static uint32_t part_crc(const void *const *bufs, const size_t *lens, int b, size_t off,
                         size_t len, uint32_t crc, unsigned char *dst) {
  while (len > 0) {
    size_t take = lens[b] - off;
    if (take > len) take = len;
    if (take && !dst) {
      crc = pd_crc32(crc, (const unsigned char *)bufs[b] + off, take);
    } else if (take) {
      crc = pd_crc32_copy(crc, dst, (const unsigned char *)bufs[b] + off, take);
      dst += take;
    }
    len -= take;
    b++;
    off = 0;
  }
  return crc;
}

/* Claims and computes parts of job gen until none is left. */
static void run_parts(pd_crcpool *p, uint32_t gen, const crc_job *j) {
  for (;;) {
    uint64_t c = atomic_load(&p->ctr);
    for (;;) {
      if ((uint32_t)(c >> 32) != gen || (int)(uint32_t)c >= j->n_parts) return;
      if (atomic_compare_exchange_weak(&p->ctr, &c, c + 1)) break;
    }
    crc_part *pt = &p->parts[(uint32_t)c];
    pt->crc = part_crc(j->bufs, j->lens, pt->b, pt->off, pt->len, pt->crc,
                       j->dst ? j->dst + pt->pos : NULL);
    if (atomic_fetch_add(&p->n_done, 1) + 1 == j->n_parts) {
      pthread_mutex_lock(&p->mu);
      if (p->caller_asleep) pthread_cond_signal(&p->done);
      pthread_mutex_unlock(&p->mu);
    }
  }
}

static void *worker_main(void *ud) {
  pd_crcpool *p = ud;
  uint32_t seen = 0; /* gen starts at 0: a job posted before this thread ran is not missed */
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (p->gen == seen && !p->stop) pthread_cond_wait(&p->go, &p->mu);
    if (p->stop) break;
    seen = p->gen;
    const crc_job j = p->job;
    pthread_mutex_unlock(&p->mu);
    run_parts(p, seen, &j);
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

pd_crcpool *pd_crcpool_new(int threads, pd_err *e) {
  if (threads > CRCPOOL_MAX_THREADS) {
    pd_err_set(e, PD_EINVAL, "CRC pool: %d threads (at most %d)", threads, CRCPOOL_MAX_THREADS);
    return NULL;
  }
  if (threads < 1) threads = 1;
  pd_crcpool *p = calloc(1, sizeof *p);
  if (p && threads > 1) p->th = calloc((size_t)threads - 1, sizeof *p->th);
  if (!p || (threads > 1 && !p->th)) {
    free(p);
    pd_err_set(e, PD_ENOMEM, "CRC pool: out of memory");
    return NULL;
  }
  p->n_threads = threads;
  atomic_init(&p->ctr, 0);
  atomic_init(&p->n_done, 0);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->go, NULL);
  pthread_cond_init(&p->done, NULL);
  /* the workers take no signals: SIGINT/SIGTERM go to the node's own threads */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  for (int i = 0; i < threads - 1; i++) {
    int rc = pthread_create(&p->th[i], NULL, worker_main, p);
    if (rc != 0) {
      pthread_sigmask(SIG_SETMASK, &old, NULL);
      pd_err_set(e, PD_EIO, "CRC pool: pthread_create: %s", strerror(rc));
      pd_crcpool_free(p);
      return NULL;
    }
    (void)pthread_setname_np(p->th[i], "pd-crc"); /* a name for top and gdb; best effort */
    p->n_started++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return p;
}

int pd_crcpool_threads(const pd_crcpool *p) { return p ? p->n_threads : 1; }

void pd_crcpool_free(pd_crcpool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_started; i++) pthread_join(p->th[i], NULL);
  pthread_cond_destroy(&p->done);
  pthread_cond_destroy(&p->go);
  pthread_mutex_destroy(&p->mu);
  free(p->th);
  free(p);
}

/* pd_crcpool_crc32v (dst NULL) and pd_crcpool_copy_crc32v. */
static uint32_t crcpool_run(pd_crcpool *p, uint32_t crc, unsigned char *dst,
                            const void *const *bufs, const size_t *lens, int n) {
  size_t total = 0;
  for (int i = 0; i < n; i++) total += lens[i];
  if (!p || p->n_threads <= 1 || total < PD_CRCPOOL_MIN_BYTES)
    return part_crc(bufs, lens, 0, 0, total, crc, dst);

  /* n_parts parts of `step` bytes (the last takes the rest) */
  size_t want = total / (PD_CRCPOOL_MIN_BYTES / 2); /* >= 2 */
  const size_t cap = (size_t)p->n_threads * 4 < CRCPOOL_MAX_PARTS ? (size_t)p->n_threads * 4
                                                                   : CRCPOOL_MAX_PARTS;
  const int n_parts = (int)(want < cap ? want : cap);
  const size_t step = (total / (size_t)n_parts) & ~(size_t)63;
  crc_part *pt = p->parts;
  int b = 0;
  size_t off = 0;
  for (int i = 0; i < n_parts; i++) {
    const bool last = i == n_parts - 1;
    pt[i] = (crc_part){.b = b, .off = off, .pos = step * (size_t)i,
                       .len = last ? total - step * (size_t)i : step, .crc = i == 0 ? crc : 0};
    for (size_t adv = last ? 0 : step; adv > 0;) { /* to where the next part starts */
      const size_t left = lens[b] - off;
      if (adv < left) {
        off += adv;
        adv = 0;
      } else {
        adv -= left;
        b++;
        off = 0;
      }
    }
  }

  const crc_job job = {.n_parts = n_parts, .bufs = bufs, .lens = lens, .dst = dst};
  pthread_mutex_lock(&p->mu);
  p->job = job;
  const uint32_t gen = ++p->gen;
  atomic_store(&p->n_done, 0);
  atomic_store(&p->ctr, (uint64_t)gen << 32);
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);

  run_parts(p, gen, &job);

  /* the parts in flight on workers: their stores to pt[i].crc (and to dst) precede their n_done
   * bumps */
  if (atomic_load(&p->n_done) < n_parts) {
    const int64_t t0 = now_ns();
    while (atomic_load(&p->n_done) < n_parts && now_ns() - t0 < CRCPOOL_WAIT_NS)
      sched_yield(); /* a worker put on this CPU gets to finish its part */
    pthread_mutex_lock(&p->mu);
    p->caller_asleep = true;
    while (atomic_load(&p->n_done) < n_parts) pthread_cond_wait(&p->done, &p->mu);
    p->caller_asleep = false;
    pthread_mutex_unlock(&p->mu);
  }

  uint32_t r = pt[0].crc;
  const uLong op = crc32_combine_gen((z_off_t)step);
  for (int i = 1; i < n_parts - 1; i++) r = (uint32_t)crc32_combine_op(r, pt[i].crc, op);
  return (uint32_t)crc32_combine(r, pt[n_parts - 1].crc, (z_off_t)pt[n_parts - 1].len);
}

uint32_t pd_crcpool_crc32v(pd_crcpool *p, uint32_t crc, const void *const *bufs,
                           const size_t *lens, int n) {
  return crcpool_run(p, crc, NULL, bufs, lens, n);
}

uint32_t pd_crcpool_copy_crc32v(pd_crcpool *p, uint32_t crc, void *dst, const void *const *bufs,
                                const size_t *lens, int n) {
  return crcpool_run(p, crc, dst, bufs, lens, n);
}

uint32_t pd_crcpool_crc32(pd_crcpool *p, uint32_t crc, const void *buf, size_t len) {
  const void *const bufs[1] = {buf};
  return pd_crcpool_crc32v(p, crc, bufs, &len, 1);
}

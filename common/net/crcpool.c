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
 * The parts run as the tasks of one job of a pd_pool (pd/pool.h, the CPU backend's thread pool),
 * created with no spin (its workers sleep between calls: a node's cores have other work). The
 * pool hands tasks out dynamically, which matters here: a woken worker may start late or, as on
 * a 2-vCPU VM where the scheduler puts it on the caller's own CPU, only when the caller stops
 * running (measured: 130-160 us after the call when the call followed a sleep), and the caller
 * then just takes the parts nobody took; pd_pool_run returns when every part is done, so no
 * worker touches a buffer after the call. */
#include <stdbool.h>
#include <stdlib.h>
#include <zlib.h>

#include "pd/crc32.h"
#include "pd/pool.h"

#define CRCPOOL_MAX_THREADS 256
#define CRCPOOL_MAX_PARTS 64 /* 4 x threads, at most */

typedef struct crc_part {
  int b;         /* first buffer */
  size_t off;    /* offset in it */
  size_t pos;    /* offset in the concatenation (and in dst) */
  size_t len;    /* bytes in all, possibly over several buffers */
  uint32_t crc;  /* in: the chaining value (part 0) or 0; out: the part's CRC */
} crc_part;

struct pd_crcpool {
  pd_pool *pool; /* NULL: one thread */
  /* the current call's (one caller at a time) */
  crc_part parts[CRCPOOL_MAX_PARTS];
  const void *const *bufs;
  const size_t *lens;
  unsigned char *dst; /* NULL: CRC only */
};

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

/* pd_pool task t: part t of the current call. */
static void part_task(void *ctx, int t, int thread) {
  (void)thread;
  pd_crcpool *p = ctx;
  crc_part *pt = &p->parts[t];
  pt->crc = part_crc(p->bufs, p->lens, pt->b, pt->off, pt->len, pt->crc,
                     p->dst ? p->dst + pt->pos : NULL);
}

pd_crcpool *pd_crcpool_new(int threads, pd_err *e) {
  if (threads > CRCPOOL_MAX_THREADS) {
    pd_err_set(e, PD_EINVAL, "CRC pool: %d threads (at most %d)", threads, CRCPOOL_MAX_THREADS);
    return NULL;
  }
  pd_crcpool *p = calloc(1, sizeof *p);
  if (!p) {
    pd_err_set(e, PD_ENOMEM, "CRC pool: out of memory");
    return NULL;
  }
  if (threads > 1 && !(p->pool = pd_pool_create_spin(threads, 0, e))) {
    free(p);
    return NULL;
  }
  return p;
}

int pd_crcpool_threads(const pd_crcpool *p) {
  return p && p->pool ? pd_pool_size(p->pool) : 1;
}

void pd_crcpool_free(pd_crcpool *p) {
  if (!p) return;
  pd_pool_destroy(p->pool);
  free(p);
}

/* pd_crcpool_crc32v (dst NULL) and pd_crcpool_copy_crc32v. */
static uint32_t crcpool_run(pd_crcpool *p, uint32_t crc, unsigned char *dst,
                            const void *const *bufs, const size_t *lens, int n) {
  size_t total = 0;
  for (int i = 0; i < n; i++) total += lens[i];
  if (!p || !p->pool || total < PD_CRCPOOL_MIN_BYTES)
    return part_crc(bufs, lens, 0, 0, total, crc, dst);

  /* n_parts parts of `step` bytes (the last takes the rest) */
  size_t want = total / (PD_CRCPOOL_MIN_BYTES / 2); /* >= 2 */
  const size_t threads = (size_t)pd_pool_size(p->pool);
  const size_t cap = threads * 4 < CRCPOOL_MAX_PARTS ? threads * 4 : CRCPOOL_MAX_PARTS;
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
  p->bufs = bufs;
  p->lens = lens;
  p->dst = dst;
  pd_pool_run(p->pool, part_task, p, n_parts);

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

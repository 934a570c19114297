/* pd_framepool: a bounded pool of equal-sized page-locked host buffers for outgoing KV frames.
 *
 * Why: a CUDA prefill node gathers each KV frame from device memory into host memory and hands
 * it to ZeroMQ. Into pageable memory that copy goes through the backend's pinned bounce chunks
 * plus a memcpy (H200: 423 us for a 3.75 MiB frame); into page-locked memory it is one DMA
 * (96 us). Page-locked memory is slow to allocate and to free (cudaFreeHost synchronizes the
 * device), so the buffers are kept and reused rather than freed per frame.
 *
 * Ownership: pd_framepool_get hands a buffer to the caller, which passes it to ZeroMQ with
 * pd_framepool_release_cb as the free function and the pool as its hint (pd_outbox_send_owned);
 * ZeroMQ's I/O thread (or whoever drops the message: pd_outbox_clear) gives it back. The pool
 * never frees a buffer before pd_framepool_free, and never calls be->ops.host_* outside the
 * owner's thread (get and free).
 *
 * Shutdown rule: pd_framepool_free must run after every frame has left ZeroMQ, i.e. after the
 * sockets were closed and zmq_ctx_term returned (pd_net_ctx_free: it joins ZeroMQ's threads,
 * which close every message they still held), and before the backend is freed (host_free needs
 * it). pd_node_close does it in that order. A caller that breaks the rule does not crash:
 * buffers still out are not freed (page-locked memory ZeroMQ may still read is never given
 * back), the pool logs a warning and lives on until the last of them is released; those
 * buffers are leaked (the backend may be gone by then).
 *
 * Threading: get, stats and free belong to one owner thread; release may be called from any
 * thread at any time before the pool's last buffer came back (a mutex). */
#ifndef PD_FRAMEPOOL_H
#define PD_FRAMEPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "pd/backend.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_framepool pd_framepool;

typedef struct pd_framepool_stats {
  size_t buf_bytes; /* size of every buffer */
  size_t max_bufs;  /* cap_bytes / buf_bytes (lowered to n_bufs when host_alloc fails) */
  size_t n_bufs;    /* buffers allocated with host_alloc and not freed */
  size_t n_idle;    /* of those, released and ready for get */
  uint64_t n_gets, n_misses; /* get calls; those that returned NULL */
} pd_framepool_stats;

/* A pool of buffers of buf_bytes (> 0) holding at most cap_bytes in all (floor(cap_bytes /
 * buf_bytes) buffers; 0 = every get misses). Buffers are allocated on demand by get. The
 * backend must outlive the pool; one without host_alloc/host_free gives a pool whose gets all
 * miss. NULL with e set (PD_ENOMEM, PD_EINVAL) on failure. */
pd_framepool *pd_framepool_new(pd_backend *be, size_t buf_bytes, size_t cap_bytes, pd_err *e);
/* A page-locked buffer of pd_framepool_buf_bytes(p) bytes: a released one, else a new one from
 * be->ops.host_alloc while under the cap. NULL (use malloc) when p is NULL, the backend has no
 * host_alloc, the cap is reached, or host_alloc failed (then the cap is lowered to what the
 * pool holds, so a refusing driver is not asked again per frame). */
void *pd_framepool_get(pd_framepool *p);
/* Gives buf (from pd_framepool_get of p) back. Thread-safe. */
void pd_framepool_release(pd_framepool *p, void *buf);
/* pd_framepool_release in ZeroMQ's free-function shape (zmq_free_fn): data = buffer,
 * hint = pool. */
void pd_framepool_release_cb(void *data, void *hint);
size_t pd_framepool_buf_bytes(const pd_framepool *p); /* 0 for NULL */
void pd_framepool_stats_get(pd_framepool *p, pd_framepool_stats *s);
/* Frees every buffer with host_free and the pool (see the shutdown rule above). NULL is a
 * no-op. */
void pd_framepool_free(pd_framepool *p);

#ifdef __cplusplus
}
#endif
#endif

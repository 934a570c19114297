/* CRC-32 (the zlib / IEEE 802.3 polynomial, bit-reflected) of the KV transfers' payloads.
 *
 * pd_crc32(crc, buf, len) returns what zlib's crc32(crc, buf, len) returns (start from 0, chain
 * by passing the previous result), computed by carry-less multiplication (PCLMULQDQ folding,
 * four 16-byte lanes) on x86-64 CPUs that have it, by zlib otherwise and for the last bytes.
 *
 * pd_crcpool spreads one long CRC over a few threads (common/net/crcpool.c): one core's CRC of
 * out-of-cache memory runs at that core's memory bandwidth (~10 GB/s), not at PCLMULQDQ's speed,
 * so more cores are what makes it faster. */
#ifndef PD_CRC32_H
#define PD_CRC32_H

#include <stddef.h>
#include <stdint.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

uint32_t pd_crc32(uint32_t crc, const void *buf, size_t len);
/* pd_crc32(crc, src, len), also copying src to dst (len bytes, not overlapping): one pass, each
 * 16-byte block stored to dst as the folding loads it (what does not fold, or every byte
 * without PCLMULQDQ: memcpy'd and checksummed in 16 KiB pieces). */
uint32_t pd_crc32_copy(uint32_t crc, void *dst, const void *src, size_t len);

/* Whether pd_crc32 takes the carry-less multiplication path on this CPU. */
int pd_crc32_accelerated(void);

/* ---- parallel CRC-32 ---- */

/* Inputs shorter than this (in all) stay on the caller's thread: waking a worker costs tens of
 * microseconds on a VM, what one core needs for a few hundred KiB (measured on a 2-vCPU VM, calls
 * back to back, 2 threads against 1: 21 vs 20 us at 256 KiB, 33 vs 37 us at 512 KiB, 54 vs 74 us
 * at 1 MiB). Longer ones are cut into 2..4 x threads parts of at least half of it. */
#define PD_CRCPOOL_MIN_BYTES ((size_t)512 << 10)

typedef struct pd_crcpool pd_crcpool;

/* A pool of threads - 1 persistent workers (the caller's thread is the threads-th); threads <= 1
 * gives a pool without workers (every call runs on the caller's thread). threads at most 256.
 * NULL with e set (PD_EINVAL, PD_ENOMEM, PD_EBACKEND when a thread cannot start) on failure. */
pd_crcpool *pd_crcpool_new(int threads, pd_err *e);
/* Threads a call may use, the caller's included (1 for a NULL pool). */
int pd_crcpool_threads(const pd_crcpool *p);
/* Exactly pd_crc32(crc, buf, len): the parts' CRCs are computed on the workers and the caller's
 * thread and combined in order (zlib's crc32_combine). p NULL: pd_crc32. One caller thread at a
 * time per pool; buf is only read, and no worker touches it after the call returns. */
uint32_t pd_crcpool_crc32(pd_crcpool *p, uint32_t crc, const void *buf, size_t len);
/* The CRC of the concatenation of bufs[0..n) (lens[i] bytes each; empty ones allowed, NULL with
 * length 0 too), chained from crc: what pd_crc32 called on each buffer in turn returns. The
 * parts are cut from the concatenation, so a message's frames are spread over every thread in
 * one call whatever their sizes. */
uint32_t pd_crcpool_crc32v(pd_crcpool *p, uint32_t crc, const void *const *bufs,
                           const size_t *lens, int n);
/* pd_crcpool_crc32v that also copies the concatenation of bufs[0..n) to dst (sum of lens bytes,
 * not overlapping any buffer; any alignment): the same parts over the same threads, each part
 * copied and checksummed in one pass over its source (pd_crc32_copy). Returns what
 * pd_crcpool_crc32v returns; dst is complete, and no worker touches dst or bufs, when it
 * returns. For a decode node's received KV message: one read of ZeroMQ's pageable frames into
 * page-locked memory instead of a CRC pass and a copy pass. 2-vCPU VM, 64 MiB out of cache, one
 * thread: 11-13 GB/s, against 6-7 GB/s for memcpy then pd_crc32. */
uint32_t pd_crcpool_copy_crc32v(pd_crcpool *p, uint32_t crc, void *dst, const void *const *bufs,
                                const size_t *lens, int n);
/* Stops and joins the workers. NULL is fine. Not while a call runs. */
void pd_crcpool_free(pd_crcpool *p);

#ifdef __cplusplus
}
#endif
#endif

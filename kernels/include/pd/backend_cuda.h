/* The CUDA backend: the ops table of backend.h on one NVIDIA GPU.
 *
 * Memory comes from cudaMalloc (never managed memory); every op is queued on the backend's own
 * stream and returns at once, except to_host, which returns when the bytes are on the host.
 * Activations stay float32; weights are read in their stored dtype (F32, F16, BF16); the KV
 * cache may be F32, F16 or BF16 (BF16 halves attention traffic and is the fast choice).
 *
 *   matmul     M <= 2: a GEMV kernel streaming W with 16-byte loads, f32 x and accumulation
 *              (gate/up fused with SwiGLU in one pass);
 *              larger M: x rounded to bf16/f16 into a backend-owned workspace, then cuBLAS
 *              (f32 output, f32 compute; TF32 for f32 weights), bias by a small kernel.
 *   attention  a batch of one new token per sequence: split-K decode (each sequence's context
 *              cut into equal splits, then a merge kernel), on tensor cores for bf16/f16 caches
 *              (all query heads of a KV group in one m16n8k16 tile, K/V tiles double-buffered
 *              with cp.async), SIMT for f32 caches; otherwise FlashAttention-style tiles on
 *              bf16 tensor cores (mma.sync, f32 accumulate), split over the context too when
 *              there are few tiles. Head dims 64, 80, 128 have tuned kernels; any other even
 *              head dim up to 256 runs on a slower generic kernel.
 *   also       sampling on the device (`sample`), KV staging for transfers (kv_gather /
 *              kv_scatter, pinned host_alloc), graph capture and replay, fused QKV RoPE + KV
 *              write and gate/up + SwiGLU (see backend.h).
 *
 * This header is always available. A build without CUDA provides the same symbols: the device
 * count is 0 and create fails with PD_EUNSUPPORTED. */
#ifndef PD_BACKEND_CUDA_H
#define PD_BACKEND_CUDA_H

#include "pd/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA devices this process can use; 0 when there is no driver, no device, or no CUDA in this
 * build. Never fails. */
int pd_cuda_device_count(void);

/* A backend on device o->device (device 0 when o is NULL). NULL with e set on failure:
 * PD_EUNSUPPORTED when this build has no CUDA backend, PD_EBACKEND when a CUDA call fails,
 * PD_EINVAL for a device ordinal out of range. Free with pd_backend_destroy. A backend is used by
 * one host thread at a time (any thread; the backend makes its device current for each op). */
pd_backend *pd_backend_cuda_create(const pd_backend_opts *o, pd_err *e);

/* The backend's cudaStream_t (as void *), so that other CUDA code can order its work with the
 * ops; NULL for a backend that is not CUDA. */
void *pd_backend_cuda_stream(pd_backend *be);

/* Ops have no status return. The first CUDA failure inside an op (a launch error, a fault seen at
 * sync) is kept; this returns it (PD_EBACKEND with the message) or PD_OK. The engine should treat
 * a failure as fatal for the backend. */
pd_status pd_backend_cuda_status(pd_backend *be, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif

/* The CUDA backend's state and the glue every op file shares: error recording (sticky, first
 * failure kept), the current-device cache, scratch growth. Included by cuda_backend.cu (the ops
 * table) and by the files that implement further ops (sampling, KV staging, graphs). C++ only. */
#ifndef PD_CUDA_STATE_H
#define PD_CUDA_STATE_H

#include <cublas_v2.h>

#include "cuda_internal.h"

/* Bytes of each of the two pinned staging buffers cuda_impl.pin (cuda_backend.cu allocates them
 * with its kPinnedChunk, which must equal this). */
#define PD_CUDA_PIN_BYTES ((size_t)8 << 20)
/* Partial sums one row of an RMSNorm hand-off may have (outputs up to 8 x this). */
#define PD_CUDA_HO_PARTS 8192

struct cuda_impl {
  int dev;
  int n_sm;
  int cc_major; /* compute capability */
  cudaStream_t st;
  cublasHandle_t blas;
  void *blas_ws;
  void *xconv; /* [M, K] bf16 or f16 copy of x for cuBLAS */
  size_t xconv_size;
  void *wdq; /* a quantized W dequantized to bf16 [N, K] for cuBLAS (M above the GEMV rows) */
  size_t wdq_size;
  float *xq; /* F8WA: x through FP8 quantize-dequantize [M, K] */
  size_t xq_size;
  float *qws; /* the quantized product's split-K partial sums [splits][M][N] */
  size_t qws_size;
  float *attn_ws; /* split partials: outputs then (max, sum) pairs */
  size_t attn_ws_size;
  int32_t *tiles;
  int tiles_cap;
  void *pin[2]; /* pinned staging, PD_CUDA_PIN_BYTES each (both NULL when unavailable); used
                 * only inside one op, which leaves no copy pending on them when it returns */
  cudaEvent_t pin_ev[2];
  bool capturing; /* a graph capture is open on st: nothing may sync or grow */
  /* graphs recorded on this backend and not yet freed, and the scratch buffers they may still
   * read: a buffer that grows while graphs exist is retired, not freed (a replay of an older
   * graph would read or write freed memory), and retired buffers are freed once no graph is
   * left (cu_graph_free, destroy) */
  int n_graphs;
  void **retired;
  int n_retired, cap_retired;
  /* device sampling (cuda_sample.cu) */
  void *smp_dev;   /* specs, edits, outputs, scratch on the device */
  size_t smp_dev_size;
  void *smp_host;  /* pinned mirror of specs, edits, outputs (mapped: small calls write there) */
  size_t smp_host_size;
  void *smp_greedy; /* the greedy fast path's per-row counters and chunk partials (zeroed) */
  float *acc_ws; /* the residual GEMM's partial products [splits][M][N] (cu_linear) */
  size_t acc_ws_size;
  float *xfin; /* f32 rows of an act whose norm is finished outside a GEMV */
  size_t xfin_size;
  /* KV staging (cuda_kvstage.cu) */
  void *stage_dev;
  size_t stage_dev_size;
  cudaStream_t st_kv; /* the staging's own stream (NULL until first used, or when unavailable) */
  cudaEvent_t kv_ev;  /* a gather's wait for the work queued on st before it */
  int kv_stream_state; /* 0 not tried, 1 st_kv in use, -1 staging runs on st */
  pd_status status; /* first failure, sticky */
  char msg[PD_ERR_MSG_MAX];
  /* a recoverable failure (no device memory for scratch), until take_error: the ops queued
   * after it do nothing */
  bool soft_failed;
  char soft_msg[PD_ERR_MSG_MAX];
};

inline cuda_impl *impl_of(pd_backend *be) { return static_cast<cuda_impl *>(be->impl); }

/* Records the first failure (and prints it); later ones are dropped. */
void pd_cuda_record(cuda_impl *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool pd_cuda_ck(cuda_impl *c, cudaError_t r, const char *what, const char *file, int line);
bool pd_cuda_ckb(cuda_impl *c, cublasStatus_t r, const char *what, const char *file, int line);
#define CK(c, call) pd_cuda_ck((c), (call), #call, __FILE__, __LINE__)
#define CKB(c, call) pd_cuda_ckb((c), (call), #call, __FILE__, __LINE__)
/* After kernel launches: a bad configuration shows up here, a fault only at the next sync. */
#define CK_LAUNCH(c, what) pd_cuda_ck((c), cudaGetLastError(), what, __FILE__, __LINE__)

/* Makes the backend's device current on this thread (cached per thread). */
void pd_cuda_use_device(cuda_impl *c);

/* Grows a device buffer to at least `bytes` (25% headroom), after a stream sync; throws
 * pd_cuda_scratch_oom (the message in c->soft_msg) when the device is out of memory. Must not run during a graph capture. in_graphs: recorded graphs may
 * hold the buffer's address (scratch of ops that decode graphs record): while any graph exists
 * the old buffer is retired instead of freed, and the new one is at least twice as large, so
 * that the retired ones add up to less than it. */
void pd_cuda_grow(cuda_impl *c, void **buf, size_t *size, size_t bytes, bool in_graphs);
/* Frees the retired scratch buffers (no graph may be left that reads them). */
void pd_cuda_free_retired(cuda_impl *c);

/* Ops implemented outside cuda_backend.cu, registered by pd_backend_cuda_create. */
void pd_cuda_register_sample(pd_backend *be);  /* cuda_sample.cu */
void pd_cuda_register_kvstage(pd_backend *be); /* cuda_kvstage.cu */
void pd_cuda_register_graph(pd_backend *be);   /* cuda_graph.cu */
/* --profile-gpu (pd_backend_opts.profile, cuda_profile.cu): wraps the ops of the first backend
 * created with it with GPU timers;
 * the report is printed (and the timers freed) by destroy. */
void pd_cuda_profile_wrap(pd_backend *be);
void pd_cuda_profile_report(pd_backend *be);
/* Frees what those files allocated in cuda_impl (called by destroy after a stream sync). */
void pd_cuda_free_extras(cuda_impl *c);

/* What pd_cuda_grow throws when the device has no memory for the scratch; the ops table's entry
 * points catch it (PD_CUDA_GUARD): the op and the ops after it until take_error do nothing, and
 * take_error reports PD_ENOMEM, so the engine fails the step and the node goes on. */
struct pd_cuda_scratch_oom {};

/* Marks the failure recoverable (the hand-offs between ops are dropped with it). */
void pd_cuda_soft_fail(cuda_impl *c);

/* An op entry point of type void (*)(pd_backend *, A...) wrapped: nothing after a recoverable
 * failure, and a scratch allocation that fails inside it becomes one. PD_CUDA_GUARD(f). */
template <typename T, T F> struct pd_cuda_guard;
template <typename... A, void (*F)(pd_backend *, A...)>
struct pd_cuda_guard<void (*)(pd_backend *, A...), F> {
  static void run(pd_backend *be, A... a) {
    cuda_impl *c = static_cast<cuda_impl *>(be->impl);
    if (c->soft_failed) return;
    try {
      F(be, a...);
    } catch (const pd_cuda_scratch_oom &) {
      pd_cuda_soft_fail(c);
    }
  }
};
#define PD_CUDA_GUARD(f) (pd_cuda_guard<decltype(&f), &f>::run)

/* The same for the KV staging ops, which have no step to fail: a staging buffer that cannot be
 * allocated is recorded as the backend's (sticky) failure, so that the node leaves the cluster
 * and its requests move, instead of pages silently missing. */
template <typename T, T F> struct pd_cuda_guard_sticky;
template <typename... A, void (*F)(pd_backend *, A...)>
struct pd_cuda_guard_sticky<void (*)(pd_backend *, A...), F> {
  static void run(pd_backend *be, A... a) {
    cuda_impl *c = static_cast<cuda_impl *>(be->impl);
    try {
      F(be, a...);
    } catch (const pd_cuda_scratch_oom &) {
      pd_cuda_record(c, "KV staging: %s", c->soft_msg);
    }
  }
};
#define PD_CUDA_GUARD_STICKY(f) (pd_cuda_guard_sticky<decltype(&f), &f>::run)

#endif

/* Internals of the CPU backend: the thread pool, the per-ISA kernel tables and the argument
 * blocks that the op glue (cpu_backend.c) hands to them. Not a public header.
 *
 * Layering:
 *   cpu_backend.c   the ops table: argument checks, work splitting, thread dispatch, caches
 *   cpu_pool.c      persistent worker threads with a spin-then-sleep dispatch
 *   cpu_simd.h      every compute kernel, written once over a small vector vocabulary
 *   cpu_avx512.c, cpu_avx2.c, cpu_generic.c
 *                   define that vocabulary for one ISA, include cpu_simd.h, export a table
 * The SIMD files are compiled with their own -m flags; only the table of the level chosen at
 * run time (CPUID) is ever called, so the library runs on any x86-64 (and elsewhere with the
 * generic table alone). */
#ifndef PD_CPU_INTERNAL_H
#define PD_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "pd/backend.h"
#include "pd/pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#define PD_CPU_X86 1
#else
#define PD_CPU_X86 0
#endif

/* ---- thread pool: pd/pool.h ---------------------------------------------------------- */

/* ---- argument blocks for the multi-part kernels ---------------------------------------- */

/* Attention over the paged cache for one layer, resolved to raw pointers. */
typedef struct pd_cpu_attn {
  float *out;               /* [n_tokens, n_q_heads, head_dim] */
  const float *q;           /* [n_tokens, n_q_heads, head_dim] */
  const void *k, *v;        /* [num_blocks, n_kv_heads, block_size, head_dim] in kv_dtype */
  pd_dtype kv_dtype;        /* F32, F16 or BF16 */
  int block_size, n_kv_heads, head_dim, n_q_heads;
  int group;                /* n_q_heads / n_kv_heads */
  float scale;
  int window;               /* > 0: sliding window, keys in (pos - window, pos] */
  const int32_t *q_start, *ctx_len, *block_tables;
  int max_blocks;
} pd_cpu_attn;

/* One unit of attention work: sequence s, KV head g, and the (new token, query head) pairs
 * [p0, p1) of that KV head's group, pair p = token * group + head (token 0 = the first new token of
 * s, head 0 = the first query head of KV head g). */
typedef struct pd_cpu_attn_tile {
  int s, g, p0, p1;
} pd_cpu_attn_tile;

/* ---- per-ISA kernel table ------------------------------------------------------------------
 * Every kernel works on a sub-range so the glue can split it across threads. Shapes follow
 * backend.h. "scratch" is per-thread memory of at least the size the matching *_scratch
 * function returns, 64-byte aligned. */
typedef struct pd_cpu_kern {
  const char *name; /* "avx512", "avx2", "generic" */
  int vl;           /* floats per vector */
  int mm_mr, mm_nr; /* GEMM register tile: mr rows of x by nr output features */
  int mm_kc;        /* GEMM depth block (panel floats = mm_nr * mm_kc) */
  int gemv_max_m;   /* x rows one GEMV pass carries */
  int at_tile;      /* attention: (token, head) pairs per tile */

  /* GEMV (few rows of x). prep writes into xp (M * K floats) the layout gemv expects for wdt
   * and returns xp, or returns x itself when no reordering is needed. */
  const float *(*gemv_prep)(float *xp, const float *x, pd_dtype wdt, int M, int K);
  /* y[m, n] for all m < M and n in [n0, n1). */
  void (*gemv)(float *y, const float *xp, const void *w, pd_dtype wdt, const float *bias, int M,
               int N, int K, int n0, int n1);
  /* GEMM on rows [m0, m1) and output panels [p0, p1) (panel p = features
   * [p*mm_nr, min(N, (p+1)*mm_nr))), panels in order (each prefetches the next one's W).
   * panel: mm_nr * mm_kc floats of scratch. */
  void (*gemm)(float *y, const float *x, const void *w, pd_dtype wdt, const float *bias, int M,
               int N, int K, int m0, int m1, int p0, int p1, float *panel);

  size_t (*attn_scratch)(int head_dim); /* bytes */
  void (*attn)(const pd_cpu_attn *a, const pd_cpu_attn_tile *t, void *scratch);

  /* Row kernels (one token). */
  void (*rmsnorm)(float *y, const float *x, const float *w, float eps, int D);
  void (*add_rmsnorm)(float *y, float *x, const float *r, const float *w, float eps, int D);
  void (*swiglu)(float *y, const float *gu, int F);
  /* x [n_heads, head_dim] rotated in place; cs = [cos(0..half-1), sin(0..half-1)]. */
  void (*rope)(float *x, int n_heads, int head_dim, const float *cs);
  void (*add)(float *y, const float *x, size_t n);
  /* dst[n] = src[n] converted from dt (F32, F16, BF16) */
  void (*to_f32)(float *dst, const void *src, pd_dtype dt, size_t n);
} pd_cpu_kern;

extern const pd_cpu_kern pd_cpu_kern_generic;
#if PD_CPU_X86
extern const pd_cpu_kern pd_cpu_kern_avx2;
extern const pd_cpu_kern pd_cpu_kern_avx512;
#endif

/* The pool and kernel table of a CPU backend (for the kernel benchmark). */
pd_pool *pd_backend_cpu_pool(pd_backend *be);
const pd_cpu_kern *pd_backend_cpu_kern(pd_backend *be);

#endif

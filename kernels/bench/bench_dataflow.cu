/* Whether a chain of dependent GEMVs can run without paying for its dependencies: the question
 * left by the batch-1 decode step (each of its GEMV kernels pays ~3.9 us beyond streaming its
 * weights, and a grid-wide barrier costs more than a kernel boundary: pd-bench-sync).
 *
 * P phases, each y_p = W_p y_{p-1} with W_p [N, N] bf16 (N = 4096: the o projection's shape;
 * distinct matrices, together far larger than L2), x = y_0 f32, run as:
 *   kernels   one GEMV kernel per phase (a warp per row, 4 chunks of 16 bytes in flight a lane,
 *             as the decode GEMV), replayed as one CUDA graph; x read by plain loads, through
 *             the read-only path as the decode GEMV reads it (a second graph), or copied per
 *             block into shared memory (a third);
 *   dataflow  one persistent kernel: every warp takes its rows of phase 1, then of phase 2, ...;
 *             a row of phase p needs all of y_{p-1}, which arrives in S slices of N / S values,
 *             each counted done by the blocks that wrote it (an arrival counter per phase and
 *             slice). A warp requests its row's weights first and waits for each slice of its
 *             input only when its dot product reaches that slice, so no warp waits for the
 *             slowest block of the phase before, only for the slice it needs next;
 *   dataflow (whole phase, x through L1)  the wait of the decode chain kernel tried in session
 *             10: a block waits once for the whole phase before (one acquire), then reads x
 *             from global memory by plain loads.
 * All give the same y_P (checked); the figure is microseconds per phase. On the H200
 * (session 10), 4096 x 4096: kernels 12.5 us a phase with x by plain loads, 10.6 through the
 * read-only path, 11.3 from shared memory; dataflow 15.5 (S = 16), 23.2 (64), 13.5 (4), 10.8
 * (S = 1: one counter per phase, weights in flight across the wait); whole phase with x
 * through L1 13.6. 8192 x 8192: 41.6 / 39.9 / 39.3, dataflow (S = 1) 34.0, through L1 45.1.
 * So against kernels that read x as the decode GEMV does, waiting in one kernel gains nothing
 * at 4096 x 4096 and ~15% at 8192 x 8192, and only with x in shared memory: coherent loads of
 * x (what data written in the same kernel needs, the read-only path being off limits) cost
 * ~3 us a phase. (A first version read x per warp through L2: 28 / 52 us, L2-bound.)
 *
 *   pd-bench-dataflow [P (16)] [N (4096)] [S (16)] */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

#include "bench_check.h"

constexpr int kWarps = 8, kThreads = kWarps * 32, kU = 4;

__device__ __forceinline__ void fma8(const uint4 &w, const float4 &a, const float4 &b, float &acc) {
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&w);
  float2 f;
  f = __bfloat1622float2(h[0]); acc = fmaf(f.x, a.x, fmaf(f.y, a.y, acc));
  f = __bfloat1622float2(h[1]); acc = fmaf(f.x, a.z, fmaf(f.y, a.w, acc));
  f = __bfloat1622float2(h[2]); acc = fmaf(f.x, b.x, fmaf(f.y, b.y, acc));
  f = __bfloat1622float2(h[3]); acc = fmaf(f.x, b.z, fmaf(f.y, b.w, acc));
}

/* y[n] = W[n, :] . x for one row n, a warp: lane l takes the 16-byte chunks l, l + 32, ...
 * (8 weights each), kU of them in flight, all requested before any is used. wait(c0): called
 * between the loads and the use of the chunks from c0 on; returns where x's elements for them
 * are (x itself, or the block's copy in shared memory, made once the slices they need have
 * arrived); NC: x read through the read-only path. */
template <bool NC = false, typename Wait>
__device__ __forceinline__ float row_dot(const uint4 *w, int n_chunks, int lane, Wait wait) {
  float acc = 0.0f;
  for (int c0 = 0; c0 < n_chunks; c0 += 32 * kU) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) v[u] = __ldcs(w + c0 + u * 32 + lane);
    const float *x = wait(c0);
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const float4 *xp = reinterpret_cast<const float4 *>(x + (size_t)(c0 + u * 32 + lane) * 8);
      if (NC)
        fma8(v[u], __ldg(xp), __ldg(xp + 1), acc);
      else
        fma8(v[u], xp[0], xp[1], acc);
    }
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

/* NC: x through the read-only path (__ldg), as the decode GEMV reads it; else plain loads */
template <bool NC>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const __nv_bfloat16 *w, const float *x,
                                                        float *y, int N) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n = blockIdx.x * kWarps + warp;
  if (n >= N) return;
  const float d = row_dot<NC>(reinterpret_cast<const uint4 *>(w + (size_t)n * N), N / 8, lane,
                              [&](int) { return x; });
  if (lane == 0) y[n] = d;
}

/* The kernels with x copied into shared memory by each block (after its warps requested their
 * first weights) instead of read through the read-only path by every warp. */
__global__ void __launch_bounds__(kThreads) gemv_smem_kernel(const __nv_bfloat16 *w, const float *x,
                                                             float *y, int N) {
  extern __shared__ float4 xs4[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n = blockIdx.x * kWarps + warp;
  bool staged = false;
  const float d = row_dot(reinterpret_cast<const uint4 *>(w + (size_t)(n < N ? n : 0) * N), N / 8,
                          lane, [&](int) -> const float * {
                            if (!staged) {
                              const float4 *src = reinterpret_cast<const float4 *>(x);
                              for (int i = threadIdx.x; i < N / 4; i += kThreads)
                                xs4[i] = __ldg(src + i);
                              __syncthreads();
                              staged = true;
                            }
                            return reinterpret_cast<const float *>(xs4);
                          });
  if (lane == 0 && n < N) y[n] = d;
}

/* Row n of a phase (w: the phase's weights) written to y, then, once all the block's warps have
 * written, counted on its slice's arrival counter (cnt_p: the phase's S counters). */
template <typename Wait>
__device__ __forceinline__ void row_arrive(const __nv_bfloat16 *w, float *y, unsigned *cnt_p,
                                           int N, int n, int slice_len, int lane, Wait wait) {
  const float d = row_dot(reinterpret_cast<const uint4 *>(w + (size_t)n * N), N / 8, lane, wait);
  if (lane == 0) y[n] = d;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(cnt_p + n / slice_len, 1u);
  }
}

/* ys: [P + 1][N] (ys[0] = x); cnt: [P + 1][S] arrival counters, cnt[0][*] preset to done.
 * A slice is N / S outputs = (N / S) / kWarps blocks' rows; each block adds 1 to its slice's
 * counter once all its warps have written (rows of a block stay within one slice). x is read by
 * every row, so a block copies the slices of x it has reached into shared memory (N floats of
 * dynamic shared memory), through L2 (other SMs wrote it; L1 is not coherent), one copy for its
 * 8 warps: read per warp, x would be 2 bytes of L2 traffic per weight byte. All warps of a block
 * walk K in step, so the copy is block-wide (__syncthreads). */
__global__ void __launch_bounds__(kThreads) dataflow_kernel(const __nv_bfloat16 *w, float *ys,
                                                            unsigned *cnt, int N, int P, int S) {
  extern __shared__ float4 xs4[];
  float *xs = reinterpret_cast<float *>(xs4);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slice_len = N / S, need = slice_len / kWarps; /* blocks per slice */
  const int nblk = N / kWarps; /* blocks' worth of rows per phase */
  for (int p = 1; p <= P; p++) {
    const float *x = ys + (size_t)(p - 1) * N;
    float *y = ys + (size_t)p * N;
    volatile unsigned *in_cnt = cnt + (size_t)(p - 1) * S;
    int staged = 0; /* slices of x copied into xs, this phase */
    for (int b = blockIdx.x; b < nblk; b += gridDim.x) {
      const int n = b * kWarps + warp;
      auto wait = [&](int c0) -> const float * {
        /* chunks [c0, c0 + 32 kU) cover x[8 c0, 8 (c0 + 32 kU)) */
        const int last = min(S - 1, ((c0 + 32 * kU) * 8 - 1) / slice_len);
        if (staged <= last) {
          if (threadIdx.x == 0)
            for (int s = staged; s <= last; s++)
              while (in_cnt[s] < (unsigned)need) {
              }
          __syncthreads();
          __threadfence();
          const float4 *src = reinterpret_cast<const float4 *>(x);
          for (int i = staged * slice_len / 4 + threadIdx.x; i < (last + 1) * slice_len / 4;
               i += kThreads)
            xs4[i] = __ldcg(src + i);
          __syncthreads();
          staged = last + 1;
        }
        return xs;
      };
      row_arrive(w + (size_t)(p - 1) * N * N, y, cnt + (size_t)p * S, N, n, slice_len, lane, wait);
    }
    __syncthreads(); /* xs is refilled for the next phase */
  }
}

/* The same chain with the wait the decode chain kernel of session 10 used: the whole phase before
 * (every slice counter), thread 0 polling with relaxed loads and acquiring once, a block
 * barrier, then x read from global memory with plain loads (through L1, made coherent by the
 * acquire) instead of a shared-memory copy. */
__device__ __forceinline__ unsigned ld_relaxed(const unsigned *p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void __launch_bounds__(kThreads) dataflow_l1_kernel(const __nv_bfloat16 *w, float *ys,
                                                               unsigned *cnt, int N, int P, int S) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slice_len = N / S, need = slice_len / kWarps;
  const int nblk = N / kWarps;
  for (int p = 1; p <= P; p++) {
    const float *x = ys + (size_t)(p - 1) * N;
    float *y = ys + (size_t)p * N;
    const unsigned *in_cnt = cnt + (size_t)(p - 1) * S;
    bool waited = false;
    for (int b = blockIdx.x; b < nblk; b += gridDim.x) {
      const int n = b * kWarps + warp;
      auto wait = [&](int) -> const float * {
        if (!waited) {
          if (threadIdx.x == 0)
            for (int s2 = 0; s2 < S; s2++) {
              while (ld_relaxed(in_cnt + s2) < (unsigned)need) __nanosleep(32);
              (void)ld_acquire(in_cnt + s2);
            }
          __syncthreads();
          waited = true;
        }
        return x;
      };
      row_arrive(w + (size_t)(p - 1) * N * N, y, cnt + (size_t)p * S, N, n, slice_len, lane, wait);
    }
  }
}

int main(int argc, char **argv) {
  const int P = argc > 1 ? atoi(argv[1]) : 16;
  const int N = argc > 2 ? atoi(argv[2]) : 4096;
  const int S = argc > 3 ? atoi(argv[3]) : 16;
  if (P < 1 || S < 1 || N < 1 || N % (S * kWarps * 8) != 0 || N % (32 * kU * 8) != 0) {
    fprintf(stderr, "need P >= 1, S >= 1, N a multiple of both S * %d and %d\n", kWarps * 8,
            32 * kU * 8);
    return 2;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const size_t wn = (size_t)P * N * N;
  std::vector<__nv_bfloat16> hw(wn);
  unsigned seed = 1;
  for (size_t i = 0; i < wn; i++) {
    seed = seed * 1664525u + 1013904223u;
    hw[i] = __float2bfloat16(((seed >> 9) / 8388608.0f - 0.5f) * 2.0f / sqrtf((float)N));
  }
  std::vector<float> hx(N);
  for (int i = 0; i < N; i++) hx[i] = sinf(0.1f * i);
  __nv_bfloat16 *w;
  float *ys_k, *ys_d, *ys_l;
  unsigned *cnt;
  CK(cudaMalloc(&w, wn * 2));
  CK(cudaMemcpy(w, hw.data(), wn * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&ys_k, (size_t)(P + 1) * N * 4));
  CK(cudaMalloc(&ys_d, (size_t)(P + 1) * N * 4));
  CK(cudaMalloc(&ys_l, (size_t)(P + 1) * N * 4));
  CK(cudaMemcpy(ys_l, hx.data(), (size_t)N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ys_k, hx.data(), (size_t)N * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ys_d, hx.data(), (size_t)N * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&cnt, (size_t)(P + 1) * S * 4));
  std::vector<unsigned> hc((size_t)(P + 1) * S, 0);
  for (int s = 0; s < S; s++) hc[s] = (unsigned)(N / S / kWarps);
  unsigned *cnt0; /* the counters' starting values, copied over cnt before each run */
  CK(cudaMalloc(&cnt0, hc.size() * 4));
  CK(cudaMemcpy(cnt0, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int per_sm = 0;
  const size_t smem = (size_t)N * 4;
  if (smem > 48 * 1024)
    CK(cudaFuncSetAttribute(dataflow_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)smem));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dataflow_kernel, kThreads, smem));
  const int grid_d = prop.multiProcessorCount * per_sm; /* every block resident: they spin */
  int per_sm_l = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_l, dataflow_l1_kernel, kThreads, 0));
  const int grid_l = prop.multiProcessorCount * (per_sm_l < 4 ? per_sm_l : 4);
  /* the kernels, as one graph each way of reading x: plain loads, the read-only path, shared
   * memory */
  if (smem > 48 * 1024)
    CK(cudaFuncSetAttribute(gemv_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)smem));
  cudaGraph_t g[3];
  cudaGraphExec_t gx[3];
  for (int nc = 0; nc < 3; nc++) {
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    for (int p = 1; p <= P; p++) {
      const __nv_bfloat16 *wp = w + (size_t)(p - 1) * N * N;
      const float *xp = ys_k + (size_t)(p - 1) * N;
      float *yp = ys_k + (size_t)p * N;
      if (nc == 2)
        gemv_smem_kernel<<<N / kWarps, kThreads, smem, st>>>(wp, xp, yp, N);
      else if (nc)
        gemv_kernel<true><<<N / kWarps, kThreads, 0, st>>>(wp, xp, yp, N);
      else
        gemv_kernel<false><<<N / kWarps, kThreads, 0, st>>>(wp, xp, yp, N);
    }
    CK(cudaStreamEndCapture(st, &g[nc]));
    CK(cudaGraphInstantiateWithFlags(&gx[nc], g[nc], 0));
    CK(cudaGraphUpload(gx[nc], st));
  }
  auto best_of = [&](auto run) { /* us per phase */
    return pd_bench_best_ms(st, 2, 10, run) * 1e3 / P;
  };
  const double tk = best_of([&] { CK(cudaGraphLaunch(gx[0], st)); });
  const double tk_nc = best_of([&] { CK(cudaGraphLaunch(gx[1], st)); });
  const double tk_sm = best_of([&] { CK(cudaGraphLaunch(gx[2], st)); });
  const double tl_with_reset = best_of([&] {
    CK(cudaMemcpyAsync(cnt, cnt0, hc.size() * 4, cudaMemcpyDeviceToDevice, st));
    dataflow_l1_kernel<<<grid_l, kThreads, 0, st>>>(w, ys_l, cnt, N, P, S);
  });
  /* the counters are reset by a device copy before each run, timed alone and subtracted */
  const double td_with_reset = best_of([&] {
    CK(cudaMemcpyAsync(cnt, cnt0, hc.size() * 4, cudaMemcpyDeviceToDevice, st));
    dataflow_kernel<<<grid_d, kThreads, smem, st>>>(w, ys_d, cnt, N, P, S);
  });
  const double reset = best_of([&] {
    CK(cudaMemcpyAsync(cnt, cnt0, hc.size() * 4, cudaMemcpyDeviceToDevice, st));
  });
  CK(cudaStreamSynchronize(st));
  /* y_P of each kernels graph (run again, one after the other) against both dataflows' */
  std::vector<float> yk(N), yd(N), yl(N);
  CK(cudaMemcpy(yd.data(), ys_d + (size_t)P * N, (size_t)N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(yl.data(), ys_l + (size_t)P * N, (size_t)N * 4, cudaMemcpyDeviceToHost));
  double maxd = 0, maxv = 0;
  for (int nc = 0; nc < 3; nc++) {
    CK(cudaMemsetAsync(ys_k + N, 0, (size_t)P * N * 4, st));
    CK(cudaGraphLaunch(gx[nc], st));
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(yk.data(), ys_k + (size_t)P * N, (size_t)N * 4, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; i++) {
      maxd = fmax(maxd, fmax(fabs((double)yk[i] - yd[i]), fabs((double)yk[i] - yl[i])));
      maxv = fmax(maxv, fabs((double)yk[i]));
    }
  }
  const double bytes = (double)N * N * 2;
  printf("%s: %d phases of %d x %d bf16 (%.1f MB each), dataflow grid %d x %d, %d slices\n",
         prop.name, P, N, N, bytes / 1e6, grid_d, kThreads, S);
  printf("kernels   %8.2f us a phase  %7.1f GB/s  (x by plain loads)\n", tk, bytes / tk / 1e3);
  printf("kernels   %8.2f us a phase  %7.1f GB/s  (x through the read-only path)\n", tk_nc,
         bytes / tk_nc / 1e3);
  printf("kernels   %8.2f us a phase  %7.1f GB/s  (x copied per block into shared memory)\n",
         tk_sm, bytes / tk_sm / 1e3);
  printf("dataflow  %8.2f us a phase  %7.1f GB/s  (counter reset %.2f us a phase, subtracted)\n",
         td_with_reset - reset, bytes / (td_with_reset - reset) / 1e3, reset);
  printf("dataflow  %8.2f us a phase  %7.1f GB/s  (whole phase, one acquire a block, x through "
         "L1; grid %d)\n",
         tl_with_reset - reset, bytes / (tl_with_reset - reset) / 1e3, grid_l);
  printf("y_P: max |kernels - dataflows| %.3g of max |y| %.3g: %s\n", maxd, maxv,
         maxd <= 1e-5 * fmax(1.0, maxv) ? "same" : "DIFFERENT");
  return maxd <= 1e-5 * fmax(1.0, maxv) ? 0 : 1;
}

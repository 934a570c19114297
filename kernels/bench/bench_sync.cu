/* What a dependency between two memory-bound phases costs on the GPU, in isolation: the
 * question behind the batch-1 decode step, whose GEMV kernels each pay ~3.9 us beyond streaming
 * their weights (docs/benchmarks.md). NCH chunks of CHUNK bytes each (together far larger than
 * L2) are read, one warp per 8 KB row with 16-byte loads (the decode GEMV's access pattern),
 * as:
 *   kernels    one kernel per chunk, NCH kernels replayed as one CUDA graph;
 *   persistent one kernel, all chunks back to back, no synchronisation;
 *   grid sync  one cooperative kernel, a grid-wide barrier (cooperative groups) after each chunk;
 *   flag sync  the same with a hand-made barrier (arrival counter and generation word);
 *   empty      NCH empty kernels of the same grid as one graph (the launch and drain alone).
 * Prints microseconds per chunk and the rate; the differences are the costs of a kernel
 * boundary and of a barrier.
 *
 *   pd-bench-sync [CHUNK_MB (32)] [NCH (16)] */
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_check.h"

namespace cg = cooperative_groups;

constexpr int kRowBytes = 8192, kThreads = 256, kU = 4;

/* Reads rows [0, rows) of a chunk, a warp per row (grid-stride), 4 loads in flight a lane; the
 * xor of everything goes to sink so the loads are not dropped. */
__device__ __forceinline__ unsigned read_rows(const uint4 *chunk, int rows, int gw, int nw,
                                              int lane) {
  unsigned acc = 0;
  for (int r = gw; r < rows; r += nw) {
    const uint4 *row = chunk + (size_t)r * (kRowBytes / 16);
    for (int c0 = lane; c0 < kRowBytes / 16; c0 += 32 * kU) {
      uint4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; u++) v[u] = __ldcs(row + c0 + u * 32);
#pragma unroll
      for (int u = 0; u < kU; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  return acc;
}

__global__ void one_chunk(const uint4 *chunk, int rows, unsigned *sink) {
  const int lane = threadIdx.x & 31;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = gridDim.x * blockDim.x >> 5;
  const unsigned a = read_rows(chunk, rows, gw, nw, lane);
  if (a == 0x12345678u) *sink = a;
}

__global__ void empty_kernel(unsigned *sink) {
  if (threadIdx.x == 1023) *sink = 0; /* never: blocks are 256 threads */
}

/* mode 0: no sync, 1: cooperative groups grid.sync(), 2: arrival counter + generation word */
__global__ void all_chunks(const uint4 *base, int rows, int nch, int mode, unsigned *bar,
                           unsigned *sink) {
  const int lane = threadIdx.x & 31;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = gridDim.x * blockDim.x >> 5;
  unsigned a = 0;
  for (int i = 0; i < nch; i++) {
    a ^= read_rows(base + (size_t)i * rows * (kRowBytes / 16), rows, gw, nw, lane);
    if (mode == 1) {
      cg::this_grid().sync();
    } else if (mode == 2) {
      __syncthreads();
      if (threadIdx.x == 0) {
        volatile unsigned *gen = bar + 1;
        const unsigned g = *gen;
        __threadfence();
        if (atomicAdd(bar, 1) == gridDim.x - 1) {
          bar[0] = 0;
          __threadfence();
          atomicAdd(bar + 1, 1);
        } else {
          while (*gen == g) {
          }
        }
        __threadfence();
      }
      __syncthreads();
    }
  }
  if (a == 0x12345678u) *sink = a;
}

int main(int argc, char **argv) {
  const double chunk_mb = argc > 1 ? atof(argv[1]) : 32;
  const int nch = argc > 2 ? atoi(argv[2]) : 16;
  const int rows = (int)(chunk_mb * 1048576 / kRowBytes);
  const size_t chunk = (size_t)rows * kRowBytes, total = chunk * nch;
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  uint4 *buf;
  unsigned *sink, *bar;
  CK(cudaMalloc(&buf, total));
  CK(cudaMemset(buf, 1, total));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMalloc(&bar, 8));
  CK(cudaMemset(bar, 0, 8));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, all_chunks, kThreads, 0));
  const int grid = p.multiProcessorCount * (per_sm < 8 ? per_sm : 8);
  const int grid_k = (rows * 32 + kThreads - 1) / kThreads; /* a warp per row, like the GEMV */
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  printf("%s, %d SMs; %d chunks of %.1f MB (%d rows of 8 KB), %.0f MB in all; persistent grid "
         "%d x %d, per-chunk kernels %d x %d\n",
         p.name, p.multiProcessorCount, nch, chunk / 1048576.0, rows, total / 1048576.0, grid,
         kThreads, grid_k, kThreads);
  auto graph_of = [&](bool empty) {
    cudaGraph_t g;
    cudaGraphExec_t x;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    for (int i = 0; i < nch; i++) {
      if (empty)
        empty_kernel<<<grid_k, kThreads, 0, st>>>(sink);
      else
        one_chunk<<<grid_k, kThreads, 0, st>>>(buf + (size_t)i * rows * (kRowBytes / 16), rows,
                                                 sink);
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiateWithFlags(&x, g, 0));
    CK(cudaGraphUpload(x, st));
    cudaGraphDestroy(g);
    return x;
  };
  auto time_of = [&](auto run) { /* us per chunk */
    return pd_bench_best_ms(st, 1, 10, run) * 1e3 / nch;
  };
  auto report = [&](const char *what, double us) {
    printf("%-12s %8.2f us a chunk  %8.1f GB/s\n", what, us, chunk / us / 1e3);
  };
  cudaGraphExec_t gk = graph_of(false), ge = graph_of(true);
  report("kernels", time_of([&] { CK(cudaGraphLaunch(gk, st)); }));
  for (int mode = 0; mode < 3; mode++) {
    auto run = [&] {
      const uint4 *b = buf;
      int r = rows, n = nch, m = mode;
      void *args[] = {&b, &r, &n, &m, &bar, &sink};
      if (mode == 1)
        CK(cudaLaunchCooperativeKernel((void *)all_chunks, grid, kThreads, args, 0, st));
      else
        all_chunks<<<grid, kThreads, 0, st>>>(b, r, n, m, bar, sink);
    };
    report(mode == 0 ? "persistent" : mode == 1 ? "grid sync" : "flag sync", time_of(run));
  }
  const double empty = time_of([&] { CK(cudaGraphLaunch(ge, st)); });
  printf("%-12s %8.2f us a kernel\n", "empty", empty);
  return 0;
}

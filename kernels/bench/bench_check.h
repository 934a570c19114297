/* Helpers of the standalone GPU benchmark programs (pd-bench-cuda, -sync, -dataflow): a checked
 * CUDA call that exits with the file, line and call on failure, and the best time of repeated
 * runs on a stream. */
#ifndef PD_BENCH_CHECK_H
#define PD_BENCH_CHECK_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t r_ = (x);                                                                  \
    if (r_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(r_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

/* The shortest of reps runs of run() on st after `warm` untimed ones, in milliseconds (CUDA
 * events around each run). */
template <typename F> float pd_bench_best_ms(cudaStream_t st, int warm, int reps, F run) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < warm; i++) run();
  CK(cudaStreamSynchronize(st));
  float best = 1e30f;
  for (int i = 0; i < reps; i++) {
    CK(cudaEventRecord(e0, st));
    run();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (ms < best) best = ms;
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return best;
}

#endif

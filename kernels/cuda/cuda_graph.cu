/* Graphs: the engine records a decode step once per batch shape and replays it, so that a step
 * costs one launch instead of hundreds (CUDA graphs, stream capture in relaxed mode: cuBLAS and
 * our kernels are capturable; nothing may sync, allocate or grow scratch while capturing, which
 * pd_cuda_grow asserts). A graph holds the addresses of the scratch its ops used: scratch that
 * grows later (a larger batch's first, eager run) keeps its old buffer until every graph is
 * freed (pd_cuda_grow, c->n_graphs). */
#include "cuda_state.h"

namespace {

bool cu_capture_begin(pd_backend *be) {
  cuda_impl *c = impl_of(be);
  if (c->status != PD_OK || c->capturing || c->soft_failed) return false;
  pd_cuda_use_device(c);
  if (cudaStreamBeginCapture(c->st, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  c->capturing = true;
  return true;
}

void *cu_capture_end(pd_backend *be) {
  cuda_impl *c = impl_of(be);
  if (!c->capturing) return NULL;
  pd_cuda_use_device(c);
  c->capturing = false;
  cudaGraph_t g = NULL;
  cudaError_t r = cudaStreamEndCapture(c->st, &g);
  if (r != cudaSuccess || !g) {
    /* A failed capture is not fatal: the caller runs the ops eagerly instead. */
    fprintf(stderr, "pdserve cuda backend: graph capture failed: %s\n", cudaGetErrorString(r));
    cudaGetLastError();
    if (g) cudaGraphDestroy(g);
    return NULL;
  }
  cudaGraphExec_t x = NULL;
  r = cudaGraphInstantiateWithFlags(&x, g, 0);
  /* uploaded now rather than by its first launch, which would otherwise take a step's worth of
   * extra host time: on the H200 the mean host time in cudaGraphLaunch over a run's ~120
   * replays went 26.7 -> 5.0 us (a 356-node batch-32 step), 7.9 -> 4.1 us (batch 1) */
  if (r == cudaSuccess) r = cudaGraphUpload(x, c->st);
  cudaGraphDestroy(g);
  if (r != cudaSuccess) {
    fprintf(stderr, "pdserve cuda backend: graph instantiation failed: %s\n",
            cudaGetErrorString(r));
    cudaGetLastError();
    if (x) cudaGraphExecDestroy(x);
    return NULL;
  }
  c->n_graphs++; /* its scratch addresses stay valid until it is freed (pd_cuda_grow) */
  return x;
}

bool cu_graph_launch(pd_backend *be, void *graph) {
  cuda_impl *c = impl_of(be);
  if (!graph) return false;
  pd_cuda_use_device(c);
  return CK(c, cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), c->st));
}

void cu_graph_free(pd_backend *be, void *graph) {
  if (!graph) return;
  cuda_impl *c = impl_of(be);
  pd_cuda_use_device(c);
  cudaStreamSynchronize(c->st);
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph));
  if (c->n_graphs > 0 && --c->n_graphs == 0) pd_cuda_free_retired(c);
}

} // namespace

void pd_cuda_register_graph(pd_backend *be) {
  be->ops.capture_begin = cu_capture_begin;
  be->ops.capture_end = cu_capture_end;
  be->ops.graph_launch = cu_graph_launch;
  be->ops.graph_free = cu_graph_free;
}

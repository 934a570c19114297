/* The CUDA backend's entry points in a build without CUDA: no device, and creating a backend
 * fails with PD_EUNSUPPORTED. With CUDA these symbols come from kernels/cuda/cuda_backend.cu and
 * this file compiles to nothing, so callers never need #ifdef PD_HAVE_CUDA. */
#include "pd/backend_cuda.h"

#ifndef PD_HAVE_CUDA

int pd_cuda_device_count(void) { return 0; }

pd_backend *pd_backend_cuda_create(const pd_backend_opts *o, pd_err *e) {
  (void)o;
  pd_err_set(e, PD_EUNSUPPORTED, "this build has no CUDA backend");
  return NULL;
}

void *pd_backend_cuda_stream(pd_backend *be) {
  (void)be;
  return NULL;
}

pd_status pd_backend_cuda_status(pd_backend *be, pd_err *e) {
  (void)be;
  return pd_err_set(e, PD_EUNSUPPORTED, "this build has no CUDA backend");
}

#else
/* ISO C forbids an empty translation unit. */
typedef int pd_backend_select_cuda_built;
#endif

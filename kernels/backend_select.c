/* Choosing a backend by device name (pd_backend_open), and the CUDA backend's entry points in a
 * build without CUDA: no device, and creating a backend fails with PD_EUNSUPPORTED. With CUDA
 * those symbols come from kernels/cuda/cuda_backend.cu, so callers never need #ifdef
 * PD_HAVE_CUDA. */
#include <stdlib.h>
#include <string.h>

#include "pd/backend_cuda.h"

pd_backend *pd_backend_open(const char *device, const pd_backend_opts *o, bool *is_gpu,
                            pd_err *e) {
  pd_backend_opts bo = o ? *o : (pd_backend_opts){0};
  bool gpu = false;
  if (device && strncmp(device, "cuda", 4) == 0) {
    gpu = true;
    bo.device = 0;
    if (device[4] == ':') {
      char *end;
      long d = strtol(device + 5, &end, 10);
      if (*end || end == device + 5 || d < 0 || d > 1024) {
        pd_err_set(e, PD_EINVAL, "--device '%s': expected cuda:N", device);
        return NULL;
      }
      bo.device = (int)d;
    } else if (device[4]) {
      pd_err_set(e, PD_EINVAL, "--device '%s': expected cpu or cuda[:N]", device);
      return NULL;
    }
  } else if (device && strcmp(device, "cpu") != 0) {
    pd_err_set(e, PD_EINVAL, "--device '%s': expected cpu or cuda[:N]", device);
    return NULL;
  }
  if (is_gpu) *is_gpu = gpu;
  return gpu ? pd_backend_cuda_create(&bo, e) : pd_backend_cpu_create(&bo, e);
}

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

#endif

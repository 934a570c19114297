/* pdctl devices: what this build can compute on here: the CPU backend's kernel family and the
 * number of CUDA devices (0 in a build without CUDA or on a machine without a GPU). Scripts use
 * `pdctl devices --json` to decide whether GPU tests can run. */
#include <stdbool.h>
#include <stdio.h>

#include "pd/backend_cuda.h"
#include "pd/opts.h"
#include "pdctl.h"

int cmd_devices(int argc, char **argv) {
  bool json = false, help = false;
  pd_opt opts[] = {
      {"json", PD_OPT_BOOL, &json, NULL, "print {\"cpu_isa\", \"cuda_devices\"}", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl devices [--json]\n", stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  pd_backend_opts bo = {.n_threads = 1};
  pd_backend *cpu = pd_backend_cpu_create(&bo, &e);
  if (!cpu) return pdctl_fail("cpu backend: %s", e.msg);
  const char *isa = pd_backend_cpu_isa(cpu);
  int n = pd_cuda_device_count();
  if (json)
    printf("{\"cpu_isa\":\"%s\",\"cuda_devices\":%d}\n", isa, n);
  else
    printf("cpu       %s kernels\ncuda      %d device%s%s\n", isa, n, n == 1 ? "" : "s",
           n ? " (--device cuda:0 .. cuda:N-1)" : "");
  pd_backend_destroy(cpu);
  return 0;
}

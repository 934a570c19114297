/* Placeholder until the op lands: registers nothing. */
#include "cuda_state.h"
void pd_cuda_register_kvstage(pd_backend *be) { (void)be; }

/* Placeholder: registers nothing yet. */
#include "cuda_state.h"
void pd_cuda_register_graph(pd_backend *be) { (void)be; }

/* Fuzz target (d, part 2): a checkpoint's config.json (common/model/config.c): architecture,
 * dimensions, heads, RoPE scaling (default, linear, llama3), sliding windows, token ids, dtype.
 *
 * Input: the bytes of config.json.
 * Properties: nothing crashes or leaks; a refusal says why; an accepted config keeps its
 * promises (positive dimensions, heads a multiple of the KV heads, an even head_dim, at most
 * PD_MAX_EOS end tokens) and its RoPE inverse frequencies (pd_rope_inv_freq, what the engine
 * computes next) are finite and positive. */
#include <math.h>
#include <stdlib.h>

#include "fuzz.h"
#include "pd/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  pd_model_config c;
  pd_err e = {0};
  if (pd_model_config_parse((const char *)data, size, &c, &e) != PD_OK) {
    FUZZ_CHECK(e.code != PD_OK && e.msg[0]);
    return 0;
  }
  FUZZ_CHECK(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0);
  FUZZ_CHECK(c.num_layers > 0 && c.num_heads > 0 && c.num_kv_heads > 0);
  FUZZ_CHECK(c.num_heads % c.num_kv_heads == 0);
  FUZZ_CHECK(c.head_dim >= 2 && c.head_dim % 2 == 0);
  FUZZ_CHECK(c.max_position_embeddings > 0 && c.rms_norm_eps > 0);
  FUZZ_CHECK(c.n_eos >= 0 && c.n_eos <= PD_MAX_EOS);
  FUZZ_CHECK(c.sliding_window >= 0);
  FUZZ_CHECK(pd_dtype_size(c.dtype) > 0);
  float *inv = malloc((size_t)(c.head_dim / 2) * sizeof *inv);
  FUZZ_CHECK(inv);
  pd_rope_inv_freq(&c, inv);
  for (int i = 0; i < c.head_dim / 2; i++) {
    if (!(isfinite(inv[i]) && inv[i] > 0))
      fprintf(stderr, "inv_freq[%d] = %g (theta %g, type %d, factor %g)\n", i, inv[i],
              c.rope.theta, (int)c.rope.type, c.rope.factor);
    FUZZ_CHECK(isfinite(inv[i]) && inv[i] > 0);
  }
  free(inv);
  return 0;
}

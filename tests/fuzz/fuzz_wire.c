/* Fuzz target (c): protobuf envelopes as a peer sends them, cluster and client messages alike:
 * pd_wire_decode (frame size, capped protobuf-c unpack, version, body case, NUL bytes in
 * strings) and pd_wire_validate with the validator of every body, then the conversions a
 * receiver applies to a valid message (sampling parameters, KV payload frame sizes).
 *
 * Input: [limits: defaults (resources unknown), a node's (vocabulary, blocks, KV geometry), or
 * tight caps] envelope bytes...
 * Properties: nothing crashes or leaks; a refused message leaves nothing decoded and says why;
 * a message that decodes validates again, re-encodes, decodes again from its re-encoding and
 * encodes to the same bytes (validation is a function of the values, not of their encoding);
 * its sampling parameters convert; its KV frame sizes check against themselves and not against
 * a frame off by one. */
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pd/wire.h"

static void limits(int preset, pd_wire_limits *l) {
  pd_wire_limits_init(l);
  if (preset == 0) return;
  /* a node's: tests/unit/test_net_wire.c's limits_node */
  l->vocab_size = 4096;
  l->total_blocks = 512;
  l->draft_total_blocks = 256;
  l->block_size = 16;
  l->num_layers = 6;
  l->draft_num_layers = 2;
  l->num_kv_heads = 2;
  l->draft_num_kv_heads = 1;
  l->head_dim = 64;
  l->draft_head_dim = 64;
  l->kv_dtype = PD_DTYPE_F32;
  if (preset == 2) { /* tight caps: every limit within reach of a small input */
    l->max_frame_bytes = 2048;
    l->max_alloc_bytes = 8192;
    l->max_payload_frames = 4;
    l->max_payload_frame_bytes = 4096;
    l->max_name_bytes = 8;
    l->max_message_bytes = 16;
    l->max_text_bytes = 32;
    l->max_context = 64;
    l->max_stop = 2;
    l->max_stop_token_ids = 2;
    l->max_logit_bias = 2;
    l->max_messages = 2;
    l->max_n = 2;
    l->max_tokens_per_msg = 4;
  }
}

static uint8_t *encode(const Pd__Envelope *env, size_t *len) {
  size_t n = pd_wire_encoded_size(env);
  uint8_t *buf = malloc(n ? n : 1);
  FUZZ_CHECK(buf);
  pd_err e = {0};
  FUZZ_CHECK(pd_wire_encode(env, buf, n, len, &e) == PD_OK && *len == n);
  return buf;
}

static void check_sampling(const Pd__SamplingParams *sp) {
  if (!sp) return;
  pd_logit_bias *bias = calloc(sp->n_logit_bias ? sp->n_logit_bias : 1, sizeof *bias);
  FUZZ_CHECK(bias);
  pd_sampling_params p;
  pd_err e = {0};
  FUZZ_CHECK(pd_wire_sampling_params(sp, &p, bias, sp->n_logit_bias ? sp->n_logit_bias : 1, &e) ==
             PD_OK);
  free(bias);
}

static void check_kv_frames(const Pd__KvTransferHeader *h) {
  size_t n = h->n_frame_bytes;
  size_t *sizes = malloc((n ? n : 1) * sizeof *sizes);
  FUZZ_CHECK(sizes);
  for (size_t i = 0; i < n; i++) sizes[i] = (size_t)h->frame_bytes[i];
  pd_err e = {0};
  FUZZ_CHECK(pd_wire_validate_kv_frames(h, (int)n, sizes, &e) == PD_OK);
  FUZZ_CHECK(pd_wire_validate_kv_frames(h, (int)n + 1, sizes, &e) != PD_OK);
  if (n) {
    sizes[n - 1]++;
    FUZZ_CHECK(pd_wire_validate_kv_frames(h, (int)n, sizes, &e) != PD_OK);
  }
  free(sizes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_in in = {data, size};
  pd_wire_limits l;
  limits(fuzz_byte(&in) % 3, &l);
  pd_wire_msg m, m2;
  pd_wire_msg_init(&m);
  pd_wire_msg_init(&m2);
  pd_err e = {0};
  pd_status st = pd_wire_decode(&m, in.n ? in.p : data, in.n, &l, &e);
  if (st != PD_OK) {
    FUZZ_CHECK(!m.env);
    FUZZ_CHECK(st == PD_EFORMAT || st == PD_ERANGE || st == PD_EINVAL || st == PD_EUNSUPPORTED);
    FUZZ_CHECK(e.msg[0]);
    (void)pd_wire_error_code(st);
    return 0;
  }
  const Pd__Envelope *env = m.env;
  FUZZ_CHECK(env && env->version == PD_PROTOCOL_VERSION);
  FUZZ_CHECK(strcmp(pd_wire_body_name(env->body_case), "none") &&
             strcmp(pd_wire_body_name(env->body_case), "unknown"));
  FUZZ_CHECK(pd_wire_validate(env, &l, &e) == PD_OK);

  size_t n1 = 0, n2 = 0;
  uint8_t *b1 = encode(env, &n1);
  if (n1 <= l.max_frame_bytes) {
    st = pd_wire_decode(&m2, b1, n1, &l, &e);
    if (st != PD_OK) fprintf(stderr, "re-decoding a valid message: %s\n", e.msg);
    FUZZ_CHECK(st == PD_OK);
    uint8_t *b2 = encode(m2.env, &n2);
    FUZZ_CHECK(n1 == n2 && !memcmp(b1, b2, n1));
    free(b2);
  }
  free(b1);

  switch (env->body_case) {
    case PD__ENVELOPE__BODY_GENERATE: check_sampling(env->generate->sampling); break;
    case PD__ENVELOPE__BODY_RESERVE: check_sampling(env->reserve->sampling); break;
    case PD__ENVELOPE__BODY_KV_HEADER: check_kv_frames(env->kv_header); break;
    default: break;
  }
  pd_wire_msg_clear(&m2);
  pd_wire_msg_clear(&m);
  return 0;
}

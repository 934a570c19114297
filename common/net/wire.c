/* Envelope decoding with a capped allocator, encoding, limits and conversions (pd/wire.h).
 * Validation of the bodies is in validate.c. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "pd/wire.h"

void pd_wire_limits_init(pd_wire_limits *l) {
  memset(l, 0, sizeof *l);
  l->max_frame_bytes = (size_t)4 << 20;
  l->max_payload_frame_bytes = (size_t)64 << 20;
  l->max_payload_frames = 256;
  l->max_alloc_bytes = (size_t)64 << 20;
  l->max_name_bytes = 256;
  l->max_message_bytes = 4096;
  l->max_text_bytes = (size_t)4 << 20;
  l->max_context = 1u << 20;
  l->max_stop = 16;
  l->max_stop_token_ids = 1024;
  l->max_logit_bias = 1024;
  l->max_messages = 4096;
  l->max_n = PD_SAMPLE_MAX_N;
  l->max_tokens_per_msg = 65536;
  l->kv_dtype = -1;
}

/* ---- capped allocator ----
 * Every block carries a header with its size so that frees give the budget back; the header is
 * max_align_t-sized to keep protobuf-c's structures aligned. */

typedef union alloc_hdr {
  size_t size;
  max_align_t align_;
} alloc_hdr;

static void *capped_alloc(void *data, size_t size) {
  pd_wire_msg *m = data;
  if (size > SIZE_MAX - sizeof(alloc_hdr)) return NULL;
  size_t total = size + sizeof(alloc_hdr);
  if (total > m->budget_ || m->used_ > m->budget_ - total) return NULL;
  alloc_hdr *h = malloc(total);
  if (!h) return NULL;
  h->size = total;
  m->used_ += total;
  return h + 1;
}

static void capped_free(void *data, void *p) {
  if (!p) return;
  pd_wire_msg *m = data;
  alloc_hdr *h = (alloc_hdr *)p - 1;
  m->used_ -= h->size <= m->used_ ? h->size : m->used_;
  free(h);
}

void pd_wire_msg_init(pd_wire_msg *m) { memset(m, 0, sizeof *m); }

void pd_wire_msg_clear(pd_wire_msg *m) {
  if (m->env) {
    /* The allocator's data pointer is m itself: set it again in case m was moved. */
    m->alloc_.alloc = capped_alloc;
    m->alloc_.free = capped_free;
    m->alloc_.allocator_data = m;
    pd__envelope__free_unpacked(m->env, &m->alloc_);
    m->env = NULL;
  }
  m->used_ = 0;
  m->budget_ = 0;
}

static bool get_varint(const uint8_t *b, size_t n, size_t *i, uint64_t *v) {
  *v = 0;
  for (int shift = 0; shift < 64 && *i < n; shift += 7) {
    uint8_t c = b[(*i)++];
    *v |= (uint64_t)(c & 0x7f) << shift;
    if (!(c & 0x80)) return true;
  }
  return false;
}

#define FIELD_NUMBER_0 "#0" /* nul_in_strings' answer for a field number 0 */

/* The name of a string field of the encoded message b[0, n) of type d (at any depth) that holds
 * a NUL byte, or NULL. protobuf-c hands strings over as C strings, so such a string would end
 * at its NUL without a word (a prompt cut short, as a raw NUL in JSON once did over HTTP); the
 * JSON API refuses U+0000 the same way. Encodings the unpacker refused never get here.
 * FIELD_NUMBER_0 for a field numbered 0, which protobuf forbids: protobuf-c refuses its key in
 * one byte but keeps one written in more (0x85 0x00) as an unknown field, which it packs again
 * in one byte, so the message would not decode again (found by tests/fuzz/fuzz_wire.c). */
static const char *nul_in_strings(const ProtobufCMessageDescriptor *d, const uint8_t *b, size_t n,
                                  int depth) {
  size_t i = 0;
  while (i < n) {
    uint64_t key, v;
    if (!get_varint(b, n, &i, &key)) return NULL;
    if (key >> 3 == 0) return FIELD_NUMBER_0;
    switch (key & 7) {
      case 0:
        if (!get_varint(b, n, &i, &v)) return NULL;
        break;
      case 1: i += 8; break;
      case 5: i += 4; break;
      case 2: {
        if (!get_varint(b, n, &i, &v) || v > n - i) return NULL;
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
        if (f && f->type == PROTOBUF_C_TYPE_STRING && memchr(b + i, 0, (size_t)v)) return f->name;
        if (f && f->type == PROTOBUF_C_TYPE_MESSAGE && depth < 16) {
          const char *name = nul_in_strings(f->descriptor, b + i, (size_t)v, depth + 1);
          if (name) return name;
        }
        i += (size_t)v;
        break;
      }
      default: return NULL;
    }
  }
  return NULL;
}

pd_status pd_wire_decode(pd_wire_msg *m, const void *buf, size_t len, const pd_wire_limits *l,
                         pd_err *e) {
  pd_wire_msg_clear(m);
  if (len == 0) return pd_err_set(e, PD_EFORMAT, "empty message");
  if (!buf) return pd_err_set(e, PD_EINVAL, "decode: NULL buffer");
  if (len > l->max_frame_bytes)
    return pd_err_set(e, PD_ERANGE, "message of %zu bytes exceeds the limit of %zu bytes", len,
                      l->max_frame_bytes);
  m->alloc_.alloc = capped_alloc;
  m->alloc_.free = capped_free;
  m->alloc_.allocator_data = m;
  m->used_ = 0;
  m->budget_ = l->max_alloc_bytes;
  m->env = pd__envelope__unpack(&m->alloc_, len, buf);
  if (!m->env) {
    m->used_ = 0; /* protobuf-c freed its partial allocations through capped_free */
    return pd_err_set(e, PD_EFORMAT,
                      "undecodable message (%zu bytes): not a pd.Envelope, or it expands past "
                      "%zu bytes",
                      len, l->max_alloc_bytes);
  }
  const char *nul = nul_in_strings(&pd__envelope__descriptor, buf, len, 0);
  if (nul) {
    pd_wire_msg_clear(m);
    if (!strcmp(nul, FIELD_NUMBER_0))
      return pd_err_set(e, PD_EFORMAT, "undecodable message: a field numbered 0");
    return pd_err_set(e, PD_EINVAL, "the string field %s holds a NUL byte", nul);
  }
  pd_status st = pd_wire_validate(m->env, l, e);
  if (st != PD_OK) pd_wire_msg_clear(m);
  return st;
}

void pd_wire_envelope_init(Pd__Envelope *env) {
  pd__envelope__init(env);
  env->version = PD_PROTOCOL_VERSION;
}

size_t pd_wire_encoded_size(const Pd__Envelope *env) { return pd__envelope__get_packed_size(env); }

pd_status pd_wire_encode(const Pd__Envelope *env, void *buf, size_t cap, size_t *len, pd_err *e) {
  if (!env) return pd_err_set(e, PD_EINVAL, "encode: no envelope");
  if (env->version != PD_PROTOCOL_VERSION)
    return pd_err_set(e, PD_EINVAL, "encode: envelope version %u, expected %d (use "
                      "pd_wire_envelope_init)", env->version, PD_PROTOCOL_VERSION);
  if (env->body_case == PD__ENVELOPE__BODY__NOT_SET)
    return pd_err_set(e, PD_EINVAL, "encode: envelope has no body");
  size_t need = pd__envelope__get_packed_size(env);
  if (need > cap)
    return pd_err_set(e, PD_ERANGE, "encode: %zu bytes needed, buffer has %zu", need, cap);
  size_t n = pd__envelope__pack(env, buf);
  PD_ASSERT(n == need);
  if (len) *len = n;
  return PD_OK;
}

/* ---- conversions ---- */

pd_status pd_wire_sampling_params(const Pd__SamplingParams *m, pd_sampling_params *p,
                                  pd_logit_bias *bias, size_t cap, pd_err *e) {
  pd_sampling_params_init(p);
  if (!m) return PD_OK;
  if (m->n_logit_bias > cap)
    return pd_err_set(e, PD_ERANGE, "logit_bias has %zu entries, room for %zu", m->n_logit_bias,
                      cap);
  if (m->max_tokens > INT32_MAX || m->min_tokens > INT32_MAX || m->n > INT32_MAX ||
      m->top_logprobs > INT32_MAX || m->prompt_top_logprobs > INT32_MAX)
    return pd_err_set(e, PD_ERANGE, "sampling parameter out of int32 range");
  if (m->temperature_opt_case == PD__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE)
    p->temperature = m->temperature;
  if (m->top_p != 0.0f) p->top_p = m->top_p;
  p->top_k = m->top_k;
  p->min_p = m->min_p;
  if (m->seed_opt_case == PD__SAMPLING_PARAMS__SEED_OPT_SEED) {
    p->has_seed = true;
    p->seed = m->seed;
  }
  p->max_tokens = m->max_tokens ? (int32_t)m->max_tokens : -1;
  p->min_tokens = (int32_t)m->min_tokens;
  p->stop_token_ids = m->stop_token_ids;
  p->n_stop_token_ids = m->n_stop_token_ids;
  p->n = m->n ? (int32_t)m->n : 1;
  p->logprobs = m->logprobs ? (int32_t)m->top_logprobs : -1;
  p->prompt_logprobs = m->prompt_logprobs ? (int32_t)m->prompt_top_logprobs : -1;
  p->presence_penalty = m->presence_penalty;
  p->frequency_penalty = m->frequency_penalty;
  if (m->repetition_penalty != 0.0f) p->repetition_penalty = m->repetition_penalty;
  for (size_t i = 0; i < m->n_logit_bias; i++) {
    if (!m->logit_bias[i]) return pd_err_set(e, PD_EFORMAT, "logit_bias entry %zu missing", i);
    bias[i].id = m->logit_bias[i]->key;
    bias[i].bias = m->logit_bias[i]->value;
  }
  p->logit_bias = m->n_logit_bias ? bias : NULL;
  p->n_logit_bias = m->n_logit_bias;
  p->ignore_eos = m->ignore_eos;
  return PD_OK;
}

int pd_wire_dtype_to_pd(Pd__KvDtype d) {
  switch (d) {
    case PD__KV_DTYPE__KV_DTYPE_F32: return PD_DTYPE_F32;
    case PD__KV_DTYPE__KV_DTYPE_F16: return PD_DTYPE_F16;
    case PD__KV_DTYPE__KV_DTYPE_BF16: return PD_DTYPE_BF16;
    case PD__KV_DTYPE__KV_DTYPE_F8_E4M3: return PD_DTYPE_F8_E4M3;
    case PD__KV_DTYPE__KV_DTYPE_F8_E5M2: return PD_DTYPE_F8_E5M2;
    default: return -1;
  }
}

Pd__KvDtype pd_wire_dtype_from_pd(pd_dtype t) {
  switch (t) {
    case PD_DTYPE_F32: return PD__KV_DTYPE__KV_DTYPE_F32;
    case PD_DTYPE_F16: return PD__KV_DTYPE__KV_DTYPE_F16;
    case PD_DTYPE_BF16: return PD__KV_DTYPE__KV_DTYPE_BF16;
    case PD_DTYPE_F8_E4M3: return PD__KV_DTYPE__KV_DTYPE_F8_E4M3;
    case PD_DTYPE_F8_E5M2: return PD__KV_DTYPE__KV_DTYPE_F8_E5M2;
    default: return PD__KV_DTYPE__KV_DTYPE_UNSPECIFIED;
  }
}

Pd__ErrorCode pd_wire_error_code(pd_status s) {
  switch (s) {
    case PD_OK: return PD__ERROR_CODE__ERROR_CODE_UNSPECIFIED;
    case PD_EINVAL:
    case PD_ERANGE: return PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST;
    case PD_EFORMAT: return PD__ERROR_CODE__ERROR_CODE_PROTOCOL;
    case PD_EUNSUPPORTED: return PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED;
    case PD_ENOTFOUND: return PD__ERROR_CODE__ERROR_CODE_NOT_FOUND;
    case PD_EFULL: return PD__ERROR_CODE__ERROR_CODE_OVERLOADED;
    default: return PD__ERROR_CODE__ERROR_CODE_INTERNAL;
  }
}

/* ---- unguessable ids ---- */

pd_status pd_wire_random(void *buf, size_t n, pd_err *e) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return pd_err_set(e, PD_EIO, "getrandom: %s", strerror(errno));
    }
    p += got;
    n -= (size_t)got;
  }
  return PD_OK;
}

pd_status pd_wire_random_hex(char out[2 * PD_WIRE_TOKEN_BYTES + 1], pd_err *e) {
  uint8_t b[PD_WIRE_TOKEN_BYTES];
  pd_status st = pd_wire_random(b, sizeof b, e);
  if (st) return st;
  static const char hx[] = "0123456789abcdef";
  for (size_t i = 0; i < sizeof b; i++) {
    out[2 * i] = hx[b[i] >> 4];
    out[2 * i + 1] = hx[b[i] & 15];
  }
  out[2 * sizeof b] = 0;
  return PD_OK;
}

bool pd_wire_token_eq(ProtobufCBinaryData a, const uint8_t b[PD_WIRE_TOKEN_BYTES]) {
  if (a.len != PD_WIRE_TOKEN_BYTES || !a.data) return false;
  uint8_t diff = 0;
  for (size_t i = 0; i < PD_WIRE_TOKEN_BYTES; i++) diff |= (uint8_t)(a.data[i] ^ b[i]);
  return diff == 0;
}

const char *pd_wire_body_name(Pd__Envelope__BodyCase c) {
  switch (c) {
    case PD__ENVELOPE__BODY__NOT_SET: return "none";
    case PD__ENVELOPE__BODY_GENERATE: return "generate";
    case PD__ENVELOPE__BODY_CANCEL: return "cancel";
    case PD__ENVELOPE__BODY_CHUNK: return "chunk";
    case PD__ENVELOPE__BODY_REGISTER_NODE: return "register_node";
    case PD__ENVELOPE__BODY_REGISTER_ACK: return "register_ack";
    case PD__ENVELOPE__BODY_HEARTBEAT: return "heartbeat";
    case PD__ENVELOPE__BODY_HEARTBEAT_ACK: return "heartbeat_ack";
    case PD__ENVELOPE__BODY_DEREGISTER: return "deregister";
    case PD__ENVELOPE__BODY_RESERVE: return "reserve";
    case PD__ENVELOPE__BODY_RESERVE_REPLY: return "reserve_reply";
    case PD__ENVELOPE__BODY_PREFILL: return "prefill";
    case PD__ENVELOPE__BODY_FIRST_TOKEN: return "first_token";
    case PD__ENVELOPE__BODY_KV_HEADER: return "kv_header";
    case PD__ENVELOPE__BODY_KV_DONE: return "kv_done";
    case PD__ENVELOPE__BODY_KV_ACK: return "kv_ack";
    case PD__ENVELOPE__BODY_TOKEN_STREAM: return "token_stream";
    case PD__ENVELOPE__BODY_ABORT: return "abort";
    case PD__ENVELOPE__BODY_ERROR: return "error";
    default: return "unknown";
  }
}

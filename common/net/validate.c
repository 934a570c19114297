/* Validation of every message body against pd_wire_limits (pd/wire.h): ids, counts, lengths,
 * ranges, enum values, cross-field consistency. Each check names the field in its message.
 *
 * protobuf-c gives proto3 enums as plain ints (any value on the wire), strings as NUL-terminated
 * copies (an embedded NUL just ends the string early), repeated messages as arrays of non-NULL
 * pointers and sub-messages as possibly NULL pointers; validators also accept hand-built
 * messages, so they treat NULL strings as empty and NULL array entries as errors. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "pd/dtype.h"
#include "pd/wire.h"

#define MAX_LAYERS 4096
#define MAX_DIM 65536 /* heads, head_dim, block_size */
#define MAX_TP 1024
#define MAX_CHUNKS (1u << 20)

/* ---- primitives ---- */

bool pd_wire_id_ok(const char *s) {
  if (!s || !*s) return false;
  size_t n = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++, n++) {
    if (n >= PD_WIRE_ID_MAX_BYTES) return false;
    unsigned char c = *p;
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == ':' || c == '/' || c == '@' || c == '+' || c == '-';
    if (!ok) return false;
  }
  return true;
}

static pd_status v_id(const char *what, const char *s, bool required, pd_err *e) {
  if (!s || !*s)
    return required ? pd_err_set(e, PD_EINVAL, "%s is required", what) : PD_OK;
  if (!pd_wire_id_ok(s))
    return pd_err_set(e, PD_EINVAL, "%s is not a valid id (1..%d bytes of [A-Za-z0-9._:/@+-])",
                      what, PD_WIRE_ID_MAX_BYTES);
  return PD_OK;
}

static bool utf8_ok(const char *s, size_t n) {
  const utf8proc_uint8_t *p = (const utf8proc_uint8_t *)s;
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      i++;
      continue;
    }
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate(p + i, (utf8proc_ssize_t)(n - i), &cp);
    if (k <= 0 || cp < 0) return false;
    i += (size_t)k;
  }
  return true;
}

/* A bounded UTF-8 string; *len (may be NULL) receives its length. */
static pd_status v_str(const char *what, const char *s, size_t max, bool required, size_t *len,
                       pd_err *e) {
  size_t n = s ? strnlen(s, max + 1) : 0;
  if (len) *len = n;
  if (n == 0)
    return required ? pd_err_set(e, PD_EINVAL, "%s is required", what) : PD_OK;
  if (n > max) return pd_err_set(e, PD_ERANGE, "%s is longer than %zu bytes", what, max);
  if (!utf8_ok(s, n)) return pd_err_set(e, PD_EINVAL, "%s is not valid UTF-8", what);
  return PD_OK;
}

/* A ZeroMQ endpoint we would connect to: tcp://, ipc:// or inproc://, printable ASCII. */
static pd_status v_endpoint(const char *what, const char *s, size_t max, bool required,
                            pd_err *e) {
  size_t n = s ? strnlen(s, max + 1) : 0;
  if (n == 0) return required ? pd_err_set(e, PD_EINVAL, "%s is required", what) : PD_OK;
  if (n > max) return pd_err_set(e, PD_ERANGE, "%s is longer than %zu bytes", what, max);
  for (size_t i = 0; i < n; i++)
    if (s[i] <= ' ' || s[i] > '~')
      return pd_err_set(e, PD_EINVAL, "%s contains a non-printable or space character", what);
  if (strncmp(s, "tcp://", 6) && strncmp(s, "ipc://", 6) && strncmp(s, "inproc://", 9))
    return pd_err_set(e, PD_EINVAL, "%s must be a tcp://, ipc:// or inproc:// endpoint", what);
  return PD_OK;
}

static pd_status v_curve_key(const char *what, ProtobufCBinaryData k, pd_err *e) {
  if (k.len != 0 && k.len != 32)
    return pd_err_set(e, PD_EINVAL, "%s must be empty or 32 bytes, got %zu", what, k.len);
  return PD_OK;
}

static pd_status v_token_bytes(const char *what, ProtobufCBinaryData t, pd_err *e) {
  if (t.len != PD_WIRE_TOKEN_BYTES)
    return pd_err_set(e, PD_EINVAL, "%s must be %d bytes, got %zu", what, PD_WIRE_TOKEN_BYTES,
                      t.len);
  return PD_OK;
}

static pd_status v_count(const char *what, size_t n, size_t max, pd_err *e) {
  if (n > max) return pd_err_set(e, PD_ERANGE, "%s has %zu entries, limit %zu", what, n, max);
  return PD_OK;
}

static int32_t vocab_of(const pd_wire_limits *l) {
  return l->vocab_size > 0 ? l->vocab_size : PD_WIRE_ID_CAP;
}

static pd_status v_token(const char *what, int32_t id, const pd_wire_limits *l, pd_err *e) {
  if (id < 0 || id >= vocab_of(l))
    return pd_err_set(e, PD_ERANGE, "%s: token id %d out of range [0, %d)", what, id,
                      vocab_of(l));
  return PD_OK;
}

static pd_status v_tokens(const char *what, const int32_t *ids, size_t n, size_t max,
                          const pd_wire_limits *l, pd_err *e) {
  pd_status st = v_count(what, n, max, e);
  if (st) return st;
  if (n && !ids) return pd_err_set(e, PD_EINVAL, "%s: missing array", what);
  int32_t v = vocab_of(l);
  for (size_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= v)
      return pd_err_set(e, PD_ERANGE, "%s[%zu]: token id %d out of range [0, %d)", what, i,
                        ids[i], v);
  return PD_OK;
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* Block ids: count <= max, each in [0, total) (total <= 0: [0, PD_WIRE_ID_CAP)), distinct. */
static pd_status v_blocks(const char *what, const int32_t *ids, size_t n, size_t max,
                          int32_t total, pd_err *e) {
  pd_status st = v_count(what, n, max, e);
  if (st) return st;
  if (n && !ids) return pd_err_set(e, PD_EINVAL, "%s: missing array", what);
  int32_t cap = total > 0 ? total : PD_WIRE_ID_CAP;
  for (size_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= cap)
      return pd_err_set(e, PD_ERANGE, "%s[%zu]: block id %d out of range [0, %d)", what, i,
                        ids[i], cap);
  if (n < 2) return PD_OK;
  if (n <= 32) { /* small lists: no allocation */
    for (size_t i = 0; i < n; i++)
      for (size_t j = i + 1; j < n; j++)
        if (ids[i] == ids[j])
          return pd_err_set(e, PD_EINVAL, "%s: block id %d is listed twice", what, ids[i]);
    return PD_OK;
  }
  int32_t *tmp = malloc(n * sizeof *tmp);
  if (!tmp) return pd_err_set(e, PD_ENOMEM, "%s: out of memory checking %zu block ids", what, n);
  memcpy(tmp, ids, n * sizeof *tmp);
  qsort(tmp, n, sizeof *tmp, cmp_i32);
  st = PD_OK;
  for (size_t i = 1; i < n; i++)
    if (tmp[i] == tmp[i - 1]) {
      st = pd_err_set(e, PD_EINVAL, "%s: block id %d is listed twice", what, tmp[i]);
      break;
    }
  free(tmp);
  return st;
}

static pd_status v_enum(const char *what, int v, int lo, int hi, pd_err *e) {
  if (v < lo || v > hi)
    return pd_err_set(e, PD_EINVAL, "%s: unknown value %d", what, v);
  return PD_OK;
}

static pd_status v_finish(const char *what, int v, pd_err *e) {
  return v_enum(what, v, PD__FINISH_REASON__FINISH_REASON_NONE,
                PD__FINISH_REASON__FINISH_REASON_ERROR, e);
}

/* A log-probability: a number <= 0 (-inf allowed: a token the model rules out). */
static pd_status v_logprob_value(const char *what, float lp, pd_err *e) {
  if (isnan(lp) || lp > 0.0f)
    return pd_err_set(e, PD_ERANGE, "%s: logprob must be <= 0, got %g", what, (double)lp);
  return PD_OK;
}

static pd_status v_token_logprob(const char *what, const Pd__TokenLogprob *m,
                                 const pd_wire_limits *l, pd_err *e) {
  if (!m) return pd_err_set(e, PD_EINVAL, "%s: missing entry", what);
  pd_status st;
  if ((st = v_token(what, m->token_id, l, e))) return st;
  if ((st = v_logprob_value(what, m->logprob, e))) return st;
  if (m->rank < 1 || m->rank > (uint32_t)vocab_of(l))
    return pd_err_set(e, PD_ERANGE, "%s: rank %u out of range", what, m->rank);
  if (m->token_bytes.len > l->max_name_bytes)
    return pd_err_set(e, PD_ERANGE, "%s: token_bytes longer than %zu", what, l->max_name_bytes);
  if ((st = v_count(what, m->n_top, PD_SAMPLE_MAX_LOGPROBS, e))) return st;
  for (size_t i = 0; i < m->n_top; i++) {
    const Pd__TopLogprob *t = m->top[i];
    if (!t) return pd_err_set(e, PD_EINVAL, "%s: missing top entry %zu", what, i);
    if ((st = v_token(what, t->token_id, l, e))) return st;
    if ((st = v_logprob_value(what, t->logprob, e))) return st;
    if (t->token_bytes.len > l->max_name_bytes)
      return pd_err_set(e, PD_ERANGE, "%s: top token_bytes longer than %zu", what,
                        l->max_name_bytes);
  }
  return PD_OK;
}

static pd_status v_token_logprobs(const char *what, Pd__TokenLogprob *const *a, size_t n,
                                  size_t max, const pd_wire_limits *l, pd_err *e) {
  pd_status st = v_count(what, n, max, e);
  if (st) return st;
  for (size_t i = 0; i < n; i++)
    if ((st = v_token_logprob(what, a ? a[i] : NULL, l, e))) return st;
  return PD_OK;
}

pd_status pd_wire_validate_error(const Pd__Error *m, const pd_wire_limits *l, pd_err *e) {
  if (!m) return pd_err_set(e, PD_EINVAL, "error is missing");
  pd_status st;
  if ((st = v_enum("error.code", m->code, PD__ERROR_CODE__ERROR_CODE_UNSPECIFIED,
                   PD__ERROR_CODE__ERROR_CODE_UNAUTHORIZED, e)))
    return st;
  if ((st = v_str("error.message", m->message, l->max_message_bytes, false, NULL, e))) return st;
  return v_id("error.request_id", m->request_id, false, e);
}

static pd_status v_opt_error(const Pd__Error *m, const pd_wire_limits *l, pd_err *e) {
  return m ? pd_wire_validate_error(m, l, e) : PD_OK;
}

/* A KV geometry as a node declares it. */
static pd_status v_geometry(const char *what, const Pd__KvGeometry *g, pd_err *e) {
  if (!g) return pd_err_set(e, PD_EINVAL, "%s is required", what);
  if (g->num_layers < 1 || g->num_layers > MAX_LAYERS)
    return pd_err_set(e, PD_ERANGE, "%s.num_layers %u out of range [1, %d]", what, g->num_layers,
                      MAX_LAYERS);
  if (g->num_kv_heads < 1 || g->num_kv_heads > MAX_DIM || g->head_dim < 1 ||
      g->head_dim > MAX_DIM || g->block_size < 1 || g->block_size > MAX_DIM)
    return pd_err_set(e, PD_ERANGE, "%s: num_kv_heads %u, head_dim %u, block_size %u must be in "
                      "[1, %d]", what, g->num_kv_heads, g->head_dim, g->block_size, MAX_DIM);
  if (pd_wire_dtype_to_pd(g->dtype) < 0)
    return pd_err_set(e, PD_EINVAL, "%s.dtype: unknown KV dtype %d", what, (int)g->dtype);
  if (g->total_blocks < 1 || g->total_blocks >= (uint32_t)PD_WIRE_ID_CAP)
    return pd_err_set(e, PD_ERANGE, "%s.total_blocks %u out of range", what, g->total_blocks);
  if (g->kv_head_begin >= g->kv_head_end || g->kv_head_end > MAX_DIM ||
      g->kv_head_end - g->kv_head_begin != g->num_kv_heads)
    return pd_err_set(e, PD_EINVAL, "%s: kv head range [%u, %u) does not hold num_kv_heads %u",
                      what, g->kv_head_begin, g->kv_head_end, g->num_kv_heads);
  return PD_OK;
}

static pd_status v_load(const Pd__Load *m, pd_err *e) {
  if (!m) return PD_OK;
  if (m->free_blocks > m->total_blocks || m->reserved_blocks > m->total_blocks)
    return pd_err_set(e, PD_ERANGE, "load: free %u / reserved %u blocks exceed total %u",
                      m->free_blocks, m->reserved_blocks, m->total_blocks);
  if (!(m->spec_acceptance >= 0.0f) || isinf(m->spec_acceptance))
    return pd_err_set(e, PD_ERANGE, "load.spec_acceptance must be a non-negative number");
  return PD_OK;
}

/* ---- client API ---- */

pd_status pd_wire_validate_sampling(const Pd__SamplingParams *m, const pd_wire_limits *l,
                                    pd_err *e) {
  if (!m) return PD_OK; /* all defaults */
  pd_status st;
  if (m->max_tokens > l->max_context)
    return pd_err_set(e, PD_ERANGE, "max_tokens %u exceeds the context limit %u", m->max_tokens,
                      l->max_context);
  if (m->min_tokens > l->max_context)
    return pd_err_set(e, PD_ERANGE, "min_tokens %u exceeds the context limit %u", m->min_tokens,
                      l->max_context);
  if (m->n > l->max_n)
    return pd_err_set(e, PD_ERANGE, "n must be in [1, %u], got %u", l->max_n, m->n);
  if (m->top_logprobs > PD_SAMPLE_MAX_LOGPROBS || m->prompt_top_logprobs > PD_SAMPLE_MAX_LOGPROBS)
    return pd_err_set(e, PD_ERANGE, "top_logprobs must be in [0, %d]", PD_SAMPLE_MAX_LOGPROBS);
  if ((st = v_count("stop", m->n_stop, l->max_stop, e))) return st;
  for (size_t i = 0; i < m->n_stop; i++)
    if ((st = v_str("stop", m->stop ? m->stop[i] : NULL, l->max_name_bytes, true, NULL, e)))
      return st;
  if ((st = v_tokens("stop_token_ids", m->stop_token_ids, m->n_stop_token_ids,
                     l->max_stop_token_ids, l, e)))
    return st;
  if ((st = v_count("logit_bias", m->n_logit_bias, l->max_logit_bias, e))) return st;
  for (size_t i = 0; i < m->n_logit_bias; i++)
    if (!m->logit_bias || !m->logit_bias[i])
      return pd_err_set(e, PD_EINVAL, "logit_bias: missing entry %zu", i);
  /* Value ranges: the sampler's own rules, on the converted parameters. */
  pd_logit_bias stackbuf[64];
  pd_logit_bias *bias = stackbuf;
  if (m->n_logit_bias > 64) {
    bias = malloc(m->n_logit_bias * sizeof *bias);
    if (!bias) return pd_err_set(e, PD_ENOMEM, "logit_bias: out of memory");
  }
  pd_sampling_params p;
  st = pd_wire_sampling_params(m, &p, bias, m->n_logit_bias > 64 ? m->n_logit_bias : 64, e);
  if (st == PD_OK) st = pd_sampling_params_validate(&p, vocab_of(l), e);
  if (st == PD_EINVAL) st = PD_ERANGE; /* a value out of range, in wire terms */
  if (bias != stackbuf) free(bias);
  return st;
}

pd_status pd_wire_validate_generate(const Pd__GenerateRequest *m, const pd_wire_limits *l,
                                    pd_err *e) {
  pd_status st;
  if ((st = v_id("generate.request_id", m->request_id, false, e))) return st;
  if ((st = v_str("generate.model", m->model, l->max_name_bytes, false, NULL, e))) return st;
  size_t plen;
  if ((st = v_str("generate.prompt", m->prompt, l->max_text_bytes, false, &plen, e))) return st;
  int inputs = (plen > 0) + (m->n_prompt_token_ids > 0) + (m->n_messages > 0);
  if (inputs != 1)
    return pd_err_set(e, PD_EINVAL, "generate: exactly one of prompt, prompt_token_ids and "
                      "messages must be given (got %d)", inputs);
  if ((st = v_tokens("generate.prompt_token_ids", m->prompt_token_ids, m->n_prompt_token_ids,
                     l->max_context, l, e)))
    return st;
  if ((st = v_count("generate.messages", m->n_messages, l->max_messages, e))) return st;
  size_t total = 0;
  for (size_t i = 0; i < m->n_messages; i++) {
    const Pd__ChatMessage *c = m->messages ? m->messages[i] : NULL;
    if (!c) return pd_err_set(e, PD_EINVAL, "generate.messages: missing entry %zu", i);
    size_t n;
    if ((st = v_str("generate.messages.role", c->role, l->max_name_bytes, true, NULL, e)))
      return st;
    if ((st = v_str("generate.messages.name", c->name, l->max_name_bytes, false, NULL, e)))
      return st;
    if ((st = v_str("generate.messages.content", c->content, l->max_text_bytes, false, &n, e)))
      return st;
    total += n;
    if (total > l->max_text_bytes)
      return pd_err_set(e, PD_ERANGE, "generate.messages: contents exceed %zu bytes",
                        l->max_text_bytes);
  }
  if ((st = pd_wire_validate_sampling(m->sampling, l, e))) return st;
  /* the message names the field only: the key itself is never echoed */
  if ((st = v_str("generate.api_key", m->api_key, l->max_message_bytes, false, NULL, e)))
    return st;
  return v_str("generate.cache_salt", m->cache_salt, l->max_name_bytes, false, NULL, e);
}

pd_status pd_wire_validate_cancel(const Pd__CancelRequest *m, const pd_wire_limits *l,
                                  pd_err *e) {
  (void)l;
  return v_id("cancel.request_id", m->request_id, true, e);
}

pd_status pd_wire_validate_chunk(const Pd__GenerateChunk *m, const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("chunk.request_id", m->request_id, true, e))) return st;
  if (m->index >= l->max_n)
    return pd_err_set(e, PD_ERANGE, "chunk.index %u out of range [0, %u)", m->index, l->max_n);
  if ((st = v_tokens("chunk.token_ids", m->token_ids, m->n_token_ids, l->max_tokens_per_msg, l,
                     e)))
    return st;
  if ((st = v_str("chunk.text", m->text, l->max_text_bytes, false, NULL, e))) return st;
  if (m->n_logprobs && m->n_logprobs != m->n_token_ids)
    return pd_err_set(e, PD_EINVAL, "chunk.logprobs: %zu entries for %zu tokens", m->n_logprobs,
                      m->n_token_ids);
  if ((st = v_token_logprobs("chunk.logprobs", m->logprobs, m->n_logprobs, l->max_tokens_per_msg,
                             l, e)))
    return st;
  if ((st = v_finish("chunk.finish_reason", m->finish_reason, e))) return st;
  if (m->stop_reason_case == PD__GENERATE_CHUNK__STOP_REASON_STOP_TOKEN_ID &&
      (st = v_token("chunk.stop_token_id", m->stop_token_id, l, e)))
    return st;
  if (m->stop_reason_case == PD__GENERATE_CHUNK__STOP_REASON_STOP_STRING &&
      (st = v_str("chunk.stop_string", m->stop_string, l->max_name_bytes, false, NULL, e)))
    return st;
  if (m->usage) {
    if (m->usage->prompt_tokens > l->max_context || m->usage->completion_tokens > l->max_context ||
        m->usage->cached_tokens > m->usage->prompt_tokens)
      return pd_err_set(e, PD_ERANGE, "chunk.usage: inconsistent token counts");
  }
  if ((st = v_opt_error(m->error, l, e))) return st;
  return v_token_logprobs("chunk.prompt_logprobs", m->prompt_logprobs, m->n_prompt_logprobs,
                          l->max_context, l, e);
}

/* ---- registration and liveness ---- */

pd_status pd_wire_validate_register(const Pd__Register *m, const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("register.node_id", m->node_id, true, e))) return st;
  if (m->role != PD__ROLE__ROLE_PREFILL && m->role != PD__ROLE__ROLE_DECODE)
    return pd_err_set(e, PD_EINVAL, "register.role must be prefill or decode, got %d",
                      (int)m->role);
  if ((st = v_str("register.model", m->model, l->max_name_bytes, true, NULL, e))) return st;
  bool decode = m->role == PD__ROLE__ROLE_DECODE;
  if ((st = v_endpoint("register.kv_endpoint", m->kv_endpoint, l->max_name_bytes, decode, e)))
    return st;
  if ((st = v_curve_key("register.kv_curve_public_key", m->kv_curve_public_key, e))) return st;
  if (m->unified && !decode)
    return pd_err_set(e, PD_EINVAL, "register.unified is for decode nodes");
  if ((st = v_geometry("register.kv", m->kv, e))) return st;
  if (m->draft_kv) {
    if ((st = v_geometry("register.draft_kv", m->draft_kv, e))) return st;
    if (m->draft_kv->block_size != m->kv->block_size)
      return pd_err_set(e, PD_EINVAL, "register: draft block_size %u differs from the target's %u",
                        m->draft_kv->block_size, m->kv->block_size);
  }
  if (m->vocab_size < 1 || m->vocab_size >= (uint32_t)PD_WIRE_ID_CAP)
    return pd_err_set(e, PD_ERANGE, "register.vocab_size %u out of range", m->vocab_size);
  if (m->max_model_len < 1 || m->max_model_len > l->max_context)
    return pd_err_set(e, PD_ERANGE, "register.max_model_len %u out of range [1, %u]",
                      m->max_model_len, l->max_context);
  if (m->tp_size < 1 || m->tp_size > MAX_TP)
    return pd_err_set(e, PD_ERANGE, "register.tp_size %u out of range [1, %d]", m->tp_size,
                      MAX_TP);
  return v_load(m->load, e);
}

pd_status pd_wire_validate_register_ack(const Pd__RegisterAck *m, const pd_wire_limits *l,
                                        pd_err *e) {
  if (m->accepted) {
    if (m->heartbeat_interval_ms < 1 || m->heartbeat_interval_ms > 3600000u ||
        m->heartbeat_timeout_ms < m->heartbeat_interval_ms)
      return pd_err_set(e, PD_ERANGE, "register_ack: heartbeat interval %u ms / timeout %u ms "
                        "invalid", m->heartbeat_interval_ms, m->heartbeat_timeout_ms);
  }
  return v_opt_error(m->error, l, e);
}

pd_status pd_wire_validate_heartbeat(const Pd__Heartbeat *m, const pd_wire_limits *l, pd_err *e) {
  (void)l;
  pd_status st = v_id("heartbeat.node_id", m->node_id, true, e);
  return st ? st : v_load(m->load, e);
}

pd_status pd_wire_validate_heartbeat_ack(const Pd__HeartbeatAck *m, const pd_wire_limits *l,
                                         pd_err *e) {
  (void)m;
  (void)l;
  (void)e;
  return PD_OK; /* a counter and a flag: nothing can be out of range */
}

pd_status pd_wire_validate_deregister(const Pd__Deregister *m, const pd_wire_limits *l,
                                      pd_err *e) {
  pd_status st = v_id("deregister.node_id", m->node_id, true, e);
  return st ? st : v_str("deregister.reason", m->reason, l->max_message_bytes, false, NULL, e);
}

/* ---- request path ---- */

pd_status pd_wire_validate_reserve(const Pd__Reserve *m, const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("reserve.request_id", m->request_id, true, e))) return st;
  if (m->n_tokens < 1 || m->n_tokens > l->max_context)
    return pd_err_set(e, PD_ERANGE, "reserve.n_tokens %u out of range [1, %u]", m->n_tokens,
                      l->max_context);
  if (m->max_new_tokens > l->max_context)
    return pd_err_set(e, PD_ERANGE, "reserve.max_new_tokens %u exceeds %u", m->max_new_tokens,
                      l->max_context);
  if ((st = v_tokens("reserve.prompt_token_ids", m->prompt_token_ids, m->n_prompt_token_ids,
                     l->max_context, l, e)))
    return st;
  if ((st = v_tokens("reserve.generated_token_ids", m->generated_token_ids,
                     m->n_generated_token_ids, l->max_context, l, e)))
    return st;
  if (m->n_prompt_token_ids < 1 ||
      m->n_prompt_token_ids + m->n_generated_token_ids != m->n_tokens)
    return pd_err_set(e, PD_EINVAL, "reserve: n_tokens %u != %zu prompt + %zu generated tokens",
                      m->n_tokens, m->n_prompt_token_ids, m->n_generated_token_ids);
  if ((st = pd_wire_validate_sampling(m->sampling, l, e))) return st;
  if (m->sample_index >= l->max_n)
    return pd_err_set(e, PD_ERANGE, "reserve.sample_index %u out of range", m->sample_index);
  return v_str("reserve.cache_salt", m->cache_salt, l->max_name_bytes, false, NULL, e);
}

pd_status pd_wire_validate_reserve_reply(const Pd__ReserveReply *m, const pd_wire_limits *l,
                                         pd_err *e) {
  pd_status st;
  if ((st = v_id("reserve_reply.request_id", m->request_id, true, e))) return st;
  if ((st = v_opt_error(m->error, l, e))) return st;
  if (!m->ok) {
    if (m->n_block_ids || m->n_draft_block_ids)
      return pd_err_set(e, PD_EINVAL, "reserve_reply: a refusal lists blocks");
    return PD_OK;
  }
  if (m->reservation_id == 0)
    return pd_err_set(e, PD_EINVAL, "reserve_reply.reservation_id is required");
  if ((st = v_token_bytes("reserve_reply.reservation_token", m->reservation_token, e)))
    return st;
  if (m->n_block_ids < 1)
    return pd_err_set(e, PD_EINVAL, "reserve_reply: no block ids");
  if ((st = v_blocks("reserve_reply.block_ids", m->block_ids, m->n_block_ids, l->max_context,
                     l->total_blocks, e)))
    return st;
  if (m->n_draft_block_ids && m->n_draft_block_ids != m->n_block_ids)
    return pd_err_set(e, PD_EINVAL, "reserve_reply: %zu draft blocks for %zu target blocks",
                      m->n_draft_block_ids, m->n_block_ids);
  return v_blocks("reserve_reply.draft_block_ids", m->draft_block_ids, m->n_draft_block_ids,
                  l->max_context, l->draft_total_blocks, e);
}

static uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

static pd_status v_destination(const Pd__KvDestination *d, uint64_t n_tokens,
                               const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("prefill.dest.node_id", d->node_id, true, e))) return st;
  if ((st = v_endpoint("prefill.dest.endpoint", d->endpoint, l->max_name_bytes, true, e)))
    return st;
  if ((st = v_curve_key("prefill.dest.curve_public_key", d->curve_public_key, e))) return st;
  if (d->reservation_id == 0)
    return pd_err_set(e, PD_EINVAL, "prefill.dest.reservation_id is required");
  if ((st = v_token_bytes("prefill.dest.reservation_token", d->reservation_token, e)))
    return st;
  if ((st = v_geometry("prefill.dest.kv", d->kv, e))) return st;
  uint64_t need = ceil_div(n_tokens, d->kv->block_size);
  if (d->n_block_ids != need)
    return pd_err_set(e, PD_EINVAL, "prefill.dest: %zu block ids for %llu tokens (need %llu)",
                      d->n_block_ids, (unsigned long long)n_tokens, (unsigned long long)need);
  if ((st = v_blocks("prefill.dest.block_ids", d->block_ids, d->n_block_ids, l->max_context,
                     (int32_t)d->kv->total_blocks, e)))
    return st;
  if (d->n_draft_block_ids) {
    if (!d->draft_kv)
      return pd_err_set(e, PD_EINVAL, "prefill.dest: draft blocks without draft_kv");
    if ((st = v_geometry("prefill.dest.draft_kv", d->draft_kv, e))) return st;
    if (d->n_draft_block_ids != d->n_block_ids)
      return pd_err_set(e, PD_EINVAL, "prefill.dest: %zu draft blocks for %zu target blocks",
                        d->n_draft_block_ids, d->n_block_ids);
    if (d->draft_kv->block_size != d->kv->block_size)
      return pd_err_set(e, PD_EINVAL, "prefill.dest: draft block_size differs");
    if ((st = v_blocks("prefill.dest.draft_block_ids", d->draft_block_ids, d->n_draft_block_ids,
                       l->max_context, (int32_t)d->draft_kv->total_blocks, e)))
      return st;
  }
  return PD_OK;
}

pd_status pd_wire_validate_prefill(const Pd__Prefill *m, const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("prefill.request_id", m->request_id, true, e))) return st;
  if (m->n_prompt_token_ids < 1)
    return pd_err_set(e, PD_EINVAL, "prefill.prompt_token_ids is empty");
  if ((st = v_tokens("prefill.prompt_token_ids", m->prompt_token_ids, m->n_prompt_token_ids,
                     l->max_context, l, e)))
    return st;
  if ((st = v_tokens("prefill.generated_token_ids", m->generated_token_ids,
                     m->n_generated_token_ids, l->max_context, l, e)))
    return st;
  uint64_t n_tokens = (uint64_t)m->n_prompt_token_ids + m->n_generated_token_ids;
  if (n_tokens > l->max_context)
    return pd_err_set(e, PD_ERANGE, "prefill: %llu tokens exceed the context limit %u",
                      (unsigned long long)n_tokens, l->max_context);
  if ((st = pd_wire_validate_sampling(m->sampling, l, e))) return st;
  if (m->sample_index >= l->max_n)
    return pd_err_set(e, PD_ERANGE, "prefill.sample_index %u out of range", m->sample_index);
  if ((st = v_str("prefill.cache_salt", m->cache_salt, l->max_name_bytes, false, NULL, e)))
    return st;
  if (m->decode_here && m->dest)
    return pd_err_set(e, PD_EINVAL, "prefill: decode_here with a KV destination");
  return m->dest ? v_destination(m->dest, n_tokens, l, e) : PD_OK;
}

pd_status pd_wire_validate_first_token(const Pd__FirstToken *m, const pd_wire_limits *l,
                                       pd_err *e) {
  pd_status st;
  if ((st = v_id("first_token.request_id", m->request_id, true, e))) return st;
  if ((st = v_token("first_token.token_id", m->token_id, l, e))) return st;
  if (m->logprob) {
    if ((st = v_token_logprob("first_token.logprob", m->logprob, l, e))) return st;
    if (m->logprob->token_id != m->token_id)
      return pd_err_set(e, PD_EINVAL, "first_token.logprob is for token %d, not %d",
                        m->logprob->token_id, m->token_id);
  }
  if ((st = v_finish("first_token.finish_reason", m->finish_reason, e))) return st;
  if (m->prompt_tokens < 1 || m->prompt_tokens > l->max_context ||
      m->cached_tokens > m->prompt_tokens)
    return pd_err_set(e, PD_ERANGE, "first_token: prompt_tokens %u / cached_tokens %u invalid",
                      m->prompt_tokens, m->cached_tokens);
  if (m->n_prompt_logprobs > m->prompt_tokens)
    return pd_err_set(e, PD_EINVAL, "first_token: %zu prompt logprobs for %u prompt tokens",
                      m->n_prompt_logprobs, m->prompt_tokens);
  return v_token_logprobs("first_token.prompt_logprobs", m->prompt_logprobs,
                          m->n_prompt_logprobs, l->max_context, l, e);
}

/* a * b into *r; false on overflow. */
static bool mul_ok(uint64_t a, uint64_t b, uint64_t *r) { return !__builtin_mul_overflow(a, b, r); }

pd_status pd_wire_validate_kv_header(const Pd__KvTransferHeader *m, const pd_wire_limits *l,
                                     pd_err *e) {
  pd_status st;
  if ((st = v_id("kv_header.request_id", m->request_id, true, e))) return st;
  if (m->reservation_id == 0)
    return pd_err_set(e, PD_EINVAL, "kv_header.reservation_id is required");
  if ((st = v_token_bytes("kv_header.reservation_token", m->reservation_token, e))) return st;
  int32_t want_layers = m->draft ? l->draft_num_layers : l->num_layers;
  int32_t want_heads = m->draft ? l->draft_num_kv_heads : l->num_kv_heads;
  int32_t want_hd = m->draft ? l->draft_head_dim : l->head_dim;
  int32_t total = m->draft ? l->draft_total_blocks : l->total_blocks;
  if (m->num_layers < 1 || m->num_layers > MAX_LAYERS ||
      (want_layers > 0 && m->num_layers != (uint32_t)want_layers))
    return pd_err_set(e, PD_ERANGE, "kv_header.num_layers %u does not match this cache (%d)",
                      m->num_layers, want_layers);
  if (m->layer_begin >= m->layer_end || m->layer_end > m->num_layers)
    return pd_err_set(e, PD_ERANGE, "kv_header: layer range [%u, %u) invalid for %u layers",
                      m->layer_begin, m->layer_end, m->num_layers);
  if (m->block_size < 1 || m->block_size > MAX_DIM ||
      (l->block_size > 0 && m->block_size != (uint32_t)l->block_size))
    return pd_err_set(e, PD_ERANGE, "kv_header.block_size %u does not match this cache (%d)",
                      m->block_size, l->block_size);
  if (m->head_dim < 1 || m->head_dim > MAX_DIM || (want_hd > 0 && m->head_dim != (uint32_t)want_hd))
    return pd_err_set(e, PD_ERANGE, "kv_header.head_dim %u does not match this cache (%d)",
                      m->head_dim, want_hd);
  if (m->head_begin >= m->head_end || m->head_end > MAX_DIM ||
      (want_heads > 0 && m->head_end > (uint32_t)want_heads))
    return pd_err_set(e, PD_ERANGE, "kv_header: head range [%u, %u) invalid (model has %d)",
                      m->head_begin, m->head_end, want_heads);
  int dt = pd_wire_dtype_to_pd(m->dtype);
  if (dt < 0 || (l->kv_dtype >= 0 && dt != l->kv_dtype))
    return pd_err_set(e, PD_EINVAL, "kv_header.dtype %d does not match this cache", (int)m->dtype);
  if (m->n_block_ids < 1)
    return pd_err_set(e, PD_EINVAL, "kv_header: no block ids");
  if ((st = v_blocks("kv_header.block_ids", m->block_ids, m->n_block_ids, l->max_context, total,
                     e)))
    return st;
  if (m->n_frame_bytes < 1 || m->n_frame_bytes > (size_t)l->max_payload_frames)
    return pd_err_set(e, PD_ERANGE, "kv_header: %zu payload frames, allowed 1..%d",
                      m->n_frame_bytes, l->max_payload_frames);
  /* Staging layout (pd/kvpack.h): all factors are bounded above, but their product may not
   * fit in 64 bits, so every step is checked. */
  uint64_t seg, per_layer, want_off, want_len;
  if (!mul_ok((uint64_t)(m->head_end - m->head_begin) * m->block_size, m->head_dim, &seg) ||
      !mul_ok(seg, pd_dtype_size((pd_dtype)dt), &seg) ||
      !mul_ok(seg, 2 * (uint64_t)m->n_block_ids, &per_layer) ||
      !mul_ok(per_layer, m->layer_begin, &want_off) ||
      !mul_ok(per_layer, m->layer_end - m->layer_begin, &want_len))
    return pd_err_set(e, PD_ERANGE, "kv_header: transfer size overflows");
  if (m->offset != want_off)
    return pd_err_set(e, PD_EINVAL, "kv_header.offset %llu, expected %llu for layer %u",
                      (unsigned long long)m->offset, (unsigned long long)want_off, m->layer_begin);
  uint64_t sum = 0;
  for (size_t i = 0; i < m->n_frame_bytes; i++) {
    uint64_t f = m->frame_bytes[i];
    if (f < 1 || f > l->max_payload_frame_bytes)
      return pd_err_set(e, PD_ERANGE, "kv_header.frame_bytes[%zu] = %llu out of range [1, %zu]",
                        i, (unsigned long long)f, l->max_payload_frame_bytes);
    sum += f; /* no overflow: <= 2^30 frames of <= SIZE_MAX / 2^30 in practice; checked below */
    if (sum < f) return pd_err_set(e, PD_ERANGE, "kv_header: frame sizes overflow");
  }
  if (sum != want_len)
    return pd_err_set(e, PD_EINVAL, "kv_header: frames carry %llu bytes, the layer range needs "
                      "%llu", (unsigned long long)sum, (unsigned long long)want_len);
  return PD_OK;
}

pd_status pd_wire_validate_kv_frames(const Pd__KvTransferHeader *m, int n, const size_t *sizes,
                                     pd_err *e) {
  if (n < 0 || (size_t)n != m->n_frame_bytes)
    return pd_err_set(e, PD_EFORMAT, "kv_header announces %zu payload frames, %d arrived",
                      m->n_frame_bytes, n);
  for (int i = 0; i < n; i++)
    if (sizes[i] != m->frame_bytes[i])
      return pd_err_set(e, PD_EFORMAT, "kv payload frame %d has %zu bytes, header says %llu", i,
                        sizes[i], (unsigned long long)m->frame_bytes[i]);
  return PD_OK;
}

pd_status pd_wire_validate_kv_done(const Pd__KvTransferDone *m, const pd_wire_limits *l,
                                   pd_err *e) {
  pd_status st;
  if ((st = v_id("kv_done.request_id", m->request_id, true, e))) return st;
  if (m->reservation_id == 0) return pd_err_set(e, PD_EINVAL, "kv_done.reservation_id is required");
  if ((st = v_token_bytes("kv_done.reservation_token", m->reservation_token, e))) return st;
  if (m->n_chunks < 1 || m->n_chunks > MAX_CHUNKS)
    return pd_err_set(e, PD_ERANGE, "kv_done.n_chunks %u out of range", m->n_chunks);
  if (m->total_bytes < 1)
    return pd_err_set(e, PD_ERANGE, "kv_done.total_bytes is 0");
  if (m->n_tokens < 1 || m->n_tokens > l->max_context)
    return pd_err_set(e, PD_ERANGE, "kv_done.n_tokens %u out of range [1, %u]", m->n_tokens,
                      l->max_context);
  if ((st = v_token("kv_done.first_token_id", m->first_token_id, l, e))) return st;
  if (m->first_logprob) {
    if ((st = v_token_logprob("kv_done.first_logprob", m->first_logprob, l, e))) return st;
    if (m->first_logprob->token_id != m->first_token_id)
      return pd_err_set(e, PD_EINVAL, "kv_done.first_logprob is for another token");
  }
  return PD_OK;
}

pd_status pd_wire_validate_kv_ack(const Pd__KvTransferAck *m, const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("kv_ack.request_id", m->request_id, true, e))) return st;
  if (m->reservation_id == 0) return pd_err_set(e, PD_EINVAL, "kv_ack.reservation_id is required");
  return v_opt_error(m->error, l, e);
}

pd_status pd_wire_validate_token_stream(const Pd__TokenStream *m, const pd_wire_limits *l,
                                        pd_err *e) {
  pd_status st;
  if ((st = v_id("token_stream.request_id", m->request_id, true, e))) return st;
  if ((st = v_tokens("token_stream.token_ids", m->token_ids, m->n_token_ids,
                     l->max_tokens_per_msg, l, e)))
    return st;
  if (m->n_logprobs && m->n_logprobs != m->n_token_ids)
    return pd_err_set(e, PD_EINVAL, "token_stream.logprobs: %zu entries for %zu tokens",
                      m->n_logprobs, m->n_token_ids);
  if ((st = v_token_logprobs("token_stream.logprobs", m->logprobs, m->n_logprobs,
                             l->max_tokens_per_msg, l, e)))
    return st;
  for (size_t i = 0; i < m->n_logprobs; i++)
    if (m->logprobs[i]->token_id != m->token_ids[i])
      return pd_err_set(e, PD_EINVAL, "token_stream.logprobs[%zu] is for another token", i);
  if ((st = v_finish("token_stream.finish_reason", m->finish_reason, e))) return st;
  if (m->n_generated < m->n_token_ids || m->n_generated > l->max_context)
    return pd_err_set(e, PD_ERANGE, "token_stream.n_generated %u invalid for %zu tokens",
                      m->n_generated, m->n_token_ids);
  if (m->n_draft_accepted > m->n_draft_proposed)
    return pd_err_set(e, PD_EINVAL, "token_stream: %u drafts accepted of %u proposed",
                      m->n_draft_accepted, m->n_draft_proposed);
  return PD_OK;
}

pd_status pd_wire_validate_abort(const Pd__Abort *m, const pd_wire_limits *l, pd_err *e) {
  pd_status st;
  if ((st = v_id("abort.request_id", m->request_id, true, e))) return st;
  if ((st = v_enum("abort.code", m->code, PD__ERROR_CODE__ERROR_CODE_UNSPECIFIED,
                   PD__ERROR_CODE__ERROR_CODE_UNAUTHORIZED, e)))
    return st;
  return v_str("abort.reason", m->reason, l->max_message_bytes, false, NULL, e);
}

/* ---- the envelope ---- */

pd_status pd_wire_validate(const Pd__Envelope *env, const pd_wire_limits *l, pd_err *e) {
  if (!env) return pd_err_set(e, PD_EINVAL, "no envelope");
  if (env->version != PD_PROTOCOL_VERSION)
    return pd_err_set(e, PD_EUNSUPPORTED, "protocol version %u, this build speaks %d",
                      env->version, PD_PROTOCOL_VERSION);
  pd_status st = v_id("envelope.sender", env->sender, false, e);
  if (st) return st;
#define BODY(CASE, field, fn)                                                       \
  case PD__ENVELOPE__BODY_##CASE:                                                  \
    if (!env->field) return pd_err_set(e, PD_EFORMAT, "envelope: %s body missing", #field); \
    return fn(env->field, l, e);
  switch (env->body_case) {
    BODY(GENERATE, generate, pd_wire_validate_generate)
    BODY(CANCEL, cancel, pd_wire_validate_cancel)
    BODY(CHUNK, chunk, pd_wire_validate_chunk)
    BODY(REGISTER_NODE, register_node, pd_wire_validate_register)
    BODY(REGISTER_ACK, register_ack, pd_wire_validate_register_ack)
    BODY(HEARTBEAT, heartbeat, pd_wire_validate_heartbeat)
    BODY(HEARTBEAT_ACK, heartbeat_ack, pd_wire_validate_heartbeat_ack)
    BODY(DEREGISTER, deregister, pd_wire_validate_deregister)
    BODY(RESERVE, reserve, pd_wire_validate_reserve)
    BODY(RESERVE_REPLY, reserve_reply, pd_wire_validate_reserve_reply)
    BODY(PREFILL, prefill, pd_wire_validate_prefill)
    BODY(FIRST_TOKEN, first_token, pd_wire_validate_first_token)
    BODY(KV_HEADER, kv_header, pd_wire_validate_kv_header)
    BODY(KV_DONE, kv_done, pd_wire_validate_kv_done)
    BODY(KV_ACK, kv_ack, pd_wire_validate_kv_ack)
    BODY(TOKEN_STREAM, token_stream, pd_wire_validate_token_stream)
    BODY(ABORT, abort, pd_wire_validate_abort)
    BODY(ERROR, error, pd_wire_validate_error)
    case PD__ENVELOPE__BODY__NOT_SET:
      return pd_err_set(e, PD_EFORMAT, "envelope has no body (or one this build does not know)");
    default:
      return pd_err_set(e, PD_EFORMAT, "envelope body %d unknown", (int)env->body_case);
  }
#undef BODY
}

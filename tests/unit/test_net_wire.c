/* pd/wire.h: every message type round-trips through protobuf-c with every field set; validation
 * rejects out-of-range ids and counts, oversized frames, bad versions, bad UTF-8 and allocation
 * bombs; thousands of random and mutated byte strings decode without a crash or a leak. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/wire.h"
#include "pd_test.h"

#define VOCAB 4096
#define TOTAL_BLOCKS 512

static void limits_node(pd_wire_limits *l) {
  pd_wire_limits_init(l);
  l->vocab_size = VOCAB;
  l->total_blocks = TOTAL_BLOCKS;
  l->draft_total_blocks = 256;
  l->block_size = 16;
  l->num_layers = 6;
  l->draft_num_layers = 2;
  l->num_kv_heads = 2;
  l->draft_num_kv_heads = 1;
  l->head_dim = 64;
  l->draft_head_dim = 64;
  l->kv_dtype = PD_DTYPE_F32;
}

/* ---- one fully populated instance of every body ---- */

static int32_t prompt_ids[] = {1, 22, 333, 4095, 0, 17, 17, 9, 100, 200, 300, 301, 302, 5, 6, 7,
                               8, 2000, 3000};
static int32_t gen_ids[] = {11, 12, 13};
static int32_t stop_ids[] = {0, 7};
static char *stop_strs[] = {"\n\n", "def "};
static Pd__SamplingParams__LogitBiasEntry lb0 = PD__SAMPLING_PARAMS__LOGIT_BIAS_ENTRY__INIT,
                                          lb1 = PD__SAMPLING_PARAMS__LOGIT_BIAS_ENTRY__INIT;
static Pd__SamplingParams__LogitBiasEntry *lbs[] = {&lb0, &lb1};
static Pd__SamplingParams sp = PD__SAMPLING_PARAMS__INIT;

static void fill_sampling(void) {
  sp.temperature_opt_case = PD__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE;
  sp.temperature = 0.0f; /* greedy: a set zero, distinct from unset */
  sp.top_p = 0.9f;
  sp.top_k = 40;
  sp.min_p = 0.05f;
  sp.seed_opt_case = PD__SAMPLING_PARAMS__SEED_OPT_SEED;
  sp.seed = 0xfeedface12345678ull;
  sp.max_tokens = 64;
  sp.min_tokens = 2;
  sp.n_stop = 2;
  sp.stop = stop_strs;
  sp.n_stop_token_ids = 2;
  sp.stop_token_ids = stop_ids;
  sp.n = 2;
  sp.logprobs = true;
  sp.top_logprobs = 5;
  sp.prompt_logprobs = true;
  sp.prompt_top_logprobs = 1;
  sp.presence_penalty = 0.5f;
  sp.frequency_penalty = -0.25f;
  sp.repetition_penalty = 1.1f;
  lb0.key = 42;
  lb0.value = -100.0f;
  lb1.key = 4095;
  lb1.value = 3.5f;
  sp.n_logit_bias = 2;
  sp.logit_bias = lbs;
  sp.ignore_eos = true;
  sp.include_stop_str_in_output = true;
}

static Pd__TopLogprob top0 = PD__TOP_LOGPROB__INIT, top1 = PD__TOP_LOGPROB__INIT;
static Pd__TopLogprob *tops[] = {&top0, &top1};
static Pd__TokenLogprob tlp0 = PD__TOKEN_LOGPROB__INIT, tlp1 = PD__TOKEN_LOGPROB__INIT;
static Pd__TokenLogprob *tlps[] = {&tlp0, &tlp1};

static void fill_logprobs(void) {
  top0.token_id = 11;
  top0.logprob = -0.1f;
  top0.token_bytes = (ProtobufCBinaryData){2, (uint8_t *)"ab"};
  top1.token_id = 99;
  top1.logprob = -2.5f;
  tlp0.token_id = 11;
  tlp0.logprob = -0.1f;
  tlp0.rank = 1;
  tlp0.n_top = 2;
  tlp0.top = tops;
  tlp0.token_bytes = (ProtobufCBinaryData){2, (uint8_t *)"ab"};
  tlp1.token_id = 12;
  tlp1.logprob = -INFINITY; /* a token the model rules out is legal */
  tlp1.rank = 4096;
}

static Pd__Error err_body = PD__ERROR__INIT;
static Pd__KvGeometry geo = PD__KV_GEOMETRY__INIT, dgeo = PD__KV_GEOMETRY__INIT;
static Pd__Load load = PD__LOAD__INIT;
static uint8_t tok16[PD_WIRE_TOKEN_BYTES] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6};
static uint8_t key32[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                            17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
static int32_t blocks[] = {5, 3, 77, 200, 1, 2};      /* ceil(22 / 16) = 2 for prefill dest */
static int32_t dblocks[] = {9, 10, 11, 12, 13, 14};
static uint64_t frames2[] = {0, 0};

static void fill_shared(void) {
  fill_sampling();
  fill_logprobs();
  err_body.code = PD__ERROR_CODE__ERROR_CODE_OVERLOADED;
  err_body.message = "no free KV blocks";
  err_body.request_id = "cmpl-1";
  err_body.retryable = true;
  geo.num_layers = 6;
  geo.num_kv_heads = 2;
  geo.head_dim = 64;
  geo.block_size = 16;
  geo.dtype = PD__KV_DTYPE__KV_DTYPE_F32;
  geo.total_blocks = TOTAL_BLOCKS;
  geo.kv_head_begin = 0;
  geo.kv_head_end = 2;
  dgeo = geo;
  dgeo.num_layers = 2;
  dgeo.num_kv_heads = 1;
  dgeo.kv_head_end = 1;
  dgeo.total_blocks = 256;
  load.queued_prompt_tokens = 12345;
  load.free_blocks = 100;
  load.total_blocks = TOTAL_BLOCKS;
  load.running_seqs = 7;
  load.waiting_seqs = 3;
  load.reserved_blocks = 20;
  load.draft_free_blocks = 50;
  load.spec_acceptance = 2.25f;
}

/* Fills env with body kind k (0..N_KINDS-1); returns false past the last kind. */
#define N_KINDS 18
static bool build(int k, Pd__Envelope *env) {
  static Pd__GenerateRequest gen;
  static Pd__ChatMessage cm0, cm1;
  static Pd__ChatMessage *cms[2];
  static Pd__CancelRequest can;
  static Pd__GenerateChunk chunk;
  static Pd__Usage usage;
  static Pd__Register reg;
  static Pd__RegisterAck rack;
  static Pd__Heartbeat hb;
  static Pd__HeartbeatAck hback;
  static Pd__Deregister dereg;
  static Pd__Reserve res;
  static Pd__ReserveReply rrep;
  static Pd__KvDestination dest;
  static Pd__Prefill pre;
  static Pd__FirstToken ft;
  static Pd__KvTransferHeader kvh;
  static Pd__KvTransferDone kvd;
  static Pd__KvTransferAck kva;
  static Pd__TokenStream ts;
  static Pd__Abort ab;
  static Pd__Error er;
  fill_shared();
  pd_wire_envelope_init(env);
  env->sender = "prefill-0";
  env->seq = 987654321ull;
  switch (k) {
    case 0:
      pd__generate_request__init(&gen);
      pd__chat_message__init(&cm0);
      pd__chat_message__init(&cm1);
      cm0.role = "system";
      cm0.content = "You are terse.";
      cm1.role = "user";
      cm1.content = "Écris une fonction — «tri» ✓";
      cm1.name = "alice";
      cms[0] = &cm0;
      cms[1] = &cm1;
      gen.request_id = "client-7";
      gen.model = "pycoder-12m";
      gen.n_messages = 2;
      gen.messages = cms;
      gen.sampling = &sp;
      gen.stream = true;
      gen.include_usage = true;
      gen.keep_special_tokens = true;
      gen.continue_final_message = true;
      gen.cache_salt = "tenant-a";
      gen.timeout_ms = 30000;
      env->body_case = PD__ENVELOPE__BODY_GENERATE;
      env->generate = &gen;
      return true;
    case 1:
      pd__cancel_request__init(&can);
      can.request_id = "client-7";
      env->body_case = PD__ENVELOPE__BODY_CANCEL;
      env->cancel = &can;
      return true;
    case 2:
      pd__generate_chunk__init(&chunk);
      pd__usage__init(&usage);
      usage.prompt_tokens = 19;
      usage.completion_tokens = 2;
      usage.cached_tokens = 16;
      chunk.request_id = "client-7";
      chunk.index = 1;
      chunk.n_token_ids = 2;
      chunk.token_ids = gen_ids;
      chunk.text = "ab\u00e9";
      chunk.n_logprobs = 2;
      chunk.logprobs = tlps;
      chunk.finish_reason = PD__FINISH_REASON__FINISH_REASON_STOP;
      chunk.stop_reason_case = PD__GENERATE_CHUNK__STOP_REASON_STOP_STRING;
      chunk.stop_string = "\n\n";
      chunk.usage = &usage;
      chunk.n_prompt_logprobs = 2;
      chunk.prompt_logprobs = tlps;
      env->body_case = PD__ENVELOPE__BODY_CHUNK;
      env->chunk = &chunk;
      return true;
    case 3:
      pd__register__init(&reg);
      reg.node_id = "decode-0";
      reg.role = PD__ROLE__ROLE_DECODE;
      reg.model = "pycoder-12m";
      reg.model_fingerprint = 0x0123456789abcdefull;
      reg.incarnation = 77;
      reg.kv_endpoint = "tcp://127.0.0.1:5601";
      reg.kv_curve_public_key = (ProtobufCBinaryData){32, key32};
      reg.kv = &geo;
      reg.draft_kv = &dgeo;
      reg.vocab_size = VOCAB;
      reg.max_model_len = 2048;
      reg.tp_size = 2;
      reg.max_batch_tokens = 8192;
      reg.load = &load;
      env->body_case = PD__ENVELOPE__BODY_REGISTER_NODE;
      env->register_node = &reg;
      return true;
    case 4:
      pd__register_ack__init(&rack);
      rack.accepted = true;
      rack.heartbeat_interval_ms = 500;
      rack.heartbeat_timeout_ms = 3000;
      rack.router_incarnation = 99;
      rack.error = &err_body; /* allowed alongside; a refusal would carry it */
      env->body_case = PD__ENVELOPE__BODY_REGISTER_ACK;
      env->register_ack = &rack;
      return true;
    case 5:
      pd__heartbeat__init(&hb);
      hb.node_id = "decode-0";
      hb.seq = 42;
      hb.load = &load;
      env->body_case = PD__ENVELOPE__BODY_HEARTBEAT;
      env->heartbeat = &hb;
      return true;
    case 6:
      pd__heartbeat_ack__init(&hback);
      hback.seq = 42;
      hback.reregister = true;
      env->body_case = PD__ENVELOPE__BODY_HEARTBEAT_ACK;
      env->heartbeat_ack = &hback;
      return true;
    case 7:
      pd__deregister__init(&dereg);
      dereg.node_id = "decode-0";
      dereg.reason = "draining";
      env->body_case = PD__ENVELOPE__BODY_DEREGISTER;
      env->deregister = &dereg;
      return true;
    case 8:
      pd__reserve__init(&res);
      res.request_id = "cmpl-1/0";
      res.n_tokens = 22;
      res.max_new_tokens = 64;
      res.with_draft = true;
      res.ttl_ms = 10000;
      res.n_prompt_token_ids = 19;
      res.prompt_token_ids = prompt_ids;
      res.n_generated_token_ids = 3;
      res.generated_token_ids = gen_ids;
      res.sampling = &sp;
      res.sample_index = 1;
      res.cache_salt = "tenant-a";
      env->body_case = PD__ENVELOPE__BODY_RESERVE;
      env->reserve = &res;
      return true;
    case 9:
      pd__reserve_reply__init(&rrep);
      rrep.request_id = "cmpl-1/0";
      rrep.ok = true;
      rrep.reservation_id = 5;
      rrep.reservation_token = (ProtobufCBinaryData){sizeof tok16, tok16};
      rrep.n_block_ids = 2;
      rrep.block_ids = blocks;
      rrep.n_draft_block_ids = 2;
      rrep.draft_block_ids = dblocks;
      env->body_case = PD__ENVELOPE__BODY_RESERVE_REPLY;
      env->reserve_reply = &rrep;
      return true;
    case 10:
      pd__kv_destination__init(&dest);
      dest.node_id = "decode-0";
      dest.endpoint = "tcp://127.0.0.1:5601";
      dest.curve_public_key = (ProtobufCBinaryData){32, key32};
      dest.reservation_id = 5;
      dest.reservation_token = (ProtobufCBinaryData){sizeof tok16, tok16};
      dest.n_block_ids = 2;
      dest.block_ids = blocks;
      dest.n_draft_block_ids = 2;
      dest.draft_block_ids = dblocks;
      dest.kv = &geo;
      dest.draft_kv = &dgeo;
      pd__prefill__init(&pre);
      pre.request_id = "cmpl-1/0";
      pre.n_prompt_token_ids = 19;
      pre.prompt_token_ids = prompt_ids;
      pre.n_generated_token_ids = 3;
      pre.generated_token_ids = gen_ids;
      pre.sampling = &sp;
      pre.sample_index = 1;
      pre.dest = &dest;
      pre.cache_salt = "tenant-a";
      env->body_case = PD__ENVELOPE__BODY_PREFILL;
      env->prefill = &pre;
      return true;
    case 11:
      pd__first_token__init(&ft);
      ft.request_id = "cmpl-1/0";
      ft.token_id = 11;
      ft.logprob = &tlp0;
      ft.finish_reason = PD__FINISH_REASON__FINISH_REASON_NONE;
      ft.prompt_tokens = 19;
      ft.cached_tokens = 16;
      ft.n_prompt_logprobs = 2;
      ft.prompt_logprobs = tlps;
      env->body_case = PD__ENVELOPE__BODY_FIRST_TOKEN;
      env->first_token = &ft;
      return true;
    case 12: {
      pd__kv_transfer_header__init(&kvh);
      kvh.request_id = "cmpl-1/0";
      kvh.reservation_id = 5;
      kvh.reservation_token = (ProtobufCBinaryData){sizeof tok16, tok16};
      kvh.chunk_index = 3;
      kvh.draft = false;
      kvh.layer_begin = 2;
      kvh.layer_end = 4;
      kvh.head_begin = 1;
      kvh.head_end = 2;
      kvh.num_layers = 6;
      kvh.block_size = 16;
      kvh.head_dim = 64;
      kvh.dtype = PD__KV_DTYPE__KV_DTYPE_F32;
      kvh.n_block_ids = 2;
      kvh.block_ids = blocks;
      uint64_t seg = 1ull * 16 * 64 * 4; /* one head */
      kvh.offset = 2 * 2 * 2 * seg;      /* layer 2 of (K,V) x 2 blocks */
      frames2[0] = 3 * seg;
      frames2[1] = 5 * seg; /* 2 layers x 2 x 2 blocks = 8 segments */
      kvh.n_frame_bytes = 2;
      kvh.frame_bytes = frames2;
      kvh.checksum_opt_case = PD__KV_TRANSFER_HEADER__CHECKSUM_OPT_CRC32;
      kvh.crc32 = 0xdeadbeefu;
      env->body_case = PD__ENVELOPE__BODY_KV_HEADER;
      env->kv_header = &kvh;
      return true;
    }
    case 13:
      pd__kv_transfer_done__init(&kvd);
      kvd.request_id = "cmpl-1/0";
      kvd.reservation_id = 5;
      kvd.reservation_token = (ProtobufCBinaryData){sizeof tok16, tok16};
      kvd.n_chunks = 4;
      kvd.total_bytes = 1 << 20;
      kvd.n_tokens = 22;
      kvd.first_token_id = 11;
      kvd.first_logprob = &tlp0;
      env->body_case = PD__ENVELOPE__BODY_KV_DONE;
      env->kv_done = &kvd;
      return true;
    case 14:
      pd__kv_transfer_ack__init(&kva);
      kva.request_id = "cmpl-1/0";
      kva.reservation_id = 5;
      kva.ok = false;
      kva.error = &err_body;
      env->body_case = PD__ENVELOPE__BODY_KV_ACK;
      env->kv_ack = &kva;
      return true;
    case 15:
      pd__token_stream__init(&ts);
      ts.request_id = "cmpl-1/0";
      ts.n_token_ids = 2;
      ts.token_ids = gen_ids + 0; /* 11, 12 match tlp0, tlp1 */
      ts.n_logprobs = 2;
      ts.logprobs = tlps;
      ts.finish_reason = PD__FINISH_REASON__FINISH_REASON_LENGTH;
      ts.n_generated = 9;
      ts.n_draft_proposed = 8;
      ts.n_draft_accepted = 5;
      env->body_case = PD__ENVELOPE__BODY_TOKEN_STREAM;
      env->token_stream = &ts;
      return true;
    case 16:
      pd__abort__init(&ab);
      ab.request_id = "cmpl-1/0";
      ab.code = PD__ERROR_CODE__ERROR_CODE_ABORTED;
      ab.reason = "client disconnected";
      env->body_case = PD__ENVELOPE__BODY_ABORT;
      env->abort = &ab;
      return true;
    case 17:
      pd__error__init(&er);
      er = err_body;
      env->body_case = PD__ENVELOPE__BODY_ERROR;
      env->error = &er;
      return true;
    default: return false;
  }
}

static uint8_t *encode(const Pd__Envelope *env, size_t *len) {
  size_t n = pd_wire_encoded_size(env);
  uint8_t *buf = malloc(n ? n : 1);
  pd_err e = {0};
  REQUIRE(buf);
  REQUIRE(pd_wire_encode(env, buf, n, len, &e) == PD_OK);
  REQUIRE(*len == n);
  return buf;
}

/* ---- round trips ---- */

static void test_roundtrip(void) {
  pd_wire_limits l;
  limits_node(&l);
  bool seen[64] = {0};
  for (int k = 0; k < N_KINDS; k++) {
    Pd__Envelope env;
    REQUIRE(build(k, &env));
    size_t len;
    uint8_t *buf = encode(&env, &len);
    pd_wire_msg m;
    pd_wire_msg_init(&m);
    pd_err e = {0};
    pd_status st = pd_wire_decode(&m, buf, len, &l, &e);
    CHECKF(st == PD_OK, "kind %d (%s): %s", k, pd_wire_body_name(env.body_case), e.msg);
    if (st == PD_OK) {
      CHECK(m.env->body_case == env.body_case);
      CHECK(m.env->version == PD_PROTOCOL_VERSION);
      CHECK(strcmp(m.env->sender, "prefill-0") == 0);
      CHECK(m.env->seq == 987654321ull);
      CHECK((size_t)m.env->body_case < 64);
      seen[m.env->body_case] = true;
      /* Every field survived: packing the decoded message gives the same bytes. */
      size_t len2;
      uint8_t *buf2 = encode(m.env, &len2);
      CHECKF(len2 == len && memcmp(buf, buf2, len) == 0, "kind %d re-encodes differently", k);
      free(buf2);
    }
    /* Spot checks of values that mean something. */
    if (st == PD_OK) switch (m.env->body_case) {
        case PD__ENVELOPE__BODY_GENERATE: {
          const Pd__GenerateRequest *g = m.env->generate;
          CHECK(g->n_messages == 2 && strcmp(g->messages[1]->content, "Écris une fonction — «tri» ✓") == 0);
          CHECK(g->sampling->temperature_opt_case ==
                    PD__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE &&
                g->sampling->temperature == 0.0f);
          CHECK(g->sampling->seed == 0xfeedface12345678ull);
          CHECK(g->sampling->n_logit_bias == 2 && g->sampling->logit_bias[1]->key == 4095);
          pd_sampling_params p;
          pd_logit_bias bias[4];
          CHECK(pd_wire_sampling_params(g->sampling, &p, bias, 4, &e) == PD_OK);
          CHECK(p.temperature == 0.0f && pd_sampling_params_is_greedy(&p));
          CHECK(p.top_p == 0.9f && p.top_k == 40 && p.max_tokens == 64 && p.n == 2);
          CHECK(p.logprobs == 5 && p.prompt_logprobs == 1 && p.has_seed && p.ignore_eos);
          CHECK(p.n_logit_bias == 2 && p.logit_bias[0].id == 42 && p.logit_bias[0].bias == -100.0f);
          CHECK(p.n_stop_token_ids == 2 && p.stop_token_ids[1] == 7);
          CHECK(pd_wire_sampling_params(g->sampling, &p, bias, 1, &e) == PD_ERANGE);
          break;
        }
        case PD__ENVELOPE__BODY_REGISTER_NODE:
          CHECK(m.env->register_node->draft_kv && m.env->register_node->draft_kv->num_layers == 2);
          CHECK(m.env->register_node->kv_curve_public_key.len == 32 &&
                m.env->register_node->kv_curve_public_key.data[31] == 32);
          CHECK(m.env->register_node->load->spec_acceptance == 2.25f);
          break;
        case PD__ENVELOPE__BODY_KV_HEADER:
          CHECK(m.env->kv_header->crc32 == 0xdeadbeefu && m.env->kv_header->n_frame_bytes == 2);
          break;
        case PD__ENVELOPE__BODY_TOKEN_STREAM:
          CHECK(isinf(m.env->token_stream->logprobs[1]->logprob));
          break;
        default: break;
      }
    pd_wire_msg_clear(&m);
    CHECK(m.env == NULL);
    free(buf);
  }
  int n_seen = 0;
  for (int i = 0; i < 64; i++) n_seen += seen[i];
  CHECKF(n_seen == N_KINDS, "%d distinct bodies round-tripped", n_seen);

  /* Unset sampling fields take the defaults, not zeros. */
  Pd__SamplingParams empty = PD__SAMPLING_PARAMS__INIT;
  pd_sampling_params p;
  pd_err e = {0};
  CHECK(pd_wire_sampling_params(&empty, &p, NULL, 0, &e) == PD_OK);
  CHECK(p.temperature == 1.0f && p.top_p == 1.0f && p.repetition_penalty == 1.0f);
  CHECK(p.max_tokens == -1 && p.n == 1 && p.logprobs == -1 && !p.has_seed);
  CHECK(pd_wire_validate_sampling(&empty, &l, &e) == PD_OK);
}

/* ---- validation ---- */

/* Builds kind k, lets mutate() break it, encodes, decodes: returns the status. */
static pd_status decode_mutated(int k, void (*mutate)(Pd__Envelope *), const pd_wire_limits *l,
                                pd_err *e) {
  Pd__Envelope env;
  REQUIRE(build(k, &env));
  if (mutate) mutate(&env);
  size_t n = pd_wire_encoded_size(&env), len;
  uint8_t *buf = malloc(n + 1);
  REQUIRE(buf);
  pd__envelope__pack(&env, buf); /* bypass pd_wire_encode's own checks: a hostile sender */
  len = n;
  pd_wire_msg m;
  pd_wire_msg_init(&m);
  pd_status st = pd_wire_decode(&m, buf, len, l, e);
  if (st != PD_OK) CHECK(m.env == NULL);
  pd_wire_msg_clear(&m);
  free(buf);
  return st;
}

/* A NUL byte inside a string field (which protobuf-c would hand over cut short at the NUL)
 * is refused at decode, at any depth: a chat message's content, a stop string. */
static void test_nul_in_strings(void) {
  pd_wire_limits l;
  limits_node(&l);
  static const char *const marks[] = {"abXcd", "stXop"};
  for (int which = 0; which < 3; which++) {
    Pd__Envelope env;
    REQUIRE(build(0, &env));
    Pd__ChatMessage cm = *env.generate->messages[1];
    Pd__ChatMessage *cms[2] = {env.generate->messages[0], &cm};
    env.generate->messages = cms;
    cm.content = (char *)marks[0];
    char *stops[1] = {(char *)marks[1]};
    Pd__SamplingParams sp = *env.generate->sampling;
    sp.n_stop = 1;
    sp.stop = stops;
    env.generate->sampling = &sp;
    size_t n = pd_wire_encoded_size(&env);
    uint8_t *buf = malloc(n);
    REQUIRE(buf);
    pd__envelope__pack(&env, buf);
    if (which < 2) { /* 2: unchanged, must decode */
      uint8_t *at = memmem(buf, n, marks[which], 5);
      REQUIRE(at);
      at[2] = 0;
    }
    pd_wire_msg m;
    pd_wire_msg_init(&m);
    pd_err e = {0};
    pd_status st = pd_wire_decode(&m, buf, n, &l, &e);
    if (which == 2) {
      CHECKF(st == PD_OK, "%s", e.msg);
    } else {
      CHECK(st == PD_EINVAL && strstr(e.msg, "NUL") &&
            strstr(e.msg, which == 0 ? "content" : "stop") && m.env == NULL);
    }
    pd_wire_msg_clear(&m);
    free(buf);
  }
}

/* A field numbered 0 is refused at any depth, its key written in one byte (which protobuf-c
 * refuses itself) or in two (0x85 0x00, which it took for an unknown field that it then
 * re-encoded into the one-byte form: a message that decoded but whose re-encoding did not;
 * found by tests/fuzz/fuzz_wire.c). */
static void test_field_number_0(void) {
  pd_wire_limits l;
  limits_node(&l);
  Pd__Envelope env;
  REQUIRE(build(0, &env)); /* a generate request, with sampling parameters */
  size_t n = pd_wire_encoded_size(&env);
  for (int where = 0; where < 3; where++) {
    uint8_t *buf = malloc(n + 16);
    REQUIRE(buf);
    pd__envelope__pack(&env, buf);
    size_t len = n;
    static const uint8_t key2[] = {0x85, 0x00, 1, 2, 3, 4}, key1[] = {0x05, 1, 2, 3, 4};
    const uint8_t *add = where == 1 ? key1 : key2;
    size_t k = where == 1 ? sizeof key1 : sizeof key2;
    if (where < 2) { /* at the top level, after everything */
      memcpy(buf + len, add, k);
      len += k;
    } else { /* inside the generate body: its length (one byte: < 128?) grows by k */
      size_t at = 0;
      while (at < n && buf[at] != 0x52) at++; /* field 10, length-delimited */
      REQUIRE(at + 3 < n && (buf[at + 1] & 0x80) && !(buf[at + 2] & 0x80));
      size_t body = (size_t)(buf[at + 1] & 0x7f) | (size_t)buf[at + 2] << 7;
      REQUIRE(body + k < 16384 && at + 3 + body == n);
      body += k;
      buf[at + 1] = (uint8_t)(0x80 | (body & 0x7f));
      buf[at + 2] = (uint8_t)(body >> 7);
      memcpy(buf + len, add, k); /* the body is last: append to it */
      len += k;
    }
    pd_wire_msg m;
    pd_wire_msg_init(&m);
    pd_err e = {0};
    pd_status st = pd_wire_decode(&m, buf, len, &l, &e);
    CHECKF(st == PD_EFORMAT && m.env == NULL, "where %d: %d %s", where, st, e.msg);
    pd_wire_msg_clear(&m);
    free(buf);
  }
}

static int32_t bad_prompt[] = {1, 2, VOCAB};
static int32_t neg_prompt[] = {1, -5, 2};
static int32_t dup_blocks[] = {3, 4, 3};
static int32_t big_block[] = {3, TOTAL_BLOCKS};
static char bad_utf8[] = {'a', (char)0xc3, (char)0x28, 0};
static char overlong_utf8[] = {(char)0xc0, (char)0xaf, 0};
static char surrogate_utf8[] = {(char)0xed, (char)0xa0, (char)0x80, 0};

static void m_version(Pd__Envelope *env) { env->version = PD_PROTOCOL_VERSION - 1; }
static void m_nobody(Pd__Envelope *env) { env->body_case = PD__ENVELOPE__BODY__NOT_SET; }
static void m_bad_sender(Pd__Envelope *env) { env->sender = "prefill 0\n"; }
static void m_prefill_token(Pd__Envelope *env) {
  env->prefill->prompt_token_ids = bad_prompt;
  env->prefill->n_prompt_token_ids = 3;
  env->prefill->dest = NULL;
}
static void m_prefill_negative(Pd__Envelope *env) {
  env->prefill->prompt_token_ids = neg_prompt;
  env->prefill->n_prompt_token_ids = 3;
  env->prefill->dest = NULL;
}
static void m_prefill_dest_count(Pd__Envelope *env) { env->prefill->dest->n_block_ids = 1; }
static void m_prefill_reqid(Pd__Envelope *env) { env->prefill->request_id = "a b"; }
static void m_prefill_noreqid(Pd__Envelope *env) { env->prefill->request_id = ""; }
static void m_prefill_longid(Pd__Envelope *env) {
  static char id[PD_WIRE_ID_MAX_BYTES + 2];
  memset(id, 'x', sizeof id - 1);
  id[sizeof id - 1] = 0;
  env->prefill->request_id = id;
}
static void m_reply_dup(Pd__Envelope *env) {
  env->reserve_reply->block_ids = dup_blocks;
  env->reserve_reply->n_block_ids = 3;
  env->reserve_reply->n_draft_block_ids = 0;
}
static void m_reply_range(Pd__Envelope *env) {
  env->reserve_reply->block_ids = big_block;
  env->reserve_reply->n_block_ids = 2;
}
static void m_reply_dup_large(Pd__Envelope *env) {
  static int32_t many[300];
  for (int i = 0; i < 300; i++) many[i] = i;
  many[250] = 17; /* duplicate far apart: the sort path */
  env->reserve_reply->block_ids = many;
  env->reserve_reply->n_block_ids = 300;
  env->reserve_reply->n_draft_block_ids = 0;
}
static void m_reply_refusal_blocks(Pd__Envelope *env) { env->reserve_reply->ok = false; }
static void m_reserve_count(Pd__Envelope *env) { env->reserve->n_tokens = 21; }
static void m_reserve_huge(Pd__Envelope *env) { env->reserve->n_tokens = (1u << 20) + 1; }
static void m_temp_nan(Pd__Envelope *env) { env->generate->sampling->temperature = NAN; }
static void m_top_p(Pd__Envelope *env) { env->generate->sampling->top_p = 1.5f; }
static void m_bias(Pd__Envelope *env) { env->generate->sampling->logit_bias[0]->key = VOCAB + 1; }
static void m_stop_count(Pd__Envelope *env) {
  static char *many[17];
  for (int i = 0; i < 17; i++) many[i] = "x";
  env->generate->sampling->stop = many;
  env->generate->sampling->n_stop = 17;
}
static void m_two_inputs(Pd__Envelope *env) { env->generate->prompt = "hello"; }
static void m_no_input(Pd__Envelope *env) { env->generate->n_messages = 0; }
static void m_bad_utf8(Pd__Envelope *env) { env->generate->messages[0]->content = bad_utf8; }
static void m_overlong(Pd__Envelope *env) { env->generate->messages[0]->content = overlong_utf8; }
static void m_surrogate(Pd__Envelope *env) { env->generate->messages[0]->content = surrogate_utf8; }
static void m_finish_enum(Pd__Envelope *env) { env->token_stream->finish_reason = 99; }
static void m_stream_logprob_mismatch(Pd__Envelope *env) { env->token_stream->n_logprobs = 1; }
static void m_stream_ngen(Pd__Envelope *env) { env->token_stream->n_generated = 1; }
static void m_logprob_positive(Pd__Envelope *env) { env->token_stream->logprobs[0]->logprob = 0.5f; }
static void m_kv_offset(Pd__Envelope *env) { env->kv_header->offset += 4; }
static void m_kv_sum(Pd__Envelope *env) { env->kv_header->frame_bytes[1] -= 1; }
static void m_kv_heads(Pd__Envelope *env) { env->kv_header->head_end = 3; }
static void m_kv_layers(Pd__Envelope *env) { env->kv_header->layer_end = 7; }
static void m_kv_dtype(Pd__Envelope *env) { env->kv_header->dtype = PD__KV_DTYPE__KV_DTYPE_BF16; }
static void m_kv_dtype_unknown(Pd__Envelope *env) { env->kv_header->dtype = 77; }
static void m_kv_block_range(Pd__Envelope *env) { env->kv_header->block_ids = big_block; }
static void m_kv_block_dup(Pd__Envelope *env) {
  env->kv_header->block_ids = dup_blocks;
  env->kv_header->n_block_ids = 3;
}
static void m_kv_draft(Pd__Envelope *env) { env->kv_header->draft = true; } /* draft has 2 layers */
static void m_kv_frames(Pd__Envelope *env) {
  static uint64_t many[257];
  for (int i = 0; i < 257; i++) many[i] = 1;
  env->kv_header->frame_bytes = many;
  env->kv_header->n_frame_bytes = 257;
}
/* Every factor at its cap: 65536 heads x 65536 tokens x 65536 dims x 4 bytes x 2 x 16384
 * blocks overflows 64 bits; only the overflow check stops it (limits unknown). */
static void m_kv_overflow(Pd__Envelope *env) {
  static int32_t many[16384];
  for (int i = 0; i < 16384; i++) many[i] = i;
  env->kv_header->head_begin = 0;
  env->kv_header->head_end = 65536;
  env->kv_header->block_size = 65536;
  env->kv_header->head_dim = 65536;
  env->kv_header->block_ids = many;
  env->kv_header->n_block_ids = 16384;
}
static void m_register_role(Pd__Envelope *env) { env->register_node->role = PD__ROLE__ROLE_ROUTER; }
static void m_register_endpoint(Pd__Envelope *env) {
  env->register_node->kv_endpoint = "http://x";
}
static void m_register_key(Pd__Envelope *env) { env->register_node->kv_curve_public_key.len = 31; }
static void m_register_geo(Pd__Envelope *env) { env->register_node->kv->kv_head_end = 3; }
static void m_register_nokv(Pd__Envelope *env) { env->register_node->kv = NULL; }
static void m_load(Pd__Envelope *env) { env->heartbeat->load->free_blocks = TOTAL_BLOCKS + 1; }
static void m_error_code(Pd__Envelope *env) { env->error->code = -3; }
static void m_error_long(Pd__Envelope *env) {
  static char msg[5000];
  memset(msg, 'm', sizeof msg - 1);
  env->error->message = msg;
}
static void m_first_logprob(Pd__Envelope *env) { env->first_token->token_id = 12; }
static void m_done_noreservation(Pd__Envelope *env) { env->kv_done->reservation_id = 0; }
static void m_chunk_index(Pd__Envelope *env) { env->chunk->index = PD_SAMPLE_MAX_N; }
static void m_chunk_usage(Pd__Envelope *env) { env->chunk->usage->cached_tokens = 20; }
static void m_abort_code(Pd__Envelope *env) { env->abort->code = 12; }
static void m_reply_notoken(Pd__Envelope *env) { env->reserve_reply->reservation_token.len = 0; }
static void m_dest_shorttoken(Pd__Envelope *env) { env->prefill->dest->reservation_token.len = 15; }
static void m_kv_notoken(Pd__Envelope *env) { env->kv_header->reservation_token.len = 0; }
static void m_done_longtoken(Pd__Envelope *env) {
  static uint8_t t[17];
  env->kv_done->reservation_token = (ProtobufCBinaryData){sizeof t, t};
}
static void m_generate_long_key(Pd__Envelope *env) {
  static char k[5000];
  memset(k, 'k', sizeof k - 1);
  env->generate->api_key = k;
}
static void m_ack_interval(Pd__Envelope *env) { env->register_ack->heartbeat_timeout_ms = 100; }

typedef struct vcase {
  const char *name;
  int kind;
  void (*mutate)(Pd__Envelope *);
  pd_status want;
} vcase;

static void test_validation(void) {
  pd_wire_limits l;
  limits_node(&l);
  const vcase cases[] = {
      {"version", 0, m_version, PD_EUNSUPPORTED},
      {"no body", 1, m_nobody, PD_EFORMAT},
      {"sender", 1, m_bad_sender, PD_EINVAL},
      {"token id = vocab", 10, m_prefill_token, PD_ERANGE},
      {"negative token id", 10, m_prefill_negative, PD_ERANGE},
      {"dest block count", 10, m_prefill_dest_count, PD_EINVAL},
      {"request id chars", 10, m_prefill_reqid, PD_EINVAL},
      {"request id missing", 10, m_prefill_noreqid, PD_EINVAL},
      {"request id length", 10, m_prefill_longid, PD_EINVAL},
      {"duplicate blocks", 9, m_reply_dup, PD_EINVAL},
      {"block id = total", 9, m_reply_range, PD_ERANGE},
      {"duplicate blocks (many)", 9, m_reply_dup_large, PD_EINVAL},
      {"refusal with blocks", 9, m_reply_refusal_blocks, PD_EINVAL},
      {"reserve count", 8, m_reserve_count, PD_EINVAL},
      {"reserve context", 8, m_reserve_huge, PD_ERANGE},
      {"temperature NaN", 0, m_temp_nan, PD_ERANGE},
      {"top_p", 0, m_top_p, PD_ERANGE},
      {"logit_bias id", 0, m_bias, PD_ERANGE},
      {"stop count", 0, m_stop_count, PD_ERANGE},
      {"two inputs", 0, m_two_inputs, PD_EINVAL},
      {"no input", 0, m_no_input, PD_EINVAL},
      {"bad utf-8", 0, m_bad_utf8, PD_EINVAL},
      {"overlong utf-8", 0, m_overlong, PD_EINVAL},
      {"surrogate utf-8", 0, m_surrogate, PD_EINVAL},
      {"finish enum", 15, m_finish_enum, PD_EINVAL},
      {"logprob count", 15, m_stream_logprob_mismatch, PD_EINVAL},
      {"n_generated", 15, m_stream_ngen, PD_ERANGE},
      {"positive logprob", 15, m_logprob_positive, PD_ERANGE},
      {"kv offset", 12, m_kv_offset, PD_EINVAL},
      {"kv frame sum", 12, m_kv_sum, PD_EINVAL},
      {"kv heads", 12, m_kv_heads, PD_ERANGE},
      {"kv layers", 12, m_kv_layers, PD_ERANGE},
      {"kv dtype", 12, m_kv_dtype, PD_EINVAL},
      {"kv dtype unknown", 12, m_kv_dtype_unknown, PD_EINVAL},
      {"kv block range", 12, m_kv_block_range, PD_ERANGE},
      {"kv block dup", 12, m_kv_block_dup, PD_EINVAL},
      {"kv draft geometry", 12, m_kv_draft, PD_ERANGE},
      {"kv frame count", 12, m_kv_frames, PD_ERANGE},
      {"register role", 3, m_register_role, PD_EINVAL},
      {"register endpoint", 3, m_register_endpoint, PD_EINVAL},
      {"register key", 3, m_register_key, PD_EINVAL},
      {"register geometry", 3, m_register_geo, PD_EINVAL},
      {"register no kv", 3, m_register_nokv, PD_EINVAL},
      {"load", 5, m_load, PD_ERANGE},
      {"error code", 17, m_error_code, PD_EINVAL},
      {"error length", 17, m_error_long, PD_ERANGE},
      {"first token logprob", 11, m_first_logprob, PD_EINVAL},
      {"kv_done reservation", 13, m_done_noreservation, PD_EINVAL},
      {"reserve_reply without a token", 9, m_reply_notoken, PD_EINVAL},
      {"dest token of 15 bytes", 10, m_dest_shorttoken, PD_EINVAL},
      {"kv_header without a token", 12, m_kv_notoken, PD_EINVAL},
      {"kv_done token of 17 bytes", 13, m_done_longtoken, PD_EINVAL},
      {"api key too long", 0, m_generate_long_key, PD_ERANGE},
      {"chunk index", 2, m_chunk_index, PD_ERANGE},
      {"chunk usage", 2, m_chunk_usage, PD_ERANGE},
      {"abort code", 16, m_abort_code, PD_EINVAL},
      {"ack interval", 4, m_ack_interval, PD_ERANGE},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    pd_err e = {0};
    pd_status st = decode_mutated(cases[i].kind, cases[i].mutate, &l, &e);
    CHECKF(st == cases[i].want, "%s: got %s (%s), want %s", cases[i].name, pd_status_str(st),
           e.msg, pd_status_str(cases[i].want));
    CHECKF(st == PD_OK || e.msg[0], "%s: no message", cases[i].name);
  }

  /* Unknown resources (0) fall back to the hard caps: a router without the peer's pool size
   * accepts blocks {5, 3} but one that knows the pool has 5 blocks does not. */
  {
    pd_wire_limits r;
    pd_wire_limits_init(&r);
    pd_err e = {0};
    CHECK(decode_mutated(9, NULL, &r, &e) == PD_OK);
    r.total_blocks = 5;
    CHECK(decode_mutated(9, NULL, &r, &e) == PD_ERANGE); /* block 5 */
  }

  {
    pd_wire_limits r;
    pd_wire_limits_init(&r);
    pd_err e = {0};
    CHECK(decode_mutated(12, NULL, &r, &e) == PD_OK);
    CHECK(decode_mutated(12, m_kv_overflow, &r, &e) == PD_ERANGE);
    CHECKF(strstr(e.msg, "overflow") != NULL, "%s", e.msg);
  }

  /* The frame cap is checked before unpacking; a valid message just over it is refused. */
  {
    Pd__Envelope env;
    build(0, &env);
    size_t len;
    uint8_t *buf = encode(&env, &len);
    pd_wire_limits small = l;
    small.max_frame_bytes = len - 1;
    pd_wire_msg m;
    pd_wire_msg_init(&m);
    pd_err e = {0};
    CHECK(pd_wire_decode(&m, buf, len, &small, &e) == PD_ERANGE);
    small.max_frame_bytes = len;
    CHECK(pd_wire_decode(&m, buf, len, &small, &e) == PD_OK);
    pd_wire_msg_clear(&m);
    CHECK(pd_wire_decode(&m, buf, 0, &small, &e) == PD_EFORMAT); /* empty */
    free(buf);
  }

  /* Allocation bomb: 100k empty chat messages are 2 bytes each on the wire but ~60 in memory.
   * A 2 MiB unpack budget refuses them before validation sees the count. */
  {
    enum { N = 100000 };
    Pd__ChatMessage cm = PD__CHAT_MESSAGE__INIT;
    Pd__ChatMessage **cms = malloc(N * sizeof *cms);
    REQUIRE(cms);
    for (int i = 0; i < N; i++) cms[i] = &cm;
    Pd__GenerateRequest g = PD__GENERATE_REQUEST__INIT;
    g.n_messages = N;
    g.messages = cms;
    Pd__Envelope env;
    pd_wire_envelope_init(&env);
    env.body_case = PD__ENVELOPE__BODY_GENERATE;
    env.generate = &g;
    size_t len;
    uint8_t *buf = encode(&env, &len);
    CHECK(len < 300000);
    pd_wire_limits b = l;
    b.max_alloc_bytes = 2 << 20;
    pd_wire_msg m;
    pd_wire_msg_init(&m);
    pd_err e = {0};
    CHECK(pd_wire_decode(&m, buf, len, &b, &e) == PD_EFORMAT);
    CHECK(strstr(e.msg, "expands") != NULL);
    CHECK(m.used_ == 0); /* every partial allocation was given back */
    b.max_alloc_bytes = 64 << 20; /* unpacks, then the count is refused */
    CHECK(pd_wire_decode(&m, buf, len, &b, &e) == PD_ERANGE);
    CHECK(m.env == NULL && m.used_ == 0);
    free(buf);
    free(cms);
  }

  /* KV frames that arrived vs the header. */
  {
    Pd__Envelope env;
    build(12, &env);
    pd_err e = {0};
    size_t ok[2] = {(size_t)env.kv_header->frame_bytes[0], (size_t)env.kv_header->frame_bytes[1]};
    size_t bad[2] = {ok[0], ok[1] + 1};
    CHECK(pd_wire_validate_kv_frames(env.kv_header, 2, ok, &e) == PD_OK);
    CHECK(pd_wire_validate_kv_frames(env.kv_header, 2, bad, &e) == PD_EFORMAT);
    CHECK(pd_wire_validate_kv_frames(env.kv_header, 1, ok, &e) == PD_EFORMAT);
  }

  /* Encoding refuses envelopes a receiver would refuse for certain. */
  {
    Pd__Envelope env = PD__ENVELOPE__INIT;
    uint8_t buf[64];
    size_t len;
    pd_err e = {0};
    CHECK(pd_wire_encode(&env, buf, sizeof buf, &len, &e) == PD_EINVAL); /* version 0 */
    pd_wire_envelope_init(&env);
    CHECK(pd_wire_encode(&env, buf, sizeof buf, &len, &e) == PD_EINVAL); /* no body */
    build(0, &env);
    CHECK(pd_wire_encode(&env, buf, 8, &len, &e) == PD_ERANGE);         /* too small */
  }

  CHECK(pd_wire_id_ok("cmpl-9f/0@x+y:z.w_v"));
  CHECK(!pd_wire_id_ok(""));
  CHECK(!pd_wire_id_ok("with space"));
  CHECK(!pd_wire_id_ok("tab\t"));
  CHECK(pd_wire_dtype_to_pd(pd_wire_dtype_from_pd(PD_DTYPE_BF16)) == PD_DTYPE_BF16);
  CHECK(pd_wire_dtype_from_pd(PD_DTYPE_I32) == PD__KV_DTYPE__KV_DTYPE_UNSPECIFIED);
  CHECK(pd_wire_error_code(PD_EFULL) == PD__ERROR_CODE__ERROR_CODE_OVERLOADED);
}

/* ---- fuzzing ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

static void test_fuzz(void) {
  pd_wire_limits l;
  limits_node(&l);
  l.max_alloc_bytes = 8 << 20;
  pd_wire_msg m;
  pd_wire_msg_init(&m);
  uint8_t buf[4096];
  int ok_random = 0, ok_mutated = 0, n_mutated = 0;

  /* Pure random bytes, random lengths. */
  for (int it = 0; it < 4000; it++) {
    size_t len = rnd() % (it < 2000 ? 64 : sizeof buf);
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)rnd();
    pd_err e = {0};
    if (pd_wire_decode(&m, buf, len, &l, &e) == PD_OK) {
      ok_random++;
      CHECK(pd_wire_validate(m.env, &l, &e) == PD_OK);
    } else {
      CHECK(m.env == NULL);
    }
    pd_wire_msg_clear(&m);
  }

  /* Mutations of valid messages of every kind: flipped bytes, truncations, insertions,
   * field-tag-looking bytes. These get past the first bytes and exercise deep paths. */
  for (int k = 0; k < N_KINDS; k++) {
    Pd__Envelope env;
    build(k, &env);
    size_t len0;
    uint8_t *orig = encode(&env, &len0);
    REQUIRE(len0 + 16 <= sizeof buf);
    for (int it = 0; it < 400; it++) {
      size_t len = len0;
      memcpy(buf, orig, len);
      int nmut = 1 + (int)(rnd() % 4);
      for (int j = 0; j < nmut; j++) {
        switch (rnd() % 5) {
          case 0: buf[rnd() % len] ^= (uint8_t)(1u << (rnd() % 8)); break;
          case 1: buf[rnd() % len] = (uint8_t)rnd(); break;
          case 2: len = 1 + rnd() % len; break;
          case 3: buf[rnd() % len] = 0xff; break; /* varint continuation */
          case 4:
            if (len + 1 < sizeof buf) {
              size_t at = rnd() % len;
              memmove(buf + at + 1, buf + at, len - at);
              buf[at] = (uint8_t)rnd();
              len++;
            }
            break;
        }
      }
      pd_err e = {0};
      n_mutated++;
      if (pd_wire_decode(&m, buf, len, &l, &e) == PD_OK) {
        ok_mutated++;
        /* Whatever was accepted is self-consistent and re-encodes. */
        CHECK(pd_wire_validate(m.env, &l, &e) == PD_OK);
        size_t n = pd_wire_encoded_size(m.env);
        uint8_t *re = malloc(n ? n : 1);
        size_t rl;
        CHECK(re && pd_wire_encode(m.env, re, n, &rl, &e) == PD_OK);
        free(re);
      } else {
        CHECK(m.env == NULL && e.msg[0]);
      }
      pd_wire_msg_clear(&m);
    }
    free(orig);
  }
  printf("fuzz: %d/4000 random and %d/%d mutated inputs decoded as valid\n", ok_random,
         ok_mutated, n_mutated);
  /* Most mutations must be caught (a sanity check that the fuzzer reaches the validators). */
  CHECK(ok_mutated < n_mutated);
  CHECK(ok_random < 4000);
}

/* Unguessable ids: random hex of 128 bits, all different; tokens compare by content; a refused
 * API key is not echoed. */
static void test_ids(void) {
  pd_err e = {0};
  char a[2 * PD_WIRE_TOKEN_BYTES + 1], b[2 * PD_WIRE_TOKEN_BYTES + 1];
  CHECK(pd_wire_random_hex(a, &e) == PD_OK && pd_wire_random_hex(b, &e) == PD_OK);
  CHECK(strlen(a) == 32 && strspn(a, "0123456789abcdef") == 32 && strcmp(a, b) != 0);
  uint8_t t[PD_WIRE_TOKEN_BYTES], u[PD_WIRE_TOKEN_BYTES];
  CHECK(pd_wire_random(t, sizeof t, &e) == PD_OK);
  memcpy(u, t, sizeof u);
  CHECK(pd_wire_token_eq((ProtobufCBinaryData){sizeof t, t}, u));
  u[15] ^= 1;
  CHECK(!pd_wire_token_eq((ProtobufCBinaryData){sizeof t, t}, u));
  CHECK(!pd_wire_token_eq((ProtobufCBinaryData){15, t}, t));
  CHECK(!pd_wire_token_eq((ProtobufCBinaryData){0, NULL}, t));
  /* a generate request with an API key: valid; an oversized one refused without the key */
  Pd__GenerateRequest g = PD__GENERATE_REQUEST__INIT;
  g.prompt = "x";
  g.api_key = "sk-secret-value";
  pd_wire_limits l;
  pd_wire_limits_init(&l);
  CHECK(pd_wire_validate_generate(&g, &l, &e) == PD_OK);
  static char big[5000];
  memset(big, 'k', sizeof big - 1);
  g.api_key = big;
  CHECK(pd_wire_validate_generate(&g, &l, &e) == PD_ERANGE && !strstr(e.msg, "kkkk") &&
        strstr(e.msg, "api_key"));
}

int main(void) {
  test_ids();
  test_roundtrip();
  test_validation();
  test_nul_in_strings();
  test_field_number_0();
  test_fuzz();
  return pd_test_finish("test_net_wire");
}

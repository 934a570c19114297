/* The wire format: proto/pd.proto messages (protobuf-c), their limits and their validation.
 *
 * Every message between processes is one pd.Envelope (Pd__Envelope in C). This module turns
 * bytes into a checked Envelope and back; pd/net.h adds ZeroMQ framing on top.
 *
 * Receivers never trust a peer (docs/protocol.md, "Limits"):
 *   1. the frame size is checked BEFORE unpacking (max_frame_bytes);
 *   2. protobuf-c unpacks with an allocator whose total is capped (max_alloc_bytes), so a
 *      small frame cannot expand into a huge allocation (empty sub-messages cost ~2 bytes on
 *      the wire but ~50 in memory);
 *   3. the version and the body case are checked;
 *   4. pd_wire_validate checks every id, count, length and range of the body against
 *      pd_wire_limits: token ids < vocab_size, block ids < total_blocks and distinct,
 *      token counts <= max_context, strings bounded and UTF-8, repeated fields bounded,
 *      KV header geometry equal to the receiver's, sampling parameters in their ranges.
 * Anything malformed yields PD_EFORMAT (undecodable, wrong version PD_EUNSUPPORTED), PD_ERANGE
 * (a value out of its range) or PD_EINVAL (a rule broken: missing field, duplicate ids) with a
 * message naming the field; nothing crashes and nothing is left allocated.
 *
 * Limits that depend on the peer (a decode node's total_blocks as seen by the router) are the
 * caller's to set per peer: copy the limits and call pd_wire_validate_* again. A limit of 0 for
 * vocab_size, total_blocks or a KV geometry field means "not known here": only the hard caps
 * (ids >= 0 and < PD_WIRE_ID_CAP) are checked; the owner of the resource (the decode node for its
 * blocks) always sets the real value.
 *
 * Thread-safety: all functions are reentrant; a pd_wire_msg belongs to one thread at a time. */
#ifndef PD_WIRE_H
#define PD_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/dtype.h"
#include "pd/pd.pb-c.h" /* generated from proto/pd.proto at build time */
#include "pd/sampling.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_PROTOCOL_VERSION 2 /* = pd.PROTOCOL_VERSION_CURRENT */
#define PD_WIRE_ID_CAP (1 << 30) /* hard cap on any token or block id, whatever the limits */
#define PD_WIRE_ID_MAX_BYTES 128 /* request_id, node_id: 1..128 bytes of [A-Za-z0-9._:/@+-] */
#define PD_WIRE_TOKEN_BYTES 16   /* a reservation token: 128 random bits */

typedef struct pd_wire_limits {
  /* ---- sizes enforced before unpacking ---- */
  size_t max_frame_bytes;         /* the Envelope frame. Default 4 MiB */
  size_t max_payload_frame_bytes; /* each raw payload frame. Default 64 MiB */
  int max_payload_frames;         /* raw frames after the Envelope. Default 256 */
  size_t max_alloc_bytes;         /* protobuf-c unpack allocation total. Default 64 MiB */
  /* ---- strings ---- */
  size_t max_name_bytes;    /* model, role, endpoint, sender, stop string. Default 256 */
  size_t max_message_bytes; /* error messages, abort reasons. Default 4096 */
  size_t max_text_bytes;    /* prompt text, sum of chat contents, text deltas. Default 4 MiB */
  /* ---- counts ---- */
  uint32_t max_context;       /* tokens in one sequence (prompt + output). Default 1 Mi */
  uint32_t max_stop;          /* stop strings. Default 16 */
  uint32_t max_stop_token_ids; /* Default 1024 */
  uint32_t max_logit_bias;    /* logit_bias entries. Default 1024 */
  uint32_t max_messages;      /* chat messages. Default 4096 */
  uint32_t max_n;             /* choices per request. Default PD_SAMPLE_MAX_N */
  uint32_t max_tokens_per_msg; /* token ids (and logprobs) in one TokenStream/GenerateChunk;
                                  longer outputs are sent in several. Default 65536 */
  /* ---- resources of the receiver; 0 = not known here (see the file comment) ---- */
  int32_t vocab_size;
  int32_t total_blocks;       /* the target KV pool's blocks */
  int32_t draft_total_blocks; /* the draft KV pool's blocks */
  int32_t block_size;         /* tokens per block (target and draft share it) */
  int32_t num_layers;         /* target cache */
  int32_t draft_num_layers;
  int32_t num_kv_heads;       /* global kv heads of the target model */
  int32_t draft_num_kv_heads;
  int32_t head_dim;
  int32_t draft_head_dim;
  int kv_dtype;               /* a pd_dtype, or -1 = not known */
} pd_wire_limits;

/* Fills the defaults above (resources unknown). */
void pd_wire_limits_init(pd_wire_limits *l);

/* ---- decoding ---- */

/* A decoded Envelope and the capped allocator that owns its memory. Zero-initialise (or
 * pd_wire_msg_init) before the first decode; decode clears any previous content. */
typedef struct pd_wire_msg {
  Pd__Envelope *env; /* NULL when empty */
  /* private: */
  ProtobufCAllocator alloc_;
  size_t used_;
  size_t budget_;
} pd_wire_msg;

void pd_wire_msg_init(pd_wire_msg *m);
/* Frees the envelope (if any); m is empty and reusable afterwards. */
void pd_wire_msg_clear(pd_wire_msg *m);

/* Decodes buf[0..len) into m: size check, capped unpack, version and body checks, then
 * pd_wire_validate. On failure m is empty. */
pd_status pd_wire_decode(pd_wire_msg *m, const void *buf, size_t len, const pd_wire_limits *l,
                         pd_err *e);

/* ---- encoding ---- */

/* pd__envelope__init plus version = PD_PROTOCOL_VERSION. */
void pd_wire_envelope_init(Pd__Envelope *env);
/* Packed size of env (protobuf-c). */
size_t pd_wire_encoded_size(const Pd__Envelope *env);
/* Packs env into buf (cap bytes, >= pd_wire_encoded_size); *len = bytes written.
 * PD_EINVAL when env has no body or a version other than PD_PROTOCOL_VERSION, PD_ERANGE when
 * cap is too small. */
pd_status pd_wire_encode(const Pd__Envelope *env, void *buf, size_t cap, size_t *len, pd_err *e);

/* ---- validation (pd_wire_decode calls pd_wire_validate; these are public so a caller can
 *      re-check a body with per-peer limits) ---- */

pd_status pd_wire_validate(const Pd__Envelope *env, const pd_wire_limits *l, pd_err *e);

pd_status pd_wire_validate_sampling(const Pd__SamplingParams *m, const pd_wire_limits *l,
                                    pd_err *e);
pd_status pd_wire_validate_generate(const Pd__GenerateRequest *m, const pd_wire_limits *l,
                                    pd_err *e);
pd_status pd_wire_validate_cancel(const Pd__CancelRequest *m, const pd_wire_limits *l,
                                  pd_err *e);
pd_status pd_wire_validate_chunk(const Pd__GenerateChunk *m, const pd_wire_limits *l, pd_err *e);
pd_status pd_wire_validate_register(const Pd__Register *m, const pd_wire_limits *l, pd_err *e);
pd_status pd_wire_validate_register_ack(const Pd__RegisterAck *m, const pd_wire_limits *l,
                                        pd_err *e);
pd_status pd_wire_validate_heartbeat(const Pd__Heartbeat *m, const pd_wire_limits *l, pd_err *e);
pd_status pd_wire_validate_heartbeat_ack(const Pd__HeartbeatAck *m, const pd_wire_limits *l,
                                         pd_err *e);
pd_status pd_wire_validate_deregister(const Pd__Deregister *m, const pd_wire_limits *l,
                                      pd_err *e);
pd_status pd_wire_validate_reserve(const Pd__Reserve *m, const pd_wire_limits *l, pd_err *e);
/* Block ids are checked against total_blocks / draft_total_blocks (the decode node's, which the
 * router knows from Register: set them per peer) and for duplicates. */
pd_status pd_wire_validate_reserve_reply(const Pd__ReserveReply *m, const pd_wire_limits *l,
                                         pd_err *e);
pd_status pd_wire_validate_prefill(const Pd__Prefill *m, const pd_wire_limits *l, pd_err *e);
pd_status pd_wire_validate_first_token(const Pd__FirstToken *m, const pd_wire_limits *l,
                                       pd_err *e);
/* The header alone: layer/head ranges within the receiver's geometry (when known), block_size,
 * head_dim and dtype equal to the receiver's, block ids in range and distinct, offset and the
 * frame sizes consistent with the staging layout (pd/kvpack.h), frame count and sizes within
 * the limits. pd_wire_validate_kv_frames checks the frames that actually arrived. */
pd_status pd_wire_validate_kv_header(const Pd__KvTransferHeader *m, const pd_wire_limits *l,
                                     pd_err *e);
/* The n payload frames received with header m have exactly the sizes m->frame_bytes lists. */
pd_status pd_wire_validate_kv_frames(const Pd__KvTransferHeader *m, int n, const size_t *sizes,
                                     pd_err *e);
pd_status pd_wire_validate_kv_done(const Pd__KvTransferDone *m, const pd_wire_limits *l,
                                   pd_err *e);
pd_status pd_wire_validate_kv_ack(const Pd__KvTransferAck *m, const pd_wire_limits *l, pd_err *e);
pd_status pd_wire_validate_token_stream(const Pd__TokenStream *m, const pd_wire_limits *l,
                                        pd_err *e);
pd_status pd_wire_validate_abort(const Pd__Abort *m, const pd_wire_limits *l, pd_err *e);
pd_status pd_wire_validate_error(const Pd__Error *m, const pd_wire_limits *l, pd_err *e);

/* An id as the protocol allows (1..PD_WIRE_ID_MAX_BYTES of [A-Za-z0-9._:/@+-]). */
bool pd_wire_id_ok(const char *s);

/* ---- unguessable ids (docs/protocol.md, "Ids") ---- */

/* n bytes from the kernel's CSPRNG (getrandom; interrupted calls are resumed). PD_EIO when the
 * kernel has none to give. */
pd_status pd_wire_random(void *buf, size_t n, pd_err *e);
/* 128 random bits as 32 lowercase hex digits and a NUL (out: 33 bytes): a request id or part of
 * one that nobody else can guess. */
pd_status pd_wire_random_hex(char out[2 * PD_WIRE_TOKEN_BYTES + 1], pd_err *e);
/* Whether a and b hold the same PD_WIRE_TOKEN_BYTES bytes, in time that does not depend on
 * where they differ; false when either is not a token's length. */
bool pd_wire_token_eq(ProtobufCBinaryData a, const uint8_t b[PD_WIRE_TOKEN_BYTES]);

/* ---- conversions ---- */

/* Converts a validated SamplingParams into pd_sampling_params. The stop_token_ids array is
 * borrowed from m; logit_bias entries are written to bias[0..cap) (cap >= m->n_logit_bias,
 * else PD_ERANGE) and p->logit_bias points there. Unset fields take pd_sampling_params_init's
 * defaults; max_tokens 0 becomes -1 (no limit); logprobs false becomes -1. */
pd_status pd_wire_sampling_params(const Pd__SamplingParams *m, pd_sampling_params *p,
                                  pd_logit_bias *bias, size_t cap, pd_err *e);

/* KvDtype <-> pd_dtype. -1 / PD__KV_DTYPE__KV_DTYPE_UNSPECIFIED when not a KV dtype. */
int pd_wire_dtype_to_pd(Pd__KvDtype d);
Pd__KvDtype pd_wire_dtype_from_pd(pd_dtype t);

/* The ErrorCode a pd_status maps to (PD_EFULL -> OVERLOADED, PD_EINVAL/ERANGE ->
 * INVALID_REQUEST, PD_EFORMAT -> PROTOCOL, ...). */
Pd__ErrorCode pd_wire_error_code(pd_status s);

/* Name of the body case ("reserve", "kv_header", ...); "none" when unset, "unknown" otherwise. */
const char *pd_wire_body_name(Pd__Envelope__BodyCase c);

#ifdef __cplusplus
}
#endif
#endif

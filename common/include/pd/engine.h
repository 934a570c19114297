/* The forward pass of the Llama / Qwen2 / Mistral family over a backend's ops table.
 *
 * One call runs one ragged batch: any mix of prefill chunks and decode tokens of many
 * sequences, no padding. Each token names its cache slot (where its K/V are written) and
 * each sequence its block table (where attention reads its whole context). The engine owns the
 * paged KV storage; which blocks a sequence uses is decided by the caller (common/kvcache). */
#ifndef PD_ENGINE_H
#define PD_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "pd/backend.h"
#include "pd/model.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_engine pd_engine;

typedef struct pd_engine_opts {
  int block_size;       /* tokens per KV block (default 16) */
  int num_blocks;       /* KV blocks in the pool (default: enough for 4 x max_model_len) */
  int max_batch_tokens; /* most tokens in one forward (default 2048) */
  int max_seqs;         /* most sequences in one forward (default 256) */
  int max_model_len;    /* longest context (default: the model's max_position_embeddings) */
  pd_dtype kv_dtype;    /* F32 (default) */
  bool enforce_eager;   /* never replay steps as graphs (backends with graphs) */
  bool no_device_sampling; /* pd_engine_can_sample reports false */
} pd_engine_opts;

/* Fills the defaults above (call before setting fields). */
void pd_engine_opts_default(pd_engine_opts *o);

/* Prepares the model on the backend: small weights converted to f32, large ones used in place
 * (host backends) or uploaded once; KV pool and activation buffers allocated. The model must
 * outlive the engine. */
pd_engine *pd_engine_create(const pd_model *m, pd_backend *be, const pd_engine_opts *o,
                            pd_err *e);
void pd_engine_free(pd_engine *eng);

const pd_engine_opts *pd_engine_get_opts(const pd_engine *eng);
const pd_model_config *pd_engine_config(const pd_engine *eng);
/* Bytes of KV cache one block takes across all layers (K and V). */
size_t pd_engine_block_bytes(const pd_engine *eng);

/* One step's batch, all arrays on the host. Sequence s contributes the tokens
 * [q_start[s], q_start[s+1]) (its newest ones), whose positions are
 * ctx_len[s] - n_new .. ctx_len[s] - 1 in order; slots[i] is where token i's K/V go
 * (block * block_size + offset). Logits are produced for the rows logit_rows[0..n_logits). */
typedef struct pd_batch {
  int n_tokens;
  const int32_t *tokens;    /* [n_tokens] */
  const int32_t *positions; /* [n_tokens] */
  const int32_t *slots;     /* [n_tokens] */
  int n_seqs;
  const int32_t *q_start;      /* [n_seqs + 1] */
  const int32_t *ctx_len;      /* [n_seqs] */
  const int32_t *block_tables; /* [n_seqs, max_blocks] */
  int max_blocks;
  int n_logits;
  const int32_t *logit_rows; /* [n_logits] */
  /* Device sampling (only when pd_engine_can_sample): the LAST n_sample logit rows are sampled
   * on the backend with sample[i] (the engine sets its row field), results in sample_out[i],
   * and only the first n_logits - n_sample rows are copied to the host logits. edits: the
   * specs' edit lists (pd/backend.h). Zero n_sample: every row goes to the host. */
  int n_sample;
  pd_dev_sample_spec *sample;     /* [n_sample] */
  const pd_dev_sample_edit *edits; /* [n_edits] */
  int n_edits;
  pd_dev_sample_out *sample_out;  /* [n_sample] */
} pd_batch;

/* Whether batches may ask for device sampling (the backend has a `sample` op and the engine
 * options allow it). */
bool pd_engine_can_sample(const pd_engine *eng);

/* Graph replays so far and the graphs held (backends with graphs: decode steps, and steps of
 * at most 16 tokens a sequence such as speculative verification). */
void pd_engine_graph_stats(const pd_engine *eng, uint64_t *replays, int *n_graphs);

/* Wall-clock seconds spent inside pd_engine_forward so far (uploads, the model, sampling,
 * waiting for the device), for benchmarks that separate engine time from scheduler time. */
double pd_engine_forward_seconds(const pd_engine *eng);

/* Runs the batch; writes logits [n_logits, vocab_size] (host, f32). The batch is validated
 * (sizes within the engine's limits, ids in the vocabulary, slots and block ids in the pool,
 * positions consistent) and rejected with PD_EINVAL before anything runs. */
pd_status pd_engine_forward(pd_engine *eng, const pd_batch *b, float *logits, pd_err *e);

/* pd_engine_forward in two halves, for callers that work on the host while the device computes:
 * submit validates the batch and queues the model on the backend (on devices it returns before
 * the model has run; host backends run it here); finish samples (the batch's device-sampled
 * rows), copies the host rows' logits and waits for the device. The batch and every array it
 * points to must stay unchanged from submit to finish, and nothing else may run on the engine
 * between the two. */
pd_status pd_engine_submit(pd_engine *eng, const pd_batch *b, pd_err *e);
pd_status pd_engine_finish(pd_engine *eng, const pd_batch *b, float *logits, pd_err *e);
/* (pd_engine_forward and pd_engine_finish return PD_EBACKEND when the backend has failed:
 * pd_backend_status; a device fault is sticky, so the engine is unusable from then on.) */

/* The paged KV storage of one layer (backend memory) and its shape, e.g. to pack pages for
 * a transfer. */
pd_status pd_engine_kv(const pd_engine *eng, int layer, pd_kv_layer *kv, pd_kv_shape *shape,
                       pd_err *e);

/* Copies whole KV blocks src[i] -> dst[i] in every layer (copy-on-write). */
pd_status pd_engine_copy_blocks(pd_engine *eng, const int32_t *src, const int32_t *dst, int n,
                                pd_err *e);

#ifdef __cplusplus
}
#endif
#endif

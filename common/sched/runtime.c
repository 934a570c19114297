#include "pd/runtime.h"

#include <string.h>

void pd_runtime_opts_default(pd_runtime_opts *o) {
  memset(o, 0, sizeof *o);
  o->block_size = 16;
  o->kv_cache_mb = 512;
  o->max_batch_tokens = 2048;
  o->max_seqs = 256;
}

int pd_runtime_opts_table(pd_runtime_opts *o, pd_opt *out, int cap) {
  const pd_opt t[] = {
      {"threads", PD_OPT_INT, &o->threads, "N", "CPU threads (0 = all cores)", NULL},
      {"block-size", PD_OPT_INT, &o->block_size, "N", "tokens per KV block (16)", NULL},
      {"kv-cache-tokens", PD_OPT_INT, &o->kv_cache_tokens, "N",
       "KV cache capacity in tokens (default: from --kv-cache-mb)", NULL},
      {"kv-cache-mb", PD_OPT_INT, &o->kv_cache_mb, "MB", "KV cache budget in MiB (512)", NULL},
      {"max-batch-tokens", PD_OPT_INT, &o->max_batch_tokens, "N",
       "most tokens in one forward pass (2048)", NULL},
      {"max-seqs", PD_OPT_INT, &o->max_seqs, "N", "most sequences in one batch (256)", NULL},
      {"max-model-len", PD_OPT_INT, &o->max_model_len, "N",
       "longest context (default: the model's)", NULL},
      {"no-prefix-cache", PD_OPT_BOOL, &o->no_prefix_cache, NULL, "disable prefix caching",
       NULL},
  };
  int n = (int)(sizeof t / sizeof t[0]);
  if (n + 1 > cap) return -1;
  memcpy(out, t, sizeof t);
  memset(&out[n], 0, sizeof out[n]);
  return n;
}

pd_status pd_runtime_open(pd_runtime *rt, const pd_runtime_opts *o, pd_sched_event_fn on_event,
                          void *user, pd_err *e) {
  memset(rt, 0, sizeof *rt);
  if (!o->model_dir) return pd_err_set(e, PD_EINVAL, "no model folder given");
  if (o->block_size < 1 || o->block_size > 1024)
    return pd_err_set(e, PD_EINVAL, "--block-size must be in [1, 1024]");
  if (o->max_batch_tokens < 1 || o->max_seqs < 1 || o->kv_cache_tokens < 0 ||
      o->kv_cache_mb < 0 || o->max_model_len < 0 || o->threads < 0)
    return pd_err_set(e, PD_EINVAL,
                      "--max-batch-tokens and --max-seqs must be positive, the others not "
                      "negative");
  rt->model = pd_model_load(o->model_dir, NULL, e);
  if (!rt->model) return e ? e->code : PD_EINVAL;
  rt->tok = pd_tokenizer_load(o->model_dir, e);
  if (!rt->tok) goto fail;
  const pd_model_config *c = &rt->model->cfg;
  for (int i = 0; i < c->n_eos; i++) rt->eos[rt->n_eos++] = c->eos_token_ids[i];
  int32_t te = pd_tokenizer_eos_id(rt->tok);
  bool dup = te < 0;
  for (int i = 0; i < rt->n_eos; i++) dup |= rt->eos[i] == te;
  if (!dup) rt->eos[rt->n_eos++] = te;

  pd_backend_opts bo = {.n_threads = o->threads};
  rt->be = pd_backend_cpu_create(&bo, e);
  if (!rt->be) goto fail;
  int max_len = o->max_model_len ? o->max_model_len : c->max_position_embeddings;
  if (max_len > c->max_position_embeddings) {
    pd_err_set(e, PD_EINVAL, "--max-model-len %d exceeds the model's %d", max_len,
               c->max_position_embeddings);
    goto fail;
  }
  size_t block_bytes = pd_kv_block_bytes(c->num_layers, c->num_kv_heads, c->head_dim,
                                         o->block_size, PD_DTYPE_F32);
  int num_blocks = o->kv_cache_tokens
                       ? (o->kv_cache_tokens + o->block_size - 1) / o->block_size
                       : pd_kv_num_blocks_for_budget((size_t)o->kv_cache_mb << 20, block_bytes,
                                                     o->block_size);
  if (num_blocks < 1) {
    pd_err_set(e, PD_EINVAL, "the KV cache budget holds not even one block");
    goto fail;
  }
  pd_engine_opts eo;
  pd_engine_opts_default(&eo);
  eo.block_size = o->block_size;
  eo.num_blocks = num_blocks;
  eo.max_batch_tokens = o->max_batch_tokens;
  eo.max_seqs = o->max_seqs;
  eo.max_model_len = max_len;
  rt->eng = pd_engine_create(rt->model, rt->be, &eo, e);
  if (!rt->eng) goto fail;
  pd_kv_pool_opts po = {.num_blocks = num_blocks, .block_size = o->block_size,
                        .disable_prefix_caching = o->no_prefix_cache,
                        .salt = o->model_dir, .salt_len = strlen(o->model_dir)};
  rt->pool = pd_kv_pool_create(&po, e);
  if (!rt->pool) goto fail;
  pd_sched_opts so = {.eos_ids = rt->eos, .n_eos = rt->n_eos};
  rt->sched = pd_sched_create(rt->eng, rt->pool, &so, on_event, user, e);
  if (!rt->sched) goto fail;
  return PD_OK;
fail:
  pd_runtime_close(rt);
  return e && e->code ? e->code : PD_EINVAL;
}

void pd_runtime_close(pd_runtime *rt) {
  pd_sched_free(rt->sched);
  pd_kv_pool_free(rt->pool);
  pd_engine_free(rt->eng);
  if (rt->be) pd_backend_destroy(rt->be);
  pd_tokenizer_free(rt->tok);
  pd_model_free(rt->model);
  memset(rt, 0, sizeof *rt);
}

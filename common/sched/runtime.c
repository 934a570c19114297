#include "pd/runtime.h"

#include <stdlib.h>
#include <string.h>

#include "pd/backend_cuda.h"
#include "pd/pool.h"

void pd_runtime_opts_default(pd_runtime_opts *o) {
  memset(o, 0, sizeof *o);
  o->block_size = 16;
  o->kv_cache_mb = 512;
  o->max_batch_tokens = 2048;
  o->max_seqs = 256;
  o->device = "cpu";
  o->kv_cache_dtype = "auto";
  o->gpu_memory_utilization = 0.9;
  o->cpu_spin_us = PD_POOL_SPIN_US;
}

int pd_runtime_opts_table(pd_runtime_opts *o, pd_opt *out, int cap) {
  const pd_opt t[] = {
      {"device", PD_OPT_STR, &o->device, "DEV", "cpu (default) or cuda[:N]", NULL},
      {"threads", PD_OPT_INT, &o->threads, "N", "CPU threads (0 = all cores)", NULL},
      {"cpu-isa", PD_OPT_STR, &o->cpu_isa, "ISA",
       "CPU: at most this kernel family, avx512, avx2 or generic (default: the best the CPU "
       "has; output bits are the same only within one family; generic also keeps the "
       "sampler on SSE2)", NULL},
      {"cpu-spin-us", PD_OPT_INT, &o->cpu_spin_us, "US",
       "CPU: microseconds a worker thread spins for new work before it sleeps (300; 0 = sleep "
       "at once, for machines shared with other busy processes)", NULL},
      {"kv-cache-dtype", PD_OPT_STR, &o->kv_cache_dtype, "T",
       "auto (f32 on CPU, bf16 on GPU), f32, bf16, f16", NULL},
      {"gpu-memory-utilization", PD_OPT_DOUBLE, &o->gpu_memory_utilization, "F",
       "GPU: fraction of device memory for weights and KV cache (0.9)", NULL},
      {"block-size", PD_OPT_INT, &o->block_size, "N", "tokens per KV block (16)", NULL},
      {"kv-cache-tokens", PD_OPT_INT, &o->kv_cache_tokens, "N",
       "KV cache capacity in tokens (default: from --kv-cache-mb)", NULL},
      {"kv-cache-mb", PD_OPT_INT, &o->kv_cache_mb, "MB", "KV cache budget in MiB (512)", NULL},
      {"max-batch-tokens", PD_OPT_INT, &o->max_batch_tokens, "N",
       "most tokens in one forward pass (2048)", NULL},
      {"max-seqs", PD_OPT_INT, &o->max_seqs, "N", "most sequences in one batch (256)", NULL},
      {"max-model-len", PD_OPT_INT, &o->max_model_len, "N",
       "longest context (default: the model's)", NULL},
      {"decode-prefill-tokens", PD_OPT_INT, &o->decode_prefill_tokens, "N",
       "the most prompt tokens a step takes while sequences decode, so that prefill chunks keep "
       "decode steps short (0 = up to --max-batch-tokens, the default)",
       NULL},
      {"no-prefix-cache", PD_OPT_BOOL, &o->no_prefix_cache, NULL, "disable prefix caching",
       NULL},
      {"enforce-eager", PD_OPT_BOOL, &o->enforce_eager, NULL,
       "GPU: run every step op by op (no CUDA graphs)", NULL},
      {"no-device-sampling", PD_OPT_BOOL, &o->no_device_sampling, NULL,
       "GPU: sample on the host instead of the device", NULL},
      {"profile-gpu", PD_OPT_BOOL, &o->profile_gpu, NULL,
       "GPU: time every op and graph replay; the table goes to stderr at exit (with "
       "--enforce-eager: every op of a decode step)", NULL},
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
      o->kv_cache_mb < 0 || o->max_model_len < 0 || o->threads < 0 ||
      o->decode_prefill_tokens < 0 || o->cpu_spin_us < 0 || o->cpu_spin_us > 10000000)
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

  /* backend */
  bool gpu = false;
  pd_backend_opts bo = {.n_threads = o->threads, .profile = o->profile_gpu,
                        .cpu_isa = o->cpu_isa,
                        .cpu_spin_us = o->cpu_spin_us > 0 ? o->cpu_spin_us : -1};
  pd_sample_set_portable(o->cpu_isa && !strcmp(o->cpu_isa, "generic"));
  rt->be = pd_backend_open(o->device, &bo, &gpu, e);
  if (!rt->be) goto fail;
  pd_dtype kv_dt = gpu ? PD_DTYPE_BF16 : PD_DTYPE_F32;
  const char *kd = o->kv_cache_dtype ? o->kv_cache_dtype : "auto";
  if (!strcmp(kd, "f32")) kv_dt = PD_DTYPE_F32;
  else if (!strcmp(kd, "bf16")) kv_dt = PD_DTYPE_BF16;
  else if (!strcmp(kd, "f16")) kv_dt = PD_DTYPE_F16;
  else if (strcmp(kd, "auto") != 0) {
    pd_err_set(e, PD_EINVAL, "--kv-cache-dtype '%s': expected auto, f32, bf16 or f16", kd);
    goto fail;
  }
  int max_len = o->max_model_len ? o->max_model_len : c->max_position_embeddings;
  if (max_len > c->max_position_embeddings) {
    pd_err_set(e, PD_EINVAL, "--max-model-len %d exceeds the model's %d", max_len,
               c->max_position_embeddings);
    goto fail;
  }
  size_t block_bytes = pd_kv_block_bytes(c->num_layers, c->num_kv_heads, c->head_dim,
                                         o->block_size, kv_dt);
  size_t budget = (size_t)o->kv_cache_mb << 20;
  if (gpu && !o->kv_cache_tokens && rt->be->ops.mem_info) {
    /* --gpu-memory-utilization is this process's share of the device (vLLM's per-instance
     * rule): weights + activations + KV within utilization * total device memory, whatever
     * other processes on the device hold, so nodes sharing one GPU each take their share.
     * The share must fit in what is free now. */
    size_t free_b = 0, total_b = 0, weights = 0;
    rt->be->ops.mem_info(rt->be, &free_b, &total_b);
    for (size_t i = 0; i < pd_st_count(rt->model->st); i++) weights += pd_st_at(rt->model->st, i)->nbytes;
    size_t acts = (size_t)o->max_batch_tokens *
                  ((size_t)c->vocab_size + 10 * (size_t)c->hidden_size + 3 * (size_t)c->intermediate_size) *
                  sizeof(float);
    double fixed = (double)weights + (double)acts + (double)(256u << 20);
    double want = o->gpu_memory_utilization * (double)total_b - fixed;
    if (o->gpu_memory_utilization <= 0 || o->gpu_memory_utilization > 1 || want <= 0) {
      pd_err_set(e, PD_EINVAL,
                 "--gpu-memory-utilization %.2f leaves no room for the KV cache (%.1f GiB free, "
                 "%.1f GiB of weights)",
                 o->gpu_memory_utilization, free_b / 1073741824.0, weights / 1073741824.0);
      goto fail;
    }
    if (want > (double)free_b - fixed) {
      pd_err_set(e, PD_EINVAL,
                 "--gpu-memory-utilization %.2f asks for %.1f GiB but %.1f GiB of the device are "
                 "free (other processes hold the rest): lower it",
                 o->gpu_memory_utilization, o->gpu_memory_utilization * total_b / 1073741824.0,
                 free_b / 1073741824.0);
      goto fail;
    }
    budget = (size_t)want;
  }
  int num_blocks = o->kv_cache_tokens
                       ? (o->kv_cache_tokens + o->block_size - 1) / o->block_size
                       : pd_kv_num_blocks_for_budget(budget, block_bytes, o->block_size);
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
  eo.kv_dtype = kv_dt;
  eo.enforce_eager = o->enforce_eager;
  eo.no_device_sampling = o->no_device_sampling;
  rt->eng = pd_engine_create(rt->model, rt->be, &eo, e);
  if (!rt->eng) goto fail;
  pd_kv_pool_opts po = {.num_blocks = num_blocks, .block_size = o->block_size,
                        .disable_prefix_caching = o->no_prefix_cache,
                        .salt = o->model_dir, .salt_len = strlen(o->model_dir)};
  rt->pool = pd_kv_pool_create(&po, e);
  if (!rt->pool) goto fail;
  pd_sched_opts so = {.eos_ids = rt->eos, .n_eos = rt->n_eos,
                      .decode_prefill_tokens = o->decode_prefill_tokens};
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

#include "pd/runtime.h"

#include <stdio.h>
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
  o->decode_prefill_tokens = -1; /* the role's default */
  o->num_speculative_tokens = 4;
  o->speculative_adaptive = "on";
  o->ngram_min = 2;
  o->ngram_max = 4;
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
       "auto (f32 on CPU, bf16 on GPU), f32, bf16, f16, fp8 (e4m3 with the checkpoint's KV "
       "scales, else 1.0; CPU only)", NULL},
      {"quantization", PD_OPT_STR, &o->quantization, "M",
       "quantize a float checkpoint's linear layers at load: fp8 (per-channel e4m3 weights, "
       "dynamic per-token FP8 activations; default none)", NULL},
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
       "decode steps short (0 = up to --max-batch-tokens; default: 512 on unified nodes, 0 "
       "elsewhere)",
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
      {"speculative-model", PD_OPT_STR, &o->speculative_model, "DIR",
       "speculative decoding with this draft model (same tokenizer as the model)", NULL},
      {"speculative-method", PD_OPT_STR, &o->speculative_method, "M",
       "draft (the default with --speculative-model) or ngram (prompt lookup, no draft model)",
       NULL},
      {"num-speculative-tokens", PD_OPT_INT, &o->num_speculative_tokens, "K",
       "most tokens proposed per sequence and step (4; a maximum when adaptive)", NULL},
      {"speculative-adaptive", PD_OPT_STR, &o->speculative_adaptive, "on|off",
       "on (default): proposals per step follow the measured acceptance and step times, and "
       "stop where they would not pay; off: always K", NULL},
      {"ngram-min", PD_OPT_INT, &o->ngram_min, "N", "n-gram: shortest match (2)", NULL},
      {"ngram-max", PD_OPT_INT, &o->ngram_max, "N", "n-gram: longest match, tried first (4)",
       NULL},
  };
  int n = (int)(sizeof t / sizeof t[0]);
  if (n + 1 > cap) return -1;
  memcpy(out, t, sizeof t);
  memset(&out[n], 0, sizeof out[n]);
  return n;
}

pd_status pd_runtime_spec_config(const pd_runtime_opts *o, pd_spec_config *out, pd_err *e) {
  memset(out, 0, sizeof *out);
  const char *m = o->speculative_method;
  if (!m || !*m) m = o->speculative_model ? "draft" : "none";
  if (!strcmp(m, "draft")) {
    if (!o->speculative_model)
      return pd_err_set(e, PD_EINVAL, "--speculative-method draft needs --speculative-model DIR");
    out->method = PD_SPEC_DRAFT;
  } else if (!strcmp(m, "ngram")) {
    if (o->speculative_model)
      return pd_err_set(e, PD_EINVAL, "--speculative-method ngram takes no --speculative-model");
    out->method = PD_SPEC_NGRAM;
  } else if (!strcmp(m, "none")) {
    return PD_OK;
  } else {
    return pd_err_set(e, PD_EINVAL, "--speculative-method '%s': expected draft or ngram", m);
  }
  const char *ad = o->speculative_adaptive ? o->speculative_adaptive : "on";
  if (strcmp(ad, "on") && strcmp(ad, "off"))
    return pd_err_set(e, PD_EINVAL, "--speculative-adaptive '%s': expected on or off", ad);
  if (o->num_speculative_tokens < 1 || o->num_speculative_tokens > PD_SPEC_MAX_K)
    return pd_err_set(e, PD_EINVAL, "--num-speculative-tokens must be in [1, %d]", PD_SPEC_MAX_K);
  if (out->method == PD_SPEC_NGRAM && (o->ngram_min < 1 || o->ngram_max < o->ngram_min))
    return pd_err_set(e, PD_EINVAL, "--ngram-min and --ngram-max: need 1 <= min <= max");
  out->num_tokens = o->num_speculative_tokens;
  out->fixed = !strcmp(ad, "off");
  out->ngram_min = o->ngram_min;
  out->ngram_max = o->ngram_max;
  return PD_OK;
}

/* The draft must read and write the same token ids as the target: same vocabulary, every
 * token spelled the same, the same special tokens. */
static pd_status check_draft_tokenizer(const pd_tokenizer *t, const char *dir, pd_err *e) {
  pd_tokenizer *d = pd_tokenizer_load(dir, e);
  if (!d) return e && e->code ? e->code : PD_EINVAL;
  pd_status st = PD_OK;
  int V = pd_tokenizer_vocab_size(t);
  if (pd_tokenizer_vocab_size(d) != V) {
    st = pd_err_set(e, PD_EINVAL,
                    "--speculative-model %s: its tokenizer has %d tokens, the model's %d: a draft "
                    "must share the model's tokenizer",
                    dir, pd_tokenizer_vocab_size(d), V);
  }
  for (int32_t i = 0; st == PD_OK && i < V; i++) {
    const char *a = pd_tokenizer_id_to_token(t, i), *b = pd_tokenizer_id_to_token(d, i);
    if ((!a) != (!b) || (a && strcmp(a, b)) ||
        pd_tokenizer_is_special(t, i) != pd_tokenizer_is_special(d, i))
      st = pd_err_set(e, PD_EINVAL,
                      "--speculative-model %s: token %d differs from the model's ('%s' against "
                      "'%s'%s): a draft must share the model's tokenizer",
                      dir, i, b ? b : "(none)", a ? a : "(none)",
                      pd_tokenizer_is_special(t, i) != pd_tokenizer_is_special(d, i)
                          ? ", special in one only" : "");
  }
  if (st == PD_OK && (pd_tokenizer_eos_id(t) != pd_tokenizer_eos_id(d) ||
                      pd_tokenizer_bos_id(t) != pd_tokenizer_bos_id(d)))
    st = pd_err_set(e, PD_EINVAL,
                    "--speculative-model %s: its BOS/EOS tokens differ from the model's", dir);
  pd_tokenizer_free(d);
  return st;
}

pd_status pd_runtime_open(pd_runtime *rt, const pd_runtime_opts *o, pd_sched_event_fn on_event,
                          void *user, pd_err *e) {
  memset(rt, 0, sizeof *rt);
  if (!o->model_dir) return pd_err_set(e, PD_EINVAL, "no model folder given");
  if (o->block_size < 1 || o->block_size > 1024)
    return pd_err_set(e, PD_EINVAL, "--block-size must be in [1, 1024]");
  if (o->max_batch_tokens < 1 || o->max_seqs < 1 || o->kv_cache_tokens < 0 ||
      o->kv_cache_mb < 0 || o->max_model_len < 0 || o->threads < 0 ||
      o->decode_prefill_tokens < -1 || o->cpu_spin_us < 0 || o->cpu_spin_us > 10000000)
    return pd_err_set(e, PD_EINVAL,
                      "--max-batch-tokens and --max-seqs must be positive, the others not "
                      "negative");
  if (pd_runtime_spec_config(o, &rt->spec, e) != PD_OK) return e ? e->code : PD_EINVAL;
  pd_model_opts mo = {0};
  if (o->quantization && strcmp(o->quantization, "none") != 0) {
    if (strcmp(o->quantization, "fp8") != 0)
      return pd_err_set(e, PD_EINVAL, "--quantization '%s': expected none or fp8",
                        o->quantization);
    mo.quantize_fp8 = true;
  }
  rt->model = pd_model_load(o->model_dir, &mo, e);
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
  else if (!strcmp(kd, "fp8") || !strcmp(kd, "fp8_e4m3")) kv_dt = PD_DTYPE_F8_E4M3;
  else if (strcmp(kd, "auto") != 0) {
    pd_err_set(e, PD_EINVAL, "--kv-cache-dtype '%s': expected auto, f32, bf16, f16 or fp8", kd);
    goto fail;
  }
  if (kv_dt == PD_DTYPE_F8_E4M3 && !c->quant.kv_fp8_scales)
    fprintf(stderr, "pdserve: --kv-cache-dtype fp8: %s has no KV cache scales "
                    "(kv_cache_scheme); K and V are stored with scale 1.0\n", o->model_dir);
  int max_len = o->max_model_len ? o->max_model_len : c->max_position_embeddings;
  if (max_len > c->max_position_embeddings) {
    pd_err_set(e, PD_EINVAL, "--max-model-len %d exceeds the model's %d", max_len,
               c->max_position_embeddings);
    goto fail;
  }
  if (rt->spec.method == PD_SPEC_DRAFT) {
    if (check_draft_tokenizer(rt->tok, o->speculative_model, e) != PD_OK) goto fail;
    rt->draft_model = pd_model_load(o->speculative_model, NULL, e);
    if (!rt->draft_model) goto fail;
    const pd_model_config *dc = &rt->draft_model->cfg;
    if (dc->vocab_size != c->vocab_size) {
      pd_err_set(e, PD_EINVAL, "--speculative-model %s: vocab_size %d, the model's is %d",
                 o->speculative_model, dc->vocab_size, c->vocab_size);
      goto fail;
    }
    if (dc->max_position_embeddings < max_len) {
      pd_err_set(e, PD_EINVAL,
                 "--speculative-model %s: its context (%d) is shorter than the model's %d (set "
                 "--max-model-len)",
                 o->speculative_model, dc->max_position_embeddings, max_len);
      goto fail;
    }
  }
  size_t block_bytes = pd_kv_block_bytes(c->num_layers, c->num_kv_heads, c->head_dim,
                                         o->block_size, kv_dt);
  size_t draft_block_bytes = 0, draft_weights = 0;
  if (rt->draft_model) { /* the draft's KV shares the budget, block for block */
    const pd_model_config *dc = &rt->draft_model->cfg;
    draft_block_bytes = pd_kv_block_bytes(dc->num_layers, dc->num_kv_heads, dc->head_dim,
                                          o->block_size, kv_dt);
    for (size_t i = 0; i < pd_st_count(rt->draft_model->st); i++)
      draft_weights += pd_st_at(rt->draft_model->st, i)->nbytes;
  }
  size_t budget = (size_t)o->kv_cache_mb << 20;
  if (gpu && !o->kv_cache_tokens && rt->be->ops.mem_info) {
    /* --gpu-memory-utilization is this process's share of the device (vLLM's per-instance
     * rule): weights + activations + KV within utilization * total device memory, whatever
     * other processes on the device hold, so nodes sharing one GPU each take their share.
     * The share must fit in what is free now. */
    size_t free_b = 0, total_b = 0, weights = 0;
    rt->be->ops.mem_info(rt->be, &free_b, &total_b);
    for (size_t i = 0; i < pd_st_count(rt->model->st); i++) weights += pd_st_at(rt->model->st, i)->nbytes;
    const pd_dtype lw = rt->model->layers[0].wq.dtype;
    if (lw == PD_DTYPE_Q4 || lw == PD_DTYPE_F8W || lw == PD_DTYPE_F8WA || lw == PD_DTYPE_F8WS) {
      /* the repacked rows, and the bf16 copy of the largest quantized W that products above
       * the GEMV rows dequantize into (with the scratch's growth margin) */
      size_t big = 2 * (size_t)c->intermediate_size * (size_t)c->hidden_size;
      const size_t qkv = (size_t)(c->num_heads + 2 * c->num_kv_heads) * (size_t)c->head_dim *
                         (size_t)c->hidden_size;
      if (qkv > big) big = qkv;
      weights = pd_model_weight_bytes(rt->model) + big * 2 * 5 / 4;
    }
    size_t acts = (size_t)o->max_batch_tokens *
                  ((size_t)c->vocab_size + 10 * (size_t)c->hidden_size + 3 * (size_t)c->intermediate_size) *
                  sizeof(float);
    double fixed = (double)weights + (double)acts + (double)(256u << 20);
    if (rt->draft_model) /* its weights and activations (at most the model's) */
      fixed += (double)draft_weights + (double)acts + (double)(256u << 20);
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
                       : pd_kv_num_blocks_for_budget(budget, block_bytes + draft_block_bytes,
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
  if (rt->spec.method == PD_SPEC_DRAFT) {
    /* the draft: an engine with the target's limits and a block pool with as many blocks
     * (each much smaller) */
    /* On the CPU the draft shares the model's backend (its thread pool: the two never run
     * at once, and two pools would spin against each other on the same cores); a GPU draft
     * gets a backend of its own (its own graphs and scratch). */
    if (gpu) {
      rt->draft_be = pd_backend_open(o->device, &bo, &gpu, e);
      if (!rt->draft_be) goto fail;
    }
    pd_engine_opts de = eo; /* (device sampling: greedy proposals are drawn there) */
    rt->draft_eng =
        pd_engine_create(rt->draft_model, rt->draft_be ? rt->draft_be : rt->be, &de, e);
    if (!rt->draft_eng) goto fail;
    pd_kv_pool_opts dpo = po;
    dpo.salt = o->speculative_model;
    dpo.salt_len = strlen(o->speculative_model);
    rt->draft_pool = pd_kv_pool_create(&dpo, e);
    if (!rt->draft_pool) goto fail;
    rt->spec.draft = rt->draft_eng;
    rt->spec.draft_pool = rt->draft_pool;
  }
  pd_sched_opts so = {.eos_ids = rt->eos, .n_eos = rt->n_eos,
                      .decode_prefill_tokens = o->decode_prefill_tokens > 0 ? o->decode_prefill_tokens : 0,
                      .spec = rt->spec.method != PD_SPEC_NONE ? &rt->spec : NULL,
                      .draft_prefill = o->draft_prefill};
  rt->sched = pd_sched_create(rt->eng, rt->pool, &so, on_event, user, e);
  if (!rt->sched) goto fail;
  return PD_OK;
fail:
  pd_runtime_close(rt);
  return e && e->code ? e->code : PD_EINVAL;
}

void pd_runtime_close(pd_runtime *rt) {
  pd_sched_free(rt->sched);
  pd_kv_pool_free(rt->draft_pool);
  pd_engine_free(rt->draft_eng);
  if (rt->draft_be) pd_backend_destroy(rt->draft_be);
  pd_model_free(rt->draft_model);
  pd_kv_pool_free(rt->pool);
  pd_engine_free(rt->eng);
  if (rt->be) pd_backend_destroy(rt->be);
  pd_tokenizer_free(rt->tok);
  pd_model_free(rt->model);
  memset(rt, 0, sizeof *rt);
}

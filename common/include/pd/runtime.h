/* Everything one process needs to run a model: weights, tokenizer, backend, engine, KV block
 * pool and scheduler, built from one set of options (pdctl's offline mode and the nodes). */
#ifndef PD_RUNTIME_H
#define PD_RUNTIME_H

#include "pd/engine.h"
#include "pd/kvcache.h"
#include "pd/model.h"
#include "pd/opts.h"
#include "pd/sched.h"
#include "pd/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_runtime_opts {
  const char *model_dir;
  const char *device;   /* "cpu" (default) or "cuda", "cuda:N" */
  const char *kv_cache_dtype; /* "auto" (f32 on the CPU, bf16 on GPUs), "f32", "bf16", "f16", "fp8" */
  const char *quantization;   /* NULL / "none", or "fp8": the linear layers quantized at load */
  double gpu_memory_utilization; /* GPU: fraction of device memory for weights + KV (0.9) */
  int threads;          /* CPU threads, 0 = all cores */
  const char *cpu_isa;  /* CPU kernel family cap: avx512, avx2, generic; NULL = the best */
  int cpu_spin_us;      /* CPU workers' spin before sleeping (300; 0 = sleep at once) */
  int block_size;       /* 16 */
  int kv_cache_tokens;  /* KV capacity in tokens; 0 = derive from kv_cache_mb */
  int kv_cache_mb;      /* CPU: KV budget in MiB when kv_cache_tokens is 0 (default 512) */
  int max_batch_tokens; /* 2048 */
  int max_seqs;         /* 256 */
  int max_model_len;    /* 0 = the model's */
  int decode_prefill_tokens; /* prompt tokens a step takes while sequences decode; 0 = up to
                                max_batch_tokens; -1 (default) = the role's default: 0, but
                                PD_UNIFIED_DECODE_PREFILL_TOKENS on unified nodes */
  bool no_prefix_cache;
  bool enforce_eager;   /* GPU: no graph replay of steps */
  bool no_device_sampling; /* GPU: sample on the host (copies every logits row back) */
  bool profile_gpu;        /* GPU: per-op timers, reported to stderr at exit (--profile-gpu) */
  /* speculative decoding */
  const char *speculative_model;  /* draft model folder (--speculative-model) */
  const char *speculative_method; /* "draft" (with a model), "ngram"; NULL = by the model */
  int num_speculative_tokens;     /* k, the most proposals per step (4) */
  const char *speculative_adaptive; /* "on" (default) or "off": fixed k */
  int ngram_min, ngram_max;       /* n-gram match lengths (2, 4) */
  /* not a flag: prompts run through the draft model too (pd_sched_opts.draft_prefill; prefill
   * nodes, which ship the draft's KV with the model's) */
  bool draft_prefill;
} pd_runtime_opts;

/* A unified node's default cap on prompt tokens per step while sequences decode: at 1,024-token
 * prompts on one H100 it keeps the p99 time between tokens within 1.1x of its median at every
 * concurrency (6x uncapped at 64) for 8-10% of output throughput at 128-256 (docs/cluster.md). */
#define PD_UNIFIED_DECODE_PREFILL_TOKENS 512

void pd_runtime_opts_default(pd_runtime_opts *o);
/* The flags above as a pd_opt table fragment (terminated by {0}); dst fields point into o.
 * --block-size --kv-cache-tokens --kv-cache-mb --max-batch-tokens --max-seqs
 * --max-model-len --no-prefix-cache --threads. Copy them into a command's own table. */
int pd_runtime_opts_table(pd_runtime_opts *o, pd_opt *out, int cap);

typedef struct pd_runtime {
  pd_model *model;
  pd_tokenizer *tok;
  pd_backend *be;
  pd_engine *eng;
  pd_kv_pool *pool;
  pd_sched *sched;
  int32_t eos[PD_MAX_EOS + 1];
  int n_eos;
  /* speculative decoding (spec.method PD_SPEC_NONE: off); the draft method's own model,
   * backend, engine and block pool */
  pd_spec_config spec;
  pd_model *draft_model;
  pd_backend *draft_be;
  pd_engine *draft_eng;
  pd_kv_pool *draft_pool;
} pd_runtime;

/* Resolves the speculative options into *out (method NONE when off) without loading
 * anything; PD_EINVAL with a message for a bad combination. */
pd_status pd_runtime_spec_config(const pd_runtime_opts *o, pd_spec_config *out, pd_err *e);

pd_status pd_runtime_open(pd_runtime *rt, const pd_runtime_opts *o, pd_sched_event_fn on_event,
                          void *user, pd_err *e);
void pd_runtime_close(pd_runtime *rt);

#ifdef __cplusplus
}
#endif
#endif

/* pdctl make-model: writes a Hugging Face model folder with the published shapes of a known
 * model (config.json as published, sharded *.safetensors with model.safetensors.index.json,
 * tokenizer, generation_config.json) and random weights, for benchmarks and tests.
 *
 * Weights: matrices N(0, sigma) with sigma = min(0.02, 2 / sqrt(fan_in)) (0.02 is the models'
 * initializer_range; the cap keeps every projection's output RMS at most ~2 for unit-RMS input
 * however wide the model), biases N(0, 0.02), RMSNorm weights 1. Normal deviates come from a
 * ziggurat (Marsaglia & Tsang) over xoshiro256+, rounded to bf16/f16 to nearest even. Every
 * 64Ki-element block of a tensor has its own generator seeded from (--seed, tensor name, block
 * index), so the bytes do not depend on the thread count, the shard layout or the number of
 * layers: --layers 2 gives the first two layers of the full model.
 *
 * Generation runs on a pool of threads into one of two large buffers while the calling thread
 * writes the other to the file (pd_stw, big write(2) calls), so the disk and the cores are busy
 * together. See docs/make-model.md. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pd/model.h"
#include "pd/st_write.h"
#include "pd/tokenizer.h"
#include "pdctl.h"

extern char **environ;

#define MM_BLOCK ((uint64_t)1 << 16)      /* elements per independently seeded RNG block */
#define MM_CHUNK_BYTES ((size_t)64 << 20) /* one generation buffer (two are used) */
#define MM_MAX_THREADS 256
#define MM_N_SPECIAL 3 /* synthetic tokenizer: <|endoftext|>, <|im_start|>, <|im_end|> */
#define MM_MAX_SYNTH_VOCAB (1 << 22)

/* ---- messages ------------------------------------------------------------------------------ */

/* Prints "pdctl make-model: <msg>" and returns 1 (self-contained so that tests can link this
 * file without pdctl.c). */
static int mm_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int mm_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pdctl make-model: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return 1;
}

static double mm_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- presets: the published configs -------------------------------------------------------- */

typedef enum mm_family { MM_LLAMA, MM_QWEN2, MM_MISTRAL } mm_family;

typedef struct mm_preset {
  const char *name, *published; /* --like name; the Hugging Face repository it copies */
  mm_family family;
  int hidden, ffn, layers, heads, kv_heads, vocab, max_pos;
  double rope_theta, eps;
  bool tied;
  int sliding_window; /* Mistral: 4096; Qwen2: the published (unused) 131072 */
  const char *tokenizer; /* under the data dir: a folder with tokenizer.json[.xz] */
  int bos, eos;          /* published ids (-1 = null) when that tokenizer is used */
} mm_preset;

static const mm_preset mm_presets[] = {
    {"llama3-8b", "meta-llama/Meta-Llama-3-8B", MM_LLAMA, 4096, 14336, 32, 32, 8, 128256, 8192,
     500000.0, 1e-5, false, 0, "tokenizers/llama3", 128000, 128001},
    {"llama3-70b", "meta-llama/Meta-Llama-3-70B", MM_LLAMA, 8192, 28672, 80, 64, 8, 128256, 8192,
     500000.0, 1e-5, false, 0, "tokenizers/llama3", 128000, 128001},
    {"qwen2-7b", "Qwen/Qwen2-7B", MM_QWEN2, 3584, 18944, 28, 28, 4, 152064, 131072, 1000000.0,
     1e-6, false, 131072, "tokenizers/qwen3", 151643, 151643},
    {"llama2-7b", "meta-llama/Llama-2-7b-hf", MM_LLAMA, 4096, 11008, 32, 32, 32, 32000, 4096,
     10000.0, 1e-5, false, 0, "tokenizers/llama2", 1, 2},
    {"mistral-7b", "mistralai/Mistral-7B-v0.1", MM_MISTRAL, 4096, 14336, 32, 32, 8, 32000, 32768,
     10000.0, 1e-5, false, 4096, "tokenizers/llama2", 1, 2},
    {"pycoder-12m", "tests/data/models/pycoder-12m", MM_LLAMA, 384, 1024, 6, 6, 2, 4096, 2048,
     10000.0, 1e-5, false, 0, "models/pycoder-12m", -1, 0},
};
#define MM_N_PRESETS (sizeof mm_presets / sizeof mm_presets[0])

/* ---- the model being made ------------------------------------------------------------------ */

/* NORMAL: std * N(0, 1); ONES: 1; BITS: uniform random 32-bit words (4-bit values); WORD: the
 * 32-bit word `word` everywhere (packed zero points); CONST: the value std (scales); GIDX: element
 * i holds i / word (GPTQ's g_idx without act-order). */
typedef enum mm_init {
  MM_INIT_NORMAL,
  MM_INIT_ONES,
  MM_INIT_BITS,
  MM_INIT_WORD,
  MM_INIT_CONST,
  MM_INIT_GIDX,
  MM_INIT_FP8
} mm_init;

/* --quantization: the published 4-bit layouts, and compressed-tensors FP8 (docs/quantization.md) */
typedef enum mm_quant { MM_Q_NONE, MM_Q_AWQ, MM_Q_GPTQ, MM_Q_FP8 } mm_quant;

typedef struct mm_tensor {
  char name[96];
  int ndim;
  int64_t shape[2];
  uint64_t numel, nbytes;
  mm_init init;
  float std;
  pd_dtype dt;   /* its dtype: the model's, or I32 / F16 for quantized tensors */
  uint32_t word; /* MM_INIT_WORD's word, MM_INIT_GIDX's group size */
  uint64_t name_hash; /* part of every block's seed */
  int shard;
} mm_tensor;

typedef struct mm_model {
  const mm_preset *p;
  int hidden, ffn, layers, heads, kv_heads, head_dim, vocab;
  bool head_dim_explicit;
  pd_dtype dtype;
  mm_quant quant;
  int group; /* quantization group size */
  uint64_t seed;
  mm_tensor *t;
  size_t n_t;
  int n_shards;
  uint64_t params, data_bytes;
  uint64_t *shard_bytes; /* [n_shards] tensor bytes per shard */
} mm_model;

static uint64_t mm_fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

static float mm_sigma(int64_t fan_in) {
  float cap = (float)(2.0 / sqrt((double)fan_in));
  return cap < 0.02f ? cap : 0.02f;
}

static int mm_push(mm_model *m, mm_init init, float std, int64_t rows, int64_t cols,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int mm_push(mm_model *m, mm_init init, float std, int64_t rows, int64_t cols,
                   const char *fmt, ...) {
  mm_tensor *t = &m->t[m->n_t++];
  memset(t, 0, sizeof *t);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->name, sizeof t->name, fmt, ap);
  va_end(ap);
  t->ndim = cols ? 2 : 1;
  t->shape[0] = rows;
  t->shape[1] = cols;
  t->numel = (uint64_t)rows * (uint64_t)(cols ? cols : 1);
  t->dt = m->dtype;
  t->nbytes = t->numel * pd_dtype_size(m->dtype);
  t->init = init;
  t->std = std;
  t->name_hash = mm_fnv1a(t->name);
  m->params += t->numel;
  m->data_bytes += t->nbytes;
  return 0;
}

/* The last tensor pushed, made a quantized one of dtype dt. */
static void mm_retype(mm_model *m, pd_dtype dt, mm_init init, float v, uint32_t word) {
  mm_tensor *t = &m->t[m->n_t - 1];
  m->data_bytes -= t->nbytes;
  m->params -= t->numel; /* (the layer's parameters are counted by mm_linear) */
  t->dt = dt;
  t->init = init;
  t->std = v;
  t->word = word;
  t->nbytes = t->numel * pd_dtype_size(dt);
  m->data_bytes += t->nbytes;
}

/* A linear layer name ([out, in], normal with std sd): its `.weight`, or the 4-bit tensors of
 * the model's quantization with values uniform in 0..15 around the zero point 8 and scales
 * making the weights' standard deviation about sd (that of q - 8 is about 4.61). */
static void mm_linear(mm_model *m, float sd, int64_t out, int64_t in, const char *name) {
  if (m->quant == MM_Q_NONE) {
    mm_push(m, MM_INIT_NORMAL, sd, out, in, "%s.weight", name);
    return;
  }
  if (m->quant == MM_Q_FP8) { /* llm-compressor FP8_DYNAMIC: e4m3 values of N(0, 16^2), a
                                 * per-channel bf16 scale sd / 16 */
    mm_push(m, MM_INIT_NORMAL, 0, out, in, "%s.weight", name);
    mm_retype(m, PD_DTYPE_F8_E4M3, MM_INIT_FP8, 16.0f, 0);
    mm_push(m, MM_INIT_NORMAL, 0, out, 1, "%s.weight_scale", name);
    mm_retype(m, PD_DTYPE_BF16, MM_INIT_CONST, sd / 16.0f, 0);
    m->params += (uint64_t)out * (uint64_t)in;
    return;
  }
  const int64_t g = m->group, ng = in / g;
  const float scale = pd_f16_to_f32(pd_f32_to_f16(sd / 4.61f));
  if (m->quant == MM_Q_AWQ) {
    mm_push(m, MM_INIT_NORMAL, 0, in, out / 8, "%s.qweight", name);
    mm_retype(m, PD_DTYPE_I32, MM_INIT_BITS, 0, 0);
    mm_push(m, MM_INIT_NORMAL, 0, ng, out / 8, "%s.qzeros", name);
    mm_retype(m, PD_DTYPE_I32, MM_INIT_WORD, 0, 0x88888888u);
    mm_push(m, MM_INIT_NORMAL, 0, ng, out, "%s.scales", name);
    mm_retype(m, PD_DTYPE_F16, MM_INIT_CONST, scale, 0);
  } else { /* GPTQ, checkpoint_format gptq: zeros stored as z - 1 */
    mm_push(m, MM_INIT_NORMAL, 0, in, 0, "%s.g_idx", name);
    mm_retype(m, PD_DTYPE_I32, MM_INIT_GIDX, 0, (uint32_t)g);
    mm_push(m, MM_INIT_NORMAL, 0, in / 8, out, "%s.qweight", name);
    mm_retype(m, PD_DTYPE_I32, MM_INIT_BITS, 0, 0);
    mm_push(m, MM_INIT_NORMAL, 0, ng, out / 8, "%s.qzeros", name);
    mm_retype(m, PD_DTYPE_I32, MM_INIT_WORD, 0, 0x77777777u);
    mm_push(m, MM_INIT_NORMAL, 0, ng, out, "%s.scales", name);
    mm_retype(m, PD_DTYPE_F16, MM_INIT_CONST, scale, 0);
  }
  m->params += (uint64_t)out * (uint64_t)in; /* (the packed tensors counted elements above) */
}

/* Lists the tensors in the order of transformers' state dict (embeddings, layer by layer,
 * final norm, lm_head) and assigns shards the way save_pretrained does: a new shard starts
 * when the next tensor would push the current one past max_shard bytes. */
static int mm_plan(mm_model *m, uint64_t max_shard) {
  const int64_t D = m->hidden, F = m->ffn, V = m->vocab;
  const int64_t Q = (int64_t)m->heads * m->head_dim, KV = (int64_t)m->kv_heads * m->head_dim;
  const bool bias = m->p->family == MM_QWEN2;
  size_t cap = 3 + (size_t)m->layers * 40;
  m->t = calloc(cap, sizeof *m->t);
  if (!m->t) return -1;
  m->n_t = 0;
  m->params = m->data_bytes = 0;
  mm_push(m, MM_INIT_NORMAL, 0.02f, V, D, "model.embed_tokens.weight");
  for (int l = 0; l < m->layers; l++) {
    const char *pre = "model.layers";
    char n[96];
#define LIN(sd, out, in, fmt)                       \
    do {                                            \
      snprintf(n, sizeof n, fmt, pre, l);           \
      mm_linear(m, sd, out, in, n);                 \
    } while (0)
    LIN(mm_sigma(D), Q, D, "%s.%d.self_attn.q_proj");
    if (bias) mm_push(m, MM_INIT_NORMAL, 0.02f, Q, 0, "%s.%d.self_attn.q_proj.bias", pre, l);
    LIN(mm_sigma(D), KV, D, "%s.%d.self_attn.k_proj");
    if (bias) mm_push(m, MM_INIT_NORMAL, 0.02f, KV, 0, "%s.%d.self_attn.k_proj.bias", pre, l);
    LIN(mm_sigma(D), KV, D, "%s.%d.self_attn.v_proj");
    if (bias) mm_push(m, MM_INIT_NORMAL, 0.02f, KV, 0, "%s.%d.self_attn.v_proj.bias", pre, l);
    LIN(mm_sigma(Q), D, Q, "%s.%d.self_attn.o_proj");
    LIN(mm_sigma(D), F, D, "%s.%d.mlp.gate_proj");
    LIN(mm_sigma(D), F, D, "%s.%d.mlp.up_proj");
    LIN(mm_sigma(F), D, F, "%s.%d.mlp.down_proj");
#undef LIN
    mm_push(m, MM_INIT_ONES, 0, D, 0, "%s.%d.input_layernorm.weight", pre, l);
    mm_push(m, MM_INIT_ONES, 0, D, 0, "%s.%d.post_attention_layernorm.weight", pre, l);
  }
  mm_push(m, MM_INIT_ONES, 0, D, 0, "model.norm.weight");
  if (!m->p->tied) mm_push(m, MM_INIT_NORMAL, mm_sigma(D), V, D, "lm_head.weight");

  int shard = 0;
  uint64_t cur = 0;
  for (size_t i = 0; i < m->n_t; i++) {
    if (cur > 0 && cur + m->t[i].nbytes > max_shard) {
      shard++;
      cur = 0;
    }
    m->t[i].shard = shard;
    cur += m->t[i].nbytes;
  }
  m->n_shards = shard + 1;
  m->shard_bytes = calloc((size_t)m->n_shards, sizeof *m->shard_bytes);
  if (!m->shard_bytes) return -1;
  for (size_t i = 0; i < m->n_t; i++) m->shard_bytes[m->t[i].shard] += m->t[i].nbytes;
  return 0;
}

static void mm_shard_name(const mm_model *m, int s, char *buf, size_t n) {
  if (m->n_shards == 1) snprintf(buf, n, "model.safetensors");
  else snprintf(buf, n, "model-%05d-of-%05d.safetensors", s + 1, m->n_shards);
}

/* ---- random numbers ------------------------------------------------------------------------ */

static uint64_t mm_splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef struct mm_rng {
  uint64_t s[4];
} mm_rng; /* xoshiro256+ (Blackman & Vigna): the upper bits are what we use */

static inline uint64_t mm_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t mm_next(mm_rng *r) {
  uint64_t *s = r->s;
  const uint64_t res = s[0] + s[3], t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = mm_rotl(s[3], 45);
  return res;
}

static void mm_seed(mm_rng *r, uint64_t seed, uint64_t name_hash, uint64_t block) {
  uint64_t x = seed;
  x = mm_splitmix(&x) ^ name_hash;
  x = mm_splitmix(&x) ^ block;
  for (int i = 0; i < 4; i++) r->s[i] = mm_splitmix(&x);
}

/* Uniform in (0, 1): never 0, so log() is safe. */
static inline double mm_uni(mm_rng *r) { return ((double)(mm_next(r) >> 11) + 0.5) * 0x1p-53; }

/* Ziggurat tables for the standard normal, 128 layers (Marsaglia & Tsang 2000). */
static uint32_t zig_k[128];
static float zig_w[128], zig_f[128];
static pthread_once_t zig_once = PTHREAD_ONCE_INIT;
#define ZIG_R 3.442619855899

static void zig_init(void) {
  const double m1 = 2147483648.0, vn = 9.91256303526217e-3;
  double dn = ZIG_R, tn = dn;
  const double q = vn / exp(-0.5 * dn * dn);
  zig_k[0] = (uint32_t)((dn / q) * m1);
  zig_k[1] = 0;
  zig_w[0] = (float)(q / m1);
  zig_w[127] = (float)(dn / m1);
  zig_f[0] = 1.0f;
  zig_f[127] = (float)exp(-0.5 * dn * dn);
  for (int i = 126; i >= 1; i--) {
    dn = sqrt(-2.0 * log(vn / dn + exp(-0.5 * dn * dn)));
    zig_k[i + 1] = (uint32_t)((dn / tn) * m1);
    tn = dn;
    zig_f[i] = (float)exp(-0.5 * dn * dn);
    zig_w[i] = (float)(dn / m1);
  }
}

/* One N(0, 1) deviate. ~98.8% of calls take the first branch: one 64-bit draw, a compare
 * and a multiply. The layer index and the signed 32-bit abscissa use disjoint bits. */
static inline float mm_normal(mm_rng *r) {
  for (;;) {
    const uint64_t u = mm_next(r);
    const int32_t hz = (int32_t)(uint32_t)(u >> 32);
    const uint32_t iz = (uint32_t)(u >> 25) & 127u;
    const uint32_t a = hz < 0 ? 0u - (uint32_t)hz : (uint32_t)hz;
    const float x = (float)hz * zig_w[iz];
    if (a < zig_k[iz]) return x;
    if (iz == 0) { /* the tail beyond R */
      double tx, ty;
      do {
        tx = -log(mm_uni(r)) / ZIG_R;
        ty = -log(mm_uni(r));
      } while (ty + ty < tx * tx);
      return (float)(hz > 0 ? ZIG_R + tx : -(ZIG_R + tx));
    }
    if (zig_f[iz] + (float)mm_uni(r) * (zig_f[iz - 1] - zig_f[iz]) < expf(-0.5f * x * x)) return x;
  }
}

/* Fills elements [e0, e0 + n) of tensor t (e0 a multiple of MM_BLOCK) into dst. */
static void mm_fill(const mm_tensor *t, pd_dtype dt, uint64_t seed, uint64_t e0, uint64_t n,
                    void *dst) {
  mm_rng r;
  mm_seed(&r, seed, t->name_hash, e0 / MM_BLOCK); /* cheap; unused for MM_INIT_ONES */
  const float sd = t->std;
  switch (t->init) { /* the quantized tensors' kinds */
    case MM_INIT_BITS:
      for (uint64_t i = 0; i < n; i++) ((uint32_t *)dst)[i] = (uint32_t)(mm_next(&r) >> 32);
      return;
    case MM_INIT_WORD:
      for (uint64_t i = 0; i < n; i++) ((uint32_t *)dst)[i] = t->word;
      return;
    case MM_INIT_GIDX:
      for (uint64_t i = 0; i < n; i++) ((int32_t *)dst)[i] = (int32_t)((e0 + i) / t->word);
      return;
    case MM_INIT_CONST: /* f16 (4-bit scales) or bf16 (FP8 scales) */
      for (uint64_t i = 0; i < n; i++)
        ((uint16_t *)dst)[i] = t->dt == PD_DTYPE_BF16 ? pd_f32_to_bf16(sd) : pd_f32_to_f16(sd);
      return;
    case MM_INIT_FP8:
      for (uint64_t i = 0; i < n; i++) ((uint8_t *)dst)[i] = pd_f32_to_e4m3(sd * mm_normal(&r));
      return;
    default:
      break;
  }
  switch (dt) {
    case PD_DTYPE_BF16: {
      uint16_t *o = dst;
      if (t->init == MM_INIT_ONES)
        for (uint64_t i = 0; i < n; i++) o[i] = 0x3f80;
      else
        for (uint64_t i = 0; i < n; i++) o[i] = pd_f32_to_bf16(sd * mm_normal(&r));
      break;
    }
    case PD_DTYPE_F16: {
      uint16_t *o = dst;
      if (t->init == MM_INIT_ONES)
        for (uint64_t i = 0; i < n; i++) o[i] = 0x3c00;
      else
        for (uint64_t i = 0; i < n; i++) o[i] = pd_f32_to_f16(sd * mm_normal(&r));
      break;
    }
    default: {
      float *o = dst;
      if (t->init == MM_INIT_ONES)
        for (uint64_t i = 0; i < n; i++) o[i] = 1.0f;
      else
        for (uint64_t i = 0; i < n; i++) o[i] = sd * mm_normal(&r);
      break;
    }
  }
}

/* ---- generation thread pool ---------------------------------------------------------------- */

typedef struct mm_job {
  const mm_tensor *t;
  pd_dtype dtype;
  uint64_t seed, e0, n; /* elements [e0, e0 + n) of t, e0 a multiple of MM_BLOCK */
  char *dst;
} mm_job;

typedef struct mm_pool {
  pthread_t th[MM_MAX_THREADS];
  int n;
  pthread_mutex_t mu;
  pthread_cond_t cv_work, cv_done;
  uint64_t gen; /* incremented per job; every worker takes part in every job */
  int active;   /* workers still on the current job */
  bool quit;
  mm_job job;
  atomic_uint_fast64_t next_block;
} mm_pool;

static void *mm_worker(void *arg) {
  mm_pool *p = arg;
  uint64_t seen = 0;
  for (;;) {
    pthread_mutex_lock(&p->mu);
    while (p->gen == seen && !p->quit) pthread_cond_wait(&p->cv_work, &p->mu);
    if (p->quit) {
      pthread_mutex_unlock(&p->mu);
      return NULL;
    }
    seen = p->gen;
    const mm_job j = p->job;
    pthread_mutex_unlock(&p->mu);
    const uint64_t nb = (j.n + MM_BLOCK - 1) / MM_BLOCK, es = pd_dtype_size(j.t->dt);
    for (;;) {
      uint64_t b = atomic_fetch_add(&p->next_block, 1);
      if (b >= nb) break;
      uint64_t off = b * MM_BLOCK, cnt = j.n - off < MM_BLOCK ? j.n - off : MM_BLOCK;
      mm_fill(j.t, j.t->dt, j.seed, j.e0 + off, cnt, j.dst + off * es);
    }
    pthread_mutex_lock(&p->mu);
    if (--p->active == 0) pthread_cond_signal(&p->cv_done);
    pthread_mutex_unlock(&p->mu);
  }
}

static int mm_pool_start(mm_pool *p, int n) {
  memset(p, 0, sizeof *p);
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv_work, NULL);
  pthread_cond_init(&p->cv_done, NULL);
  atomic_init(&p->next_block, 0);
  for (p->n = 0; p->n < n; p->n++)
    if (pthread_create(&p->th[p->n], NULL, mm_worker, p) != 0) break;
  return p->n > 0 ? 0 : -1;
}

static void mm_pool_submit(mm_pool *p, const mm_job *j) {
  pthread_mutex_lock(&p->mu);
  PD_ASSERT(p->active == 0);
  p->job = *j;
  atomic_store(&p->next_block, 0);
  p->active = p->n;
  p->gen++;
  pthread_cond_broadcast(&p->cv_work);
  pthread_mutex_unlock(&p->mu);
}

static void mm_pool_wait(mm_pool *p) {
  pthread_mutex_lock(&p->mu);
  while (p->active) pthread_cond_wait(&p->cv_done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}

static void mm_pool_stop(mm_pool *p) {
  pthread_mutex_lock(&p->mu);
  p->quit = true;
  pthread_cond_broadcast(&p->cv_work);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n; i++) pthread_join(p->th[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv_work);
  pthread_cond_destroy(&p->cv_done);
}

/* ---- writing the shards -------------------------------------------------------------------- */

/* One piece of work: up to one buffer of one tensor. */
typedef struct mm_piece {
  const mm_tensor *t;
  uint64_t e0, n;
} mm_piece;

/* Writes shard s: header, then every tensor's bytes, generated a buffer at a time by the pool
 * while the previous buffer is being written. */
static pd_status mm_write_shard(const mm_model *m, int s, const char *path, mm_pool *pool,
                                char *buf[2], uint64_t chunk_elems, bool sync, pd_err *e) {
  pd_stw *w = pd_stw_new(e);
  if (!w) return PD_ENOMEM;
  pd_status st = pd_stw_set_metadata(w, "format", "pt", e); /* transformers requires it */
  for (size_t i = 0; i < m->n_t && !st; i++)
    if (m->t[i].shard == s)
      st = pd_stw_add(w, m->t[i].name, m->t[i].dt, m->t[i].ndim, m->t[i].shape, e);
  if (!st) st = pd_stw_begin(w, path, e);
  mm_piece pending = {0};
  int cur = 0;
  for (size_t i = 0; i < m->n_t && !st; i++) {
    if (m->t[i].shard != s) continue;
    for (uint64_t e0 = 0; e0 < m->t[i].numel && !st; e0 += chunk_elems) {
      const uint64_t left = m->t[i].numel - e0;
      mm_piece pc = {&m->t[i], e0, left < chunk_elems ? left : chunk_elems};
      mm_job j = {pc.t, m->dtype, m->seed, pc.e0, pc.n, buf[cur]};
      mm_pool_submit(pool, &j); /* generate this piece ... */
      if (pending.t) /* ... write the last */
        st = pd_stw_write(w, buf[cur ^ 1], pending.n * pd_dtype_size(pending.t->dt), e);
      mm_pool_wait(pool);
      pending = pc;
      cur ^= 1;
    }
  }
  if (!st && pending.t)
    st = pd_stw_write(w, buf[cur ^ 1], pending.n * pd_dtype_size(pending.t->dt), e);
  if (!st) st = pd_stw_finish(w, sync, e);
  pd_stw_free(w);
  return st;
}

/* ---- JSON output --------------------------------------------------------------------------- */

/* A finite double as Python's repr writes it: the shortest digits that read back exactly,
 * positional for decimal exponents in [-4, 16) (with ".0" on integral values), else
 * scientific ("1e-05", "1e+16"). */
static void mm_pyfloat(double d, char *buf, size_t n) {
  int p = 1;
  for (; p < 17; p++) {
    snprintf(buf, n, "%.*e", p - 1, d);
    if (strtod(buf, NULL) == d) break;
  }
  int x = atoi(strchr(buf, 'e') + 1); /* decimal exponent of the shortest form */
  if (x >= -4 && x < 16) {
    snprintf(buf, n, "%.*f", p - 1 - x > 0 ? p - 1 - x : 0, d);
    if (!strchr(buf, '.')) strncat(buf, ".0", n - strlen(buf) - 1);
  }
}

static void mm_add_float(cJSON *o, const char *key, double d) {
  char b[40];
  mm_pyfloat(d, b, sizeof b);
  cJSON_AddRawToObject(o, key, b);
}

static void mm_json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

/* Pretty-prints like Python's json.dump(indent=2). */
static void mm_json_print(FILE *f, const cJSON *j, int ind) {
  if (cJSON_IsNull(j)) fputs("null", f);
  else if (cJSON_IsFalse(j)) fputs("false", f);
  else if (cJSON_IsTrue(j)) fputs("true", f);
  else if (cJSON_IsRaw(j)) fputs(j->valuestring, f);
  else if (cJSON_IsString(j)) mm_json_str(f, j->valuestring);
  else if (cJSON_IsNumber(j)) {
    double d = j->valuedouble;
    if (d == floor(d) && fabs(d) < 1e15) fprintf(f, "%.0f", d);
    else {
      char b[40];
      mm_pyfloat(d, b, sizeof b);
      fputs(b, f);
    }
  } else {
    bool obj = cJSON_IsObject(j);
    if (!j->child) {
      fputs(obj ? "{}" : "[]", f);
      return;
    }
    fputc(obj ? '{' : '[', f);
    for (const cJSON *c = j->child; c; c = c->next) {
      fprintf(f, "\n%*s", 2 * (ind + 1), "");
      if (obj) {
        mm_json_str(f, c->string);
        fputs(": ", f);
      }
      mm_json_print(f, c, ind + 1);
      if (c->next) fputc(',', f);
    }
    fprintf(f, "\n%*s%c", 2 * ind, "", obj ? '}' : ']');
  }
}

static int mm_cmp_keys(const void *a, const void *b) {
  return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* Sorts an object's keys (as json.dump(sort_keys=True), which transformers uses). */
static void mm_json_sort(cJSON *o) {
  int n = cJSON_GetArraySize(o);
  if (n < 2) return;
  cJSON **v = malloc((size_t)n * sizeof *v);
  if (!v) return; /* unsorted is still valid JSON */
  int i = 0;
  for (cJSON *c = o->child; c; c = c->next) v[i++] = c;
  qsort(v, (size_t)n, sizeof *v, mm_cmp_keys);
  for (i = 0; i < n; i++) {
    v[i]->prev = i ? v[i - 1] : v[n - 1]; /* cJSON: child->prev is the last element */
    v[i]->next = i + 1 < n ? v[i + 1] : NULL;
  }
  o->child = v[0];
  free(v);
}

static pd_status mm_write_json(const char *dir, const char *name, cJSON *j, pd_err *e) {
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  if (!j) return pd_err_set(e, PD_ENOMEM, "out of memory building %s", name);
  FILE *f = fopen(path, "w");
  if (!f) return pd_err_set(e, PD_EIO, "%s: cannot create: %s", path, strerror(errno));
  mm_json_print(f, j, 0);
  fputc('\n', f);
  bool bad = ferror(f) != 0;
  if (fclose(f) != 0) bad = true;
  return bad ? pd_err_set(e, PD_EIO, "%s: write failed", path) : PD_OK;
}

/* ---- files --------------------------------------------------------------------------------- */

static pd_status mm_mkdirs(const char *dir, pd_err *e) {
  char p[4096];
  if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
    return pd_err_set(e, PD_EINVAL, "--out path too long");
  for (char *s = p + 1;; s++) {
    if (*s != '/' && *s) continue;
    char c = *s;
    *s = 0;
    if (mkdir(p, 0755) != 0 && errno != EEXIST)
      return pd_err_set(e, PD_EIO, "%s: cannot create directory: %s", p, strerror(errno));
    *s = c;
    if (!c) break;
  }
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
    return pd_err_set(e, PD_EIO, "%s: not a directory", dir);
  return PD_OK;
}

/* The files a model folder holds, which a new model replaces. */
static bool mm_is_model_file(const char *n) {
  static const char *exact[] = {"config.json", "generation_config.json", "tokenizer.json",
                                "tokenizer_config.json", "chat_template.jinja",
                                "special_tokens_map.json", "make_model.json", "model.safetensors",
                                "model.safetensors.index.json", "model.safetensors.tmp"};
  for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
    if (!strcmp(n, exact[i])) return true;
  return fnmatch("model-*-of-*.safetensors", n, 0) == 0 ||
         fnmatch("model-*-of-*.safetensors.tmp", n, 0) == 0;
}

/* Refuses a folder that already holds a model unless force, in which case those files go. */
static pd_status mm_prepare_dir(const char *dir, bool force, pd_err *e) {
  pd_status st = mm_mkdirs(dir, e);
  if (st) return st;
  DIR *d = opendir(dir);
  if (!d) return pd_err_set(e, PD_EIO, "%s: %s", dir, strerror(errno));
  struct dirent *de;
  while ((de = readdir(d)) && !st) {
    if (!mm_is_model_file(de->d_name)) continue;
    if (!force) {
      st = pd_err_set(e, PD_EINVAL, "%s already holds a model (%s); pass --force to replace it",
                      dir, de->d_name);
      break;
    }
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    if (unlink(path) != 0)
      st = pd_err_set(e, PD_EIO, "%s: cannot remove: %s", path, strerror(errno));
  }
  closedir(d);
  return st;
}

static pd_status mm_copy_file(const char *src, const char *dst, pd_err *e) {
  int in = open(src, O_RDONLY | O_CLOEXEC);
  if (in < 0) return pd_err_set(e, PD_EIO, "%s: %s", src, strerror(errno));
  int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) {
    close(in);
    return pd_err_set(e, PD_EIO, "%s: cannot create: %s", dst, strerror(errno));
  }
  static const size_t cap = 1 << 20;
  char *buf = malloc(cap);
  pd_status st = buf ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
  while (!st) {
    ssize_t r = read(in, buf, cap);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) st = pd_err_set(e, PD_EIO, "%s: read failed: %s", src, strerror(errno));
    if (r <= 0) break;
    for (ssize_t o = 0; o < r && !st;) {
      ssize_t k = write(out, buf + o, (size_t)(r - o));
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) st = pd_err_set(e, PD_EIO, "%s: write failed: %s", dst, strerror(errno));
      else o += k;
    }
  }
  free(buf);
  close(in);
  if (close(out) != 0 && !st) st = pd_err_set(e, PD_EIO, "%s: close failed", dst);
  return st;
}

/* Runs `xz -dc -- src` with its output going to dst (no shell is involved). */
static pd_status mm_unxz(const char *src, const char *dst, pd_err *e) {
  int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0) return pd_err_set(e, PD_EIO, "%s: cannot create: %s", dst, strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out, STDOUT_FILENO);
  char *argv[] = {"xz", "-dc", "--", (char *)src, NULL};
  pid_t pid;
  int rc = posix_spawnp(&pid, "xz", &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(out);
  if (rc != 0) return pd_err_set(e, PD_EIO, "cannot run xz to unpack %s: %s", src, strerror(rc));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return pd_err_set(e, PD_EIO, "waitpid: %s", strerror(errno));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    return pd_err_set(e, PD_EIO, "xz -dc %s failed (status %d)", src,
                      WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return PD_OK;
}

static bool mm_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Copies a tokenizer folder: tokenizer.json (or tokenizer.json.xz, unpacked), and
 * tokenizer_config.json and chat_template.jinja when present. */
static pd_status mm_copy_tokenizer(const char *src, const char *out, pd_err *e) {
  char a[4200], b[4200];
  snprintf(b, sizeof b, "%s/tokenizer.json", out);
  snprintf(a, sizeof a, "%s/tokenizer.json", src);
  pd_status st;
  if (mm_exists(a)) {
    st = mm_copy_file(a, b, e);
  } else {
    snprintf(a, sizeof a, "%s/tokenizer.json.xz", src);
    if (!mm_exists(a))
      return pd_err_set(e, PD_ENOTFOUND, "%s has no tokenizer.json or tokenizer.json.xz", src);
    st = mm_unxz(a, b, e);
  }
  static const char *extra[] = {"tokenizer_config.json", "chat_template.jinja"};
  for (size_t i = 0; i < 2 && !st; i++) {
    snprintf(a, sizeof a, "%s/%s", src, extra[i]);
    snprintf(b, sizeof b, "%s/%s", out, extra[i]);
    if (mm_exists(a)) st = mm_copy_file(a, b, e);
  }
  return st;
}

static void mm_remove_tokenizer(const char *out) {
  static const char *names[] = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"};
  char p[4200];
  for (size_t i = 0; i < 3; i++) {
    snprintf(p, sizeof p, "%s/%s", out, names[i]);
    unlink(p);
  }
}

/* ---- synthetic byte-level BPE tokenizer ---------------------------------------------------- */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others are
 * moved to U+0100.. so that every byte is one visible character. cp[b] is byte b's character,
 * order[i] the byte with id i (the order GPT-2 and Llama 3 give their byte tokens). */
static void mm_byte_chars(uint32_t cp[256], uint8_t order[256]) {
  int k = 0, extra = 0;
  bool printable[256] = {false};
  for (int b = '!'; b <= '~'; b++) printable[b] = true;
  for (int b = 0xa1; b <= 0xac; b++) printable[b] = true;
  for (int b = 0xae; b <= 0xff; b++) printable[b] = true;
  for (int b = 0; b < 256; b++)
    if (printable[b]) {
      cp[b] = (uint32_t)b;
      order[k++] = (uint8_t)b;
    }
  for (int b = 0; b < 256; b++)
    if (!printable[b]) {
      cp[b] = 256u + (uint32_t)extra++;
      order[k++] = (uint8_t)b;
    }
}

/* What a token's bytes are, for growing plausible tokens (word pieces, digit groups, runs of
 * spaces or newlines, punctuation) the way the Llama 3 pre-tokenizer splits text. */
typedef enum mm_tk_kind {
  TK_LETTERS, TK_SP_LETTERS, TK_DIGITS, TK_SPACES, TK_NEWLINES, TK_TABS, TK_PUNCT, TK_SP_PUNCT,
  TK_OTHER
} mm_tk_kind;

typedef struct mm_tk {
  uint32_t off, len; /* bytes in the raw arena */
  uint8_t kind;
} mm_tk;

static mm_tk_kind mm_byte_kind(unsigned char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return TK_LETTERS;
  if (c >= '0' && c <= '9') return TK_DIGITS;
  if (c == ' ') return TK_SPACES;
  if (c == '\n') return TK_NEWLINES;
  if (c == '\t') return TK_TABS;
  if (c > ' ' && c < 0x7f) return TK_PUNCT;
  return TK_OTHER;
}

/* The kind of token t + c, or -1 when that token is not worth having. */
static int mm_grow(const mm_tk *t, unsigned char c) {
  mm_tk_kind k = mm_byte_kind(c);
  switch ((mm_tk_kind)t->kind) {
    case TK_LETTERS: return k == TK_LETTERS && t->len < 16 ? TK_LETTERS : -1;
    case TK_SP_LETTERS: return k == TK_LETTERS && t->len < 16 ? TK_SP_LETTERS : -1;
    case TK_DIGITS: return k == TK_DIGITS && t->len < 3 ? TK_DIGITS : -1;
    case TK_SPACES:
      if (k == TK_SPACES) return t->len < 16 ? TK_SPACES : -1;
      if (t->len != 1) return -1;
      return k == TK_LETTERS ? TK_SP_LETTERS : k == TK_PUNCT ? TK_SP_PUNCT : -1;
    case TK_NEWLINES: return k == TK_NEWLINES && t->len < 4 ? TK_NEWLINES : -1;
    case TK_TABS: return k == TK_TABS && t->len < 4 ? TK_TABS : -1;
    case TK_PUNCT: return k == TK_PUNCT && t->len < 3 ? TK_PUNCT : -1;
    case TK_SP_PUNCT: return k == TK_PUNCT && t->len < 3 ? TK_SP_PUNCT : -1;
    default: return -1;
  }
}

/* Writes the byte-level form of raw bytes p[0..n) as a JSON string body. */
static void mm_put_bytes(FILE *f, const uint32_t cp[256], const unsigned char *p, uint32_t n) {
  fputc('"', f);
  for (uint32_t i = 0; i < n; i++) {
    uint32_t c = cp[p[i]];
    if (c == '"' || c == '\\') fprintf(f, "\\%c", (char)c);
    else if (c < 0x80) fputc((int)c, f);
    else { /* all byte characters are below U+0800 */
      fputc((int)(0xc0 | (c >> 6)), f);
      fputc((int)(0x80 | (c & 0x3f)), f);
    }
  }
  fputc('"', f);
}

/* tokenizer.json with exactly `vocab` ids: 256 byte tokens (ids 0..255), vocab - 259 merges
 * grown breadth-first from characters ranked by English frequency (ids 256..), and the special
 * tokens <|endoftext|>, <|im_start|>, <|im_end|> (the last three ids). The pre-tokenizer,
 * post-processor and decoder are Llama 3's byte-level ones. Also tokenizer_config.json and a
 * ChatML chat_template.jinja. */
static pd_status mm_write_synthetic_tokenizer(const char *dir, int vocab, int max_pos, pd_err *e) {
  if (vocab < 256 + MM_N_SPECIAL || vocab > MM_MAX_SYNTH_VOCAB)
    return pd_err_set(e, PD_ERANGE, "a generated tokenizer needs --vocab in [%d, %d]",
                      256 + MM_N_SPECIAL, MM_MAX_SYNTH_VOCAB);
  static const char rank[] =
      " etaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVKXJQZ0123456789\n.,-'\"()_:;/=!?*#[]{}<>+&%$"
      "@|\\^`~\t";
  const size_t n_rank = sizeof rank - 1;
  uint32_t cp[256];
  uint8_t order[256];
  mm_byte_chars(cp, order);
  const size_t n_merges = (size_t)vocab - 256 - MM_N_SPECIAL;
  const size_t n_tok = 256 + n_merges;
  mm_tk *tk = malloc(n_tok * sizeof *tk);
  uint32_t *left = malloc((n_merges ? n_merges : 1) * sizeof *left);
  uint8_t *right = malloc(n_merges ? n_merges : 1);
  size_t arena_cap = 1 << 16, arena_n = 0;
  unsigned char *arena = malloc(arena_cap);
  uint32_t byte_id[256];
  if (!tk || !left || !right || !arena) {
    free(tk), free(left), free(right), free(arena);
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  for (int i = 0; i < 256; i++) {
    tk[i] = (mm_tk){(uint32_t)arena_n, 1, (uint8_t)mm_byte_kind(order[i])};
    arena[arena_n++] = order[i];
    byte_id[order[i]] = (uint32_t)i;
  }
  /* Breadth first: the queue is the token list itself, from the ranked characters on; a new
   * token is an existing one plus one character, so every merge joins two existing tokens and
   * every token string is distinct. */
  size_t n = 256, q_rank = 0, q = 0;
  bool oom = false;
  while (n < n_tok && !oom) {
    uint32_t t;
    if (q_rank < n_rank) t = byte_id[(unsigned char)rank[q_rank++]];
    else if (q < n - 256) t = (uint32_t)(256 + q++);
    else break; /* cannot happen: letters alone grow without bound up to 16 bytes */
    for (size_t r = 0; r < n_rank && n < n_tok; r++) {
      unsigned char c = (unsigned char)rank[r];
      int k = mm_grow(&tk[t], c);
      if (k < 0) continue;
      if (arena_n + tk[t].len + 1 > arena_cap) {
        unsigned char *a = realloc(arena, arena_cap * 2);
        if (!a) {
          oom = true;
          break;
        }
        arena = a;
        arena_cap *= 2;
      }
      memcpy(arena + arena_n, arena + tk[t].off, tk[t].len); /* arena may have moved: copy now */
      arena[arena_n + tk[t].len] = c;
      tk[n] = (mm_tk){(uint32_t)arena_n, tk[t].len + 1, (uint8_t)k};
      arena_n += tk[t].len + 1;
      left[n - 256] = t;
      right[n - 256] = c;
      n++;
    }
  }
  pd_status st = PD_OK;
  if (oom) st = pd_err_set(e, PD_ENOMEM, "out of memory");
  else if (n < n_tok) st = pd_err_set(e, PD_ERANGE, "cannot grow %zu merges", n_merges);
  char path[4200];
  snprintf(path, sizeof path, "%s/tokenizer.json", dir);
  FILE *f = st ? NULL : fopen(path, "w");
  if (!st && !f) st = pd_err_set(e, PD_EIO, "%s: cannot create: %s", path, strerror(errno));
  if (f) {
    static const char *specials[MM_N_SPECIAL] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    fputs("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
          "  \"added_tokens\": [",
          f);
    for (int i = 0; i < MM_N_SPECIAL; i++)
      fprintf(f,
              "%s\n    {\"id\": %d, \"content\": \"%s\", \"single_word\": false, "
              "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}",
              i ? "," : "", vocab - MM_N_SPECIAL + i, specials[i]);
    fputs("\n  ],\n  \"normalizer\": null,\n"
          "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
          "\"pattern\": {\"Regex\": \"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?"
          "\\\\p{L}+|\\\\p{N}{1,3}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|"
          "\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": "
          "\"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": "
          "false}]},\n"
          "  \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
          "\"trim_offsets\": false, \"use_regex\": true},\n"
          "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": "
          "true, \"use_regex\": true},\n"
          "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n"
          "    \"unk_token\": null,\n"
          "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n"
          "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n"
          "    \"vocab\": {",
          f);
    for (size_t i = 0; i < n_tok; i++) {
      fputs(i ? ",\n      " : "\n      ", f);
      mm_put_bytes(f, cp, arena + tk[i].off, tk[i].len);
      fprintf(f, ": %zu", i);
    }
    fputs("\n    },\n    \"merges\": [", f);
    for (size_t i = 0; i < n_merges; i++) {
      const mm_tk *l = &tk[left[i]];
      fputs(i ? ",\n      [" : "\n      [", f);
      mm_put_bytes(f, cp, arena + l->off, l->len);
      fputs(", ", f);
      mm_put_bytes(f, cp, &right[i], 1);
      fputc(']', f);
    }
    fputs("\n    ]\n  }\n}\n", f);
    bool bad = ferror(f) != 0;
    if (fclose(f) != 0 || bad) st = pd_err_set(e, PD_EIO, "%s: write failed", path);
  }
  free(tk), free(left), free(right), free(arena);
  if (st) return st;

  cJSON *c = cJSON_CreateObject();
  cJSON_AddBoolToObject(c, "add_bos_token", false);
  cJSON_AddBoolToObject(c, "add_eos_token", false);
  cJSON_AddNullToObject(c, "bos_token");
  cJSON_AddBoolToObject(c, "clean_up_tokenization_spaces", false);
  cJSON_AddStringToObject(c, "eos_token", "<|endoftext|>");
  cJSON_AddNumberToObject(c, "model_max_length", max_pos);
  cJSON_AddStringToObject(c, "pad_token", "<|endoftext|>");
  cJSON_AddStringToObject(c, "tokenizer_class", "PreTrainedTokenizerFast");
  cJSON_AddNullToObject(c, "unk_token");
  st = mm_write_json(dir, "tokenizer_config.json", c, e);
  cJSON_Delete(c);
  if (st) return st;
  static const char chatml[] =
      "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
      "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant\\n' }}{% endif %}";
  snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
  f = fopen(path, "w");
  if (!f) return pd_err_set(e, PD_EIO, "%s: cannot create: %s", path, strerror(errno));
  bool bad = fputs(chatml, f) < 0;
  if (fclose(f) != 0 || bad) return pd_err_set(e, PD_EIO, "%s: write failed", path);
  return PD_OK;
}

/* ---- config files -------------------------------------------------------------------------- */

static const char *mm_torch_dtype(pd_dtype d) {
  return d == PD_DTYPE_F32 ? "float32" : d == PD_DTYPE_F16 ? "float16" : "bfloat16";
}

static void mm_add_id(cJSON *o, const char *key, const int *ids, int n) {
  if (n == 0 || (n == 1 && ids[0] < 0)) cJSON_AddNullToObject(o, key);
  else if (n == 1) cJSON_AddNumberToObject(o, key, ids[0]);
  else cJSON_AddItemToObject(o, key, cJSON_CreateIntArray(ids, n));
}

/* config.json with the fields of the published file (legacy "rope_theta" / "torch_dtype"
 * spelling, which every transformers version reads), dimensions as made. */
static cJSON *mm_config_json(const mm_model *m, int bos, const int *eos, int n_eos) {
  const mm_preset *p = m->p;
  static const char *arch[] = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"};
  static const char *type[] = {"llama", "qwen2", "mistral"};
  cJSON *c = cJSON_CreateObject();
  if (!c) return NULL;
  cJSON *a = cJSON_AddArrayToObject(c, "architectures");
  if (a) cJSON_AddItemToArray(a, cJSON_CreateString(arch[p->family]));
  mm_add_float(c, "attention_dropout", 0.0);
  mm_add_id(c, "bos_token_id", &bos, 1);
  mm_add_id(c, "eos_token_id", eos, n_eos);
  cJSON_AddStringToObject(c, "hidden_act", "silu");
  cJSON_AddNumberToObject(c, "hidden_size", m->hidden);
  mm_add_float(c, "initializer_range", 0.02);
  cJSON_AddNumberToObject(c, "intermediate_size", m->ffn);
  cJSON_AddNumberToObject(c, "max_position_embeddings", p->max_pos);
  cJSON_AddStringToObject(c, "model_type", type[p->family]);
  cJSON_AddNumberToObject(c, "num_attention_heads", m->heads);
  cJSON_AddNumberToObject(c, "num_hidden_layers", m->layers);
  cJSON_AddNumberToObject(c, "num_key_value_heads", m->kv_heads);
  if (m->head_dim_explicit || m->head_dim * m->heads != m->hidden)
    cJSON_AddNumberToObject(c, "head_dim", m->head_dim);
  mm_add_float(c, "rms_norm_eps", p->eps);
  mm_add_float(c, "rope_theta", p->rope_theta);
  cJSON_AddBoolToObject(c, "tie_word_embeddings", p->tied);
  cJSON_AddStringToObject(c, "torch_dtype", mm_torch_dtype(m->dtype));
  cJSON_AddBoolToObject(c, "use_cache", true);
  cJSON_AddNumberToObject(c, "vocab_size", m->vocab);
  if (m->quant == MM_Q_FP8) { /* as llm-compressor writes its FP8_DYNAMIC scheme */
    cJSON *q = cJSON_AddObjectToObject(c, "quantization_config");
    cJSON *g = cJSON_AddObjectToObject(cJSON_AddObjectToObject(q, "config_groups"), "group_0");
    cJSON_AddStringToObject(g, "format", "float-quantized");
    cJSON *in = cJSON_AddObjectToObject(g, "input_activations");
    cJSON_AddBoolToObject(in, "dynamic", true);
    cJSON_AddNumberToObject(in, "num_bits", 8);
    cJSON_AddStringToObject(in, "strategy", "token");
    cJSON_AddBoolToObject(in, "symmetric", true);
    cJSON_AddStringToObject(in, "type", "float");
    cJSON_AddItemToObject(g, "targets", cJSON_CreateStringArray((const char *[]){"Linear"}, 1));
    cJSON *w = cJSON_AddObjectToObject(g, "weights");
    cJSON_AddBoolToObject(w, "dynamic", false);
    cJSON_AddNumberToObject(w, "num_bits", 8);
    cJSON_AddStringToObject(w, "strategy", "channel");
    cJSON_AddBoolToObject(w, "symmetric", true);
    cJSON_AddStringToObject(w, "type", "float");
    cJSON_AddStringToObject(q, "format", "float-quantized");
    cJSON_AddItemToObject(q, "ignore", cJSON_CreateStringArray((const char *[]){"lm_head"}, 1));
    cJSON_AddNullToObject(q, "kv_cache_scheme");
    cJSON_AddStringToObject(q, "quant_method", "compressed-tensors");
    cJSON_AddStringToObject(q, "quantization_status", "compressed");
  } else if (m->quant != MM_Q_NONE) { /* as AutoAWQ and GPTQModel write it */
    cJSON *q = cJSON_AddObjectToObject(c, "quantization_config");
    cJSON_AddNumberToObject(q, "bits", 4);
    cJSON_AddNumberToObject(q, "group_size", m->group);
    if (m->quant == MM_Q_AWQ) {
      cJSON_AddNullToObject(q, "modules_to_not_convert");
      cJSON_AddStringToObject(q, "quant_method", "awq");
      cJSON_AddStringToObject(q, "version", "gemm");
      cJSON_AddBoolToObject(q, "zero_point", true);
    } else {
      cJSON_AddStringToObject(q, "checkpoint_format", "gptq");
      cJSON_AddBoolToObject(q, "desc_act", false);
      cJSON_AddStringToObject(q, "quant_method", "gptq");
      cJSON_AddBoolToObject(q, "sym", true);
    }
  }
  switch (p->family) {
    case MM_LLAMA:
      cJSON_AddBoolToObject(c, "attention_bias", false);
      cJSON_AddBoolToObject(c, "mlp_bias", false);
      cJSON_AddNumberToObject(c, "pretraining_tp", 1);
      cJSON_AddNullToObject(c, "rope_scaling");
      break;
    case MM_QWEN2: /* Qwen2-7B: sliding window declared but off */
      cJSON_AddNumberToObject(c, "max_window_layers", m->layers < 28 ? m->layers : 28);
      cJSON_AddNumberToObject(c, "sliding_window", p->sliding_window);
      cJSON_AddBoolToObject(c, "use_sliding_window", false);
      break;
    case MM_MISTRAL:
      cJSON_AddNumberToObject(c, "sliding_window", p->sliding_window);
      break;
  }
  mm_json_sort(c);
  return c;
}

static cJSON *mm_generation_json(int bos, const int *eos, int n_eos, int pad) {
  cJSON *g = cJSON_CreateObject();
  if (!g) return NULL;
  if (bos >= 0) cJSON_AddNumberToObject(g, "bos_token_id", bos);
  mm_add_id(g, "eos_token_id", eos, n_eos);
  if (pad >= 0) cJSON_AddNumberToObject(g, "pad_token_id", pad);
  return g;
}

static int mm_cmp_weight(const void *a, const void *b) {
  return strcmp(((const mm_tensor *)a)->name, ((const mm_tensor *)b)->name);
}

/* model.safetensors.index.json: total tensor bytes and parameters, tensor -> shard file. */
static cJSON *mm_index_json(const mm_model *m) {
  mm_tensor *sorted = malloc(m->n_t * sizeof *sorted);
  cJSON *root = cJSON_CreateObject();
  if (!sorted || !root) {
    free(sorted);
    cJSON_Delete(root);
    return NULL;
  }
  memcpy(sorted, m->t, m->n_t * sizeof *sorted);
  qsort(sorted, m->n_t, sizeof *sorted, mm_cmp_weight);
  cJSON *meta = cJSON_AddObjectToObject(root, "metadata");
  if (meta) {
    cJSON_AddNumberToObject(meta, "total_parameters", (double)m->params);
    cJSON_AddNumberToObject(meta, "total_size", (double)m->data_bytes);
  }
  cJSON *map = cJSON_AddObjectToObject(root, "weight_map");
  char file[64];
  for (size_t i = 0; map && i < m->n_t; i++) {
    mm_shard_name(m, sorted[i].shard, file, sizeof file);
    cJSON_AddStringToObject(map, sorted[i].name, file);
  }
  free(sorted);
  return root;
}

/* ---- command line -------------------------------------------------------------------------- */

/* "5GB", "500MB", "2GiB", "123": bytes (decimal units as transformers' max_shard_size). */
static int mm_parse_size(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || !(v > 0)) return -1;
  static const struct {
    const char *suf;
    double mul;
  } units[] = {{"", 1},       {"B", 1},          {"KB", 1e3},        {"MB", 1e6},
               {"GB", 1e9},   {"TB", 1e12},      {"KiB", 1024.0},    {"MiB", 1048576.0},
               {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
    if (strcasecmp(end, units[i].suf) == 0) {
      double b = v * units[i].mul;
      if (b < 1 || b > 1e18) return -1;
      *out = (uint64_t)b;
      return 0;
    }
  return -1;
}

/* The folder that holds tokenizers/ and models/ (the repository's tests/data): --data-dir,
 * else the source tree this file was compiled from, else a tests/data above the executable. */
static bool mm_find_data_dir(const char *given, char *out, size_t n) {
  struct stat sb;
  if (given && given[0]) {
    snprintf(out, n, "%s", given);
    return stat(out, &sb) == 0 && S_ISDIR(sb.st_mode);
  }
  const char *src = __FILE__, *slash = strrchr(src, '/');
  if (src[0] == '/' && slash) {
    /* <repo>/tools/cmd_make_model.c -> <repo>/tests/data */
    const char *tools = slash;
    while (tools > src && tools[-1] != '/') tools--;
    if (tools > src && snprintf(out, n, "%.*stests/data", (int)(tools - src), src) < (int)n &&
        stat(out, &sb) == 0 && S_ISDIR(sb.st_mode))
      return true;
  }
  char exe[4096];
  ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (k <= 0) return false;
  exe[k] = 0;
  for (int up = 0; up < 5; up++) {
    char *s = strrchr(exe, '/');
    if (!s || s == exe) break;
    *s = 0;
    if (snprintf(out, n, "%s/tests/data", exe) < (int)n && stat(out, &sb) == 0 &&
        S_ISDIR(sb.st_mode))
      return true;
  }
  return false;
}

static void mm_usage(FILE *f, const pd_opt *opts) {
  fputs("usage: pdctl make-model --like NAME --out DIR [options]\n\n"
        "Writes a Hugging Face model folder with the published shapes of NAME and random\n"
        "weights (config.json, sharded *.safetensors + model.safetensors.index.json,\n"
        "tokenizer, generation_config.json). NAME is one of:\n",
        f);
  for (size_t i = 0; i < MM_N_PRESETS; i++) {
    const mm_preset *p = &mm_presets[i];
    fprintf(f, "  %-12s %-32s hidden %d, %d layers, %d/%d heads, ffn %d, vocab %d\n", p->name,
            p->published, p->hidden, p->layers, p->heads, p->kv_heads, p->ffn, p->vocab);
  }
  fputs("\noptions:\n", f);
  pd_opts_usage(f, opts);
}

static const char *mm_human(double bytes, char *buf, size_t n) {
  if (bytes >= 1e9) snprintf(buf, n, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) snprintf(buf, n, "%.1f MB", bytes / 1e6);
  else snprintf(buf, n, "%.1f kB", bytes / 1e3);
  return buf;
}

int cmd_make_model(int argc, char **argv) {
  const char *quant_s = NULL;
  int group = 128;
  const char *like = NULL, *out = NULL, *dtype_s = "bf16", *shard_s = "5GB", *tok_s = "auto",
             *data_dir = NULL;
  /* INT_MIN: not given (the option parser never produces it) */
  int layers = INT_MIN, vocab = INT_MIN, hidden = INT_MIN, ffn = INT_MIN, heads = INT_MIN,
      kv_heads = INT_MIN, head_dim = INT_MIN, threads = 0;
  unsigned long long seed = 0;
  bool force = false, dry_run = false, sync = false, help = false;
  const pd_opt opts[] = {
      {"like", PD_OPT_STR, &like, "NAME", "published model whose shapes to copy (see above)", NULL},
      {"out", PD_OPT_STR, &out, "DIR", "output folder (created; see --force)", NULL},
      {"layers", PD_OPT_INT, &layers, "N", "num_hidden_layers (default: the published count)",
       NULL},
      {"vocab", PD_OPT_INT, &vocab, "N", "vocab_size", NULL},
      {"hidden", PD_OPT_INT, &hidden, "N", "hidden_size (for small test models)", NULL},
      {"ffn", PD_OPT_INT, &ffn, "N", "intermediate_size", NULL},
      {"heads", PD_OPT_INT, &heads, "N", "num_attention_heads", NULL},
      {"kv-heads", PD_OPT_INT, &kv_heads, "N", "num_key_value_heads", NULL},
      {"head-dim", PD_OPT_INT, &head_dim, "N", "head_dim (default hidden / heads)", NULL},
      {"dtype", PD_OPT_STR, &dtype_s, "T", "bf16 (default), f16 or f32", NULL},
      {"quantization", PD_OPT_STR, &quant_s, "M",
       "quantized linear layers in a published layout: awq (AutoAWQ gemm, 4-bit), gptq (4-bit) "
       "or fp8 (compressed-tensors FP8_DYNAMIC); embeddings, norms and lm_head stay in --dtype",
       NULL},
      {"group-size", PD_OPT_INT, &group, "G", "quantization group size (128)", NULL},
      {"seed", PD_OPT_U64, &seed, "S", "random seed (default 0)", NULL},
      {"threads", PD_OPT_INT, &threads, "N", "generator threads (default: all cores)", NULL},
      {"max-shard-size", PD_OPT_STR, &shard_s, "SIZE", "largest shard, e.g. 5GB (default), 500MB",
       NULL},
      {"tokenizer", PD_OPT_STR, &tok_s, "auto|synthetic|DIR",
       "auto: the real tokenizer when the vocab is the published one, else a generated one", NULL},
      {"data-dir", PD_OPT_STR, &data_dir, "DIR",
       "where real tokenizers are found (default: the source tree's tests/data)", NULL},
      {"force", PD_OPT_BOOL, &force, NULL, "replace a model already in --out", NULL},
      {"fsync", PD_OPT_BOOL, &sync, NULL, "fsync every file before finishing", NULL},
      {"dry-run", PD_OPT_BOOL, &dry_run, NULL, "print the plan (sizes, shards), write nothing",
       NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0},
  };
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return mm_fail("%s", e.msg);
  if (help) {
    mm_usage(stdout, opts);
    return 0;
  }
  if (!like) return mm_fail("--like NAME is required (try --help for the list)");
  const mm_preset *p = NULL;
  for (size_t i = 0; i < MM_N_PRESETS; i++)
    if (!strcmp(like, mm_presets[i].name)) p = &mm_presets[i];
  if (!p) {
    char names[256] = "";
    for (size_t i = 0; i < MM_N_PRESETS; i++)
      snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
               mm_presets[i].name);
    return mm_fail("--like: unknown model '%s' (known: %s)", like, names);
  }
  if (!out && !dry_run) return mm_fail("--out DIR is required");

  /* Dimensions: the preset's, each override checked. */
  mm_model m = {.p = p};
  struct {
    const char *flag;
    int given, def, lo, hi, *dst;
  } dims[] = {
      {"--layers", layers, p->layers, 1, 4096, &m.layers},
      {"--vocab", vocab, p->vocab, 1, 1 << 28, &m.vocab},
      {"--hidden", hidden, p->hidden, 1, 1 << 20, &m.hidden},
      {"--ffn", ffn, p->ffn, 1, 1 << 22, &m.ffn},
      {"--heads", heads, p->heads, 1, 4096, &m.heads},
      {"--kv-heads", kv_heads, p->kv_heads, 1, 4096, &m.kv_heads},
  };
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
    const bool given = dims[i].given != INT_MIN;
    if (given && (dims[i].given < dims[i].lo || dims[i].given > dims[i].hi))
      return mm_fail("%s %d is out of range [%d, %d]", dims[i].flag, dims[i].given, dims[i].lo,
                     dims[i].hi);
    *dims[i].dst = given ? dims[i].given : dims[i].def;
  }
  if (head_dim != INT_MIN && (head_dim < 2 || head_dim > 8192))
    return mm_fail("--head-dim %d is out of range [2, 8192]", head_dim);
  if (kv_heads == INT_MIN && m.kv_heads > m.heads) m.kv_heads = m.heads; /* --heads 4 alone */
  if (m.heads % m.kv_heads != 0)
    return mm_fail("--heads %d is not a multiple of --kv-heads %d", m.heads, m.kv_heads);
  m.head_dim_explicit = head_dim != INT_MIN;
  if (m.head_dim_explicit) m.head_dim = head_dim;
  else if (m.hidden % m.heads != 0)
    return mm_fail("--hidden %d is not a multiple of --heads %d (give --heads or --head-dim)",
                   m.hidden, m.heads);
  else m.head_dim = m.hidden / m.heads;
  if (m.head_dim % 2 != 0) return mm_fail("head_dim %d must be even (RoPE)", m.head_dim);
  if (!strcmp(dtype_s, "bf16") || !strcmp(dtype_s, "bfloat16")) m.dtype = PD_DTYPE_BF16;
  else if (!strcmp(dtype_s, "f16") || !strcmp(dtype_s, "float16")) m.dtype = PD_DTYPE_F16;
  else if (!strcmp(dtype_s, "f32") || !strcmp(dtype_s, "float32")) m.dtype = PD_DTYPE_F32;
  else return mm_fail("--dtype '%s' is not one of bf16, f16, f32", dtype_s);
  if (quant_s) {
    if (!strcmp(quant_s, "awq")) m.quant = MM_Q_AWQ;
    else if (!strcmp(quant_s, "gptq")) m.quant = MM_Q_GPTQ;
    else if (!strcmp(quant_s, "fp8")) m.quant = MM_Q_FP8;
    else return mm_fail("--quantization '%s' is not one of awq, gptq, fp8", quant_s);
    if (m.quant == MM_Q_FP8) {
      if (m.hidden % 16 || m.ffn % 16 || ((int64_t)m.heads * m.head_dim) % 16)
        return mm_fail("--quantization fp8: hidden %d, ffn %d and the attention width %d must "
                       "be multiples of 16", m.hidden, m.ffn, m.heads * m.head_dim);
    } else if (group < 32 || group % 32 || m.hidden % group || m.ffn % group ||
        ((int64_t)m.heads * m.head_dim) % group)
      return mm_fail("--group-size %d: a multiple of 32 dividing hidden %d, ffn %d and the "
                     "attention width %d", group, m.hidden, m.ffn, m.heads * m.head_dim);
    if (m.hidden % 8 || m.ffn % 8 || (m.kv_heads * m.head_dim) % 8)
      return mm_fail("--quantization: every linear layer needs a multiple of 8 outputs");
    m.group = group;
  }
  m.seed = seed;
  uint64_t max_shard = 0;
  if (mm_parse_size(shard_s, &max_shard) != 0)
    return mm_fail("--max-shard-size '%s' is not a size such as 5GB, 500MB or 1048576", shard_s);
  if (threads < 0 || threads > MM_MAX_THREADS)
    return mm_fail("--threads %d is out of range [0, %d]", threads, MM_MAX_THREADS);
  if (threads == 0) {
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    threads = nc < 1 ? 1 : nc > MM_MAX_THREADS ? MM_MAX_THREADS : (int)nc;
  }
  bool synth = !strcmp(tok_s, "synthetic"), tok_auto = !strcmp(tok_s, "auto");
  bool try_real = !synth && (!tok_auto || m.vocab == p->vocab);
  if (!try_real && (m.vocab < 256 + MM_N_SPECIAL || m.vocab > MM_MAX_SYNTH_VOCAB))
    return mm_fail("--vocab %d: a generated tokenizer needs a vocabulary of %d to %d tokens",
                   m.vocab, 256 + MM_N_SPECIAL, MM_MAX_SYNTH_VOCAB);

  if (mm_plan(&m, max_shard) != 0) return mm_fail("out of memory");
  int rc = 1;
  char hb[32];
  printf("make-model: %s (%s), %d layers, hidden %d, heads %d/%d (head_dim %d), ffn %d, "
         "vocab %d, %s\n",
         p->name, p->published, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn,
         m.vocab, pd_dtype_name(m.dtype));
  printf("parameters: %" PRIu64 "\n", m.params);
  printf("bytes: %" PRIu64 " (%s)\n", m.data_bytes, mm_human((double)m.data_bytes, hb, sizeof hb));
  printf("shards: %d\n", m.n_shards);
  if (m.layers != p->layers)
    printf("note: %d of the published %d layers\n", m.layers, p->layers);
  if (dry_run) {
    for (int s = 0; s < m.n_shards; s++) {
      char name[64];
      mm_shard_name(&m, s, name, sizeof name);
      printf("  %s  %s\n", name, mm_human((double)m.shard_bytes[s], hb, sizeof hb));
    }
    rc = 0;
    goto done;
  }
  fflush(stdout);

  pd_status st = mm_prepare_dir(out, force, &e);
  if (st) {
    mm_fail("%s", e.msg);
    goto done;
  }
  struct statvfs vfs;
  if (statvfs(out, &vfs) == 0) {
    double need = (double)m.data_bytes + 64e6, have = (double)vfs.f_bavail * (double)vfs.f_frsize;
    if (have < need) {
      char hb2[32];
      mm_fail("%s: %s free, the model needs %s", out, mm_human(have, hb, sizeof hb),
              mm_human(need, hb2, sizeof hb2));
      goto done;
    }
  }
  const double t0 = mm_now();

  /* Tokenizer first: it decides the special token ids written into the configs. */
  int bos = -1, eos[2] = {-1, -1}, n_eos = 1, pad = -1;
  const char *tok_what = "synthetic";
  bool real_tok = false;
  char tok_src[4200] = "";
  if (try_real) {
    char ddir[4096];
    if (!tok_auto) {
      snprintf(tok_src, sizeof tok_src, "%s", tok_s);
    } else if (mm_find_data_dir(data_dir, ddir, sizeof ddir)) {
      snprintf(tok_src, sizeof tok_src, "%s/%s", ddir, p->tokenizer);
    } else if (data_dir) {
      mm_fail("--data-dir %s is not a directory", data_dir);
      goto done;
    }
    if (tok_src[0]) {
      pd_err te = {0};
      pd_tokenizer *tk = NULL;
      st = mm_copy_tokenizer(tok_src, out, &te);
      if (!st) {
        tk = pd_tokenizer_load(out, &te);
        if (!tk) st = te.code;
        else if (pd_tokenizer_vocab_size(tk) > m.vocab)
          st = pd_err_set(&te, PD_ERANGE, "tokenizer %s has %d ids, more than --vocab %d", tok_src,
                          pd_tokenizer_vocab_size(tk), m.vocab);
      }
      if (!st) {
        tok_what = tok_src;
        real_tok = true;
        if (tok_auto) { /* the published ids of this model */
          bos = p->bos;
          eos[0] = p->eos;
          pad = p->bos < 0 ? p->eos : -1; /* pycoder-12m pads with its eos */
        } else {
          bos = pd_tokenizer_bos_id(tk);
          eos[0] = pd_tokenizer_eos_id(tk);
        }
      }
      pd_tokenizer_free(tk);
      if (st) {
        mm_remove_tokenizer(out);
        if (!tok_auto) {
          mm_fail("--tokenizer %s: %s", tok_src, te.msg);
          goto done;
        }
        fprintf(stderr, "make-model: cannot use the real tokenizer (%s); generating one\n",
                te.msg);
      }
    } else {
      fprintf(stderr, "make-model: no tests/data folder found (see --data-dir); generating a "
                      "tokenizer\n");
    }
  }
  if (!real_tok) {
    st = mm_write_synthetic_tokenizer(out, m.vocab, p->max_pos, &e);
    pd_tokenizer *tk = st ? NULL : pd_tokenizer_load(out, &e);
    if (!st && !tk) st = e.code;
    if (!st && pd_tokenizer_vocab_size(tk) != m.vocab)
      st = pd_err_set(&e, PD_EFORMAT, "generated tokenizer has %d ids, not %d",
                      pd_tokenizer_vocab_size(tk), m.vocab);
    pd_tokenizer_free(tk);
    if (st) {
      mm_fail("tokenizer: %s", e.msg);
      goto done;
    }
    eos[0] = m.vocab - MM_N_SPECIAL; /* <|endoftext|> */
    pad = eos[0];
  }
  const double t_tok = mm_now();

  /* Weights. */
  {
    pthread_once(&zig_once, zig_init);
    const size_t es = m.quant != MM_Q_NONE ? 4 : pd_dtype_size(m.dtype); /* the widest element */
    uint64_t chunk_elems = MM_CHUNK_BYTES / es / MM_BLOCK * MM_BLOCK;
    uint64_t biggest = 0;
    for (size_t i = 0; i < m.n_t; i++)
      if (m.t[i].numel > biggest) biggest = m.t[i].numel;
    if (chunk_elems > (biggest + MM_BLOCK - 1) / MM_BLOCK * MM_BLOCK)
      chunk_elems = (biggest + MM_BLOCK - 1) / MM_BLOCK * MM_BLOCK;
    char *buf[2] = {malloc(chunk_elems * es), malloc(chunk_elems * es)};
    mm_pool pool;
    bool pool_ok = buf[0] && buf[1] && mm_pool_start(&pool, threads) == 0;
    if (!pool_ok) st = pd_err_set(&e, PD_ENOMEM, "out of memory (or no threads)");
    for (int s = 0; s < m.n_shards && !st; s++) {
      char name[64], path[4200];
      mm_shard_name(&m, s, name, sizeof name);
      snprintf(path, sizeof path, "%s/%s", out, name);
      double ts = mm_now();
      st = mm_write_shard(&m, s, path, &pool, buf, chunk_elems, sync, &e);
      double dt = mm_now() - ts;
      if (!st)
        fprintf(stderr, "  %s  %s  %.1f s  %.2f GB/s\n", name,
                mm_human((double)m.shard_bytes[s], hb, sizeof hb), dt,
                (double)m.shard_bytes[s] / 1e9 / (dt > 1e-9 ? dt : 1e-9));
    }
    if (pool_ok) mm_pool_stop(&pool);
    free(buf[0]);
    free(buf[1]);
    if (st) {
      mm_fail("%s", e.msg);
      goto done;
    }
  }
  const double t_w = mm_now();

  /* Configs last: a folder without config.json is visibly unfinished. */
  if (!real_tok) {
    eos[1] = m.vocab - 1; /* <|im_end|> ends chat turns */
    n_eos = 2;
  }
  cJSON *j = NULL;
  if (m.n_shards > 1) {
    j = mm_index_json(&m);
    st = mm_write_json(out, "model.safetensors.index.json", j, &e);
    cJSON_Delete(j);
  }
  if (!st) {
    j = mm_generation_json(bos, eos, n_eos, pad);
    st = mm_write_json(out, "generation_config.json", j, &e);
    cJSON_Delete(j);
  }
  if (!st) {
    j = cJSON_CreateObject();
    if (j) {
      cJSON_AddStringToObject(j, "like", p->name);
      cJSON_AddStringToObject(j, "published", p->published);
      cJSON_AddNumberToObject(j, "published_num_hidden_layers", p->layers);
      cJSON_AddNumberToObject(j, "num_hidden_layers", m.layers);
      cJSON_AddNumberToObject(j, "parameters", (double)m.params);
      cJSON_AddNumberToObject(j, "seed", (double)m.seed);
      cJSON_AddStringToObject(j, "tokenizer", tok_what);
      cJSON_AddStringToObject(j, "weights",
                              "matrices N(0, min(0.02, 2/sqrt(fan_in))), biases N(0, 0.02), "
                              "norms 1");
    }
    st = mm_write_json(out, "make_model.json", j, &e);
    cJSON_Delete(j);
  }
  if (!st) {
    j = mm_config_json(&m, bos, eos, n_eos);
    st = mm_write_json(out, "config.json", j, &e);
    cJSON_Delete(j);
  }
  if (st) {
    mm_fail("%s", e.msg);
    goto done;
  }

  /* Self-check: the folder loads as a model. */
  pd_model *chk = pd_model_load(out, NULL, &e);
  if (!chk) {
    mm_fail("the model written does not load: %s", e.msg);
    goto done;
  }
  pd_model_free(chk);
  const double t1 = mm_now();
  printf("tokenizer: %s\n", tok_what);
  printf("wrote %s in %.1f s (tokenizer %.1f s, weights %.1f s, %.2f GB/s, %d threads)\n", out,
         t1 - t0, t_tok - t0, t_w - t_tok, (double)m.data_bytes / 1e9 / (t_w - t_tok + 1e-9),
         threads);
  rc = 0;
done:
  free(m.t);
  free(m.shard_bytes);
  return rc;
}

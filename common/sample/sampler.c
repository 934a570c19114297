/* Per-sequence sampler: counter-based RNG, penalty counts, the processing pipeline
 * (min_tokens, logit_bias, penalties, temperature, min_p, top_k, top_p), the draw, raw
 * logprobs, and speculative verification. See pd/sample.h for the contract.
 *
 * How a row of V logits is sampled without sorting it:
 *   1. the sparse edits (min_tokens, bias, penalties) are written into the row in place and
 *      logged, so that the row is restored bit for bit at the end;
 *   2. one pass finds the max m; one fused pass (SIMD) gathers the candidates with
 *      z >= max(m - CUTOFF*T, m + T*ln(min_p)) (min_p is exactly this threshold), their
 *      weights w = exp((z - m) / T), their level-0 bin d = (m - z) / T * 8 (eight bins per
 *      nat of probability ratio; monotone in z) and the per-bin mass (and count);
 *   3. top_k and top_p keep the smallest descending prefix that meets a count or a mass: the
 *      histogram says which bin the boundary falls in; bins ahead of it are kept whole and
 *      never looked at again, bins after it dropped, and only the crossing bin's members are
 *      extracted and refined (256 sub-bins per level, then a sort of the few left);
 *   4. the draw finds the bin holding u * W from the bin masses, then scans only that bin
 *      (or the refined tail).
 * Every pass is O(V) and branch-light; nothing is sorted but a handful of boundary tokens.
 * The order among equal logits is by id, so results are deterministic. */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "pd/map.h"
#include "pd/sample.h"

/* ------------------------------------------------------------------------------------------
 * Random numbers */

void pd_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t x0 = ctr[0], x1 = ctr[1], x2 = ctr[2], x3 = ctr[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * x0;
    uint64_t p1 = (uint64_t)0xCD9E8D57u * x2;
    uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0;
    uint32_t y1 = (uint32_t)p1;
    uint32_t y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
    uint32_t y3 = (uint32_t)p0;
    x0 = y0, x1 = y1, x2 = y2, x3 = y3;
    k0 += 0x9E3779B9u; /* the Weyl key schedule, bumped between rounds */
    k1 += 0xBB67AE85u;
  }
  out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3;
}

static uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Process-wide seed source for unseeded requests: a random base (getrandom, else clock and
 * pid) and an atomic counter, each seed one splitmix64 step away from the others. */
static pthread_once_t g_seed_once = PTHREAD_ONCE_INIT;
static uint64_t g_seed_base;
static atomic_uint_fast64_t g_seed_counter;

static void seed_source_init(void) {
  uint64_t b = 0;
  ssize_t got = getrandom(&b, sizeof b, GRND_NONBLOCK);
  if (got != (ssize_t)sizeof b) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    b = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
        ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&b;
  }
  g_seed_base = b;
  atomic_init(&g_seed_counter, 0);
}

static uint64_t draw_global_seed(void) {
  pthread_once(&g_seed_once, seed_source_init);
  uint64_t n = atomic_fetch_add(&g_seed_counter, 1);
  return splitmix64(g_seed_base + n * 0x9E3779B97F4A7C15ull);
}

/* ------------------------------------------------------------------------------------------
 * Row kernels. Without -ffast-math GCC vectorises neither a NaN-aware max nor the clamps in
 * exp, so the hot loops are written with intrinsics: AVX2 where the CPU has it (chosen at run
 * time; PD_SAMPLE_NO_AVX2=1 in the environment turns it off), SSE2 (baseline on x86-64), and
 * scalar C elsewhere. All paths give bit-identical weights and sums (the same operations in
 * the same order, no FMA, histogram copies chosen by row index), so a seeded sequence draws
 * the same tokens on every x86 machine. */

#if defined(__SSE2__)
#include <emmintrin.h>
#define PD_SAMPLE_SSE2 1
#endif

/* exp for weights: Cephes expf's reduction and polynomial (relative error ~1e-7). NaN and
 * anything below -87 give exp(-87) (~1.6e-38: a weight of zero for every purpose here). */
static inline float fast_expf(float x) {
  x = x > -87.0f ? x : -87.0f;
  x = x < 88.0f ? x : 88.0f;
  float t = x * 1.44269504088896341f;
  float r = (t + 12582912.0f) - 12582912.0f; /* round to nearest: the 1.5 * 2^23 trick */
  float f = x - r * 0.693359375f;
  f = f + r * 2.12194440e-4f;
  float z = f * f;
  float y = 1.9875691500e-4f;
  y = y * f + 1.3981999507e-3f;
  y = y * f + 8.3334519073e-3f;
  y = y * f + 4.1665795894e-2f;
  y = y * f + 1.6666665459e-1f;
  y = y * f + 5.0000001201e-1f;
  y = y * z + f + 1.0f;
  union {
    float f;
    int32_t i;
  } sc;
  sc.i = ((int32_t)r + 127) << 23;
  return y * sc.f;
}

#ifdef PD_SAMPLE_SSE2
static inline __m128 exp_ps(__m128 x) {
  x = _mm_max_ps(x, _mm_set1_ps(-87.0f)); /* maxps returns the second operand for NaN */
  x = _mm_min_ps(x, _mm_set1_ps(88.0f));
  const __m128 magic = _mm_set1_ps(12582912.0f);
  __m128 t = _mm_mul_ps(x, _mm_set1_ps(1.44269504088896341f));
  __m128 r = _mm_sub_ps(_mm_add_ps(t, magic), magic);
  __m128 f = _mm_sub_ps(x, _mm_mul_ps(r, _mm_set1_ps(0.693359375f)));
  f = _mm_add_ps(f, _mm_mul_ps(r, _mm_set1_ps(2.12194440e-4f)));
  __m128 z = _mm_mul_ps(f, f);
  __m128 y = _mm_set1_ps(1.9875691500e-4f);
  y = _mm_add_ps(_mm_mul_ps(y, f), _mm_set1_ps(1.3981999507e-3f));
  y = _mm_add_ps(_mm_mul_ps(y, f), _mm_set1_ps(8.3334519073e-3f));
  y = _mm_add_ps(_mm_mul_ps(y, f), _mm_set1_ps(4.1665795894e-2f));
  y = _mm_add_ps(_mm_mul_ps(y, f), _mm_set1_ps(1.6666665459e-1f));
  y = _mm_add_ps(_mm_mul_ps(y, f), _mm_set1_ps(5.0000001201e-1f));
  y = _mm_add_ps(_mm_add_ps(_mm_mul_ps(y, z), f), _mm_set1_ps(1.0f));
  __m128i n = _mm_cvtps_epi32(r); /* r is integral: exact */
  __m128i sc = _mm_slli_epi32(_mm_add_epi32(n, _mm_set1_epi32(127)), 23);
  return _mm_mul_ps(y, _mm_castsi128_ps(sc));
}
#endif

static atomic_bool g_portable; /* pd_sample_set_portable: the SSE2 kernels even with AVX2 */

void pd_sample_set_portable(bool on) { atomic_store(&g_portable, on); }

#if defined(PD_SAMPLE_SSE2) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PD_SAMPLE_AVX2 1
#define PD_AVX2_FN __attribute__((target("avx2")))

static atomic_int g_avx2 = -1; /* -1 unknown, 0 off, 1 on */

static bool use_avx2(void) {
  int v = atomic_load_explicit(&g_avx2, memory_order_relaxed);
  if (v < 0) {
    __builtin_cpu_init();
    v = __builtin_cpu_supports("avx2");
    atomic_store_explicit(&g_avx2, v, memory_order_relaxed);
  }
  return v == 1 && !atomic_load_explicit(&g_portable, memory_order_relaxed);
}

PD_AVX2_FN static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  __m256 r = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
  __m256 f = _mm256_sub_ps(x, _mm256_mul_ps(r, _mm256_set1_ps(0.693359375f)));
  f = _mm256_add_ps(f, _mm256_mul_ps(r, _mm256_set1_ps(2.12194440e-4f)));
  __m256 z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, f), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, f), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, f), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, f), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, f), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), f), _mm256_set1_ps(1.0f));
  __m256i n = _mm256_cvtps_epi32(r);
  __m256i sc = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(sc));
}

/* Max of x[0, 16 * floor(n / 16)); *done gets the count covered. */
PD_AVX2_FN static float row_max_avx2(const float *x, int32_t n, int32_t *done) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
  int32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
  }
  float t[8], m = -INFINITY;
  _mm256_storeu_ps(t, _mm256_max_ps(m0, m1));
  for (int j = 0; j < 8; j++) m = t[j] > m ? t[j] : m;
  *done = i;
  return m;
}

/* Adds exp(x - m) of x[0, 8 * floor(n / 8)) into lane accumulators acc[i % 4], in row order
 * per lane, as the SSE2 loop does. */
PD_AVX2_FN static int32_t sum_exp_avx2(const float *x, int32_t n, float m, double acc[4]) {
  __m256d a = _mm256_loadu_pd(acc);
  const __m256 vm = _mm256_set1_ps(m);
  int32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
    a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
  }
  _mm256_storeu_pd(acc, a);
  return i;
}
#endif

/* Largest value; NaN is skipped; -inf when nothing is larger. */
static float row_max(const float *x, int32_t n) {
  float m = -INFINITY;
  int32_t i = 0;
#ifdef PD_SAMPLE_AVX2
  if (use_avx2()) m = row_max_avx2(x, n, &i);
#endif
#ifdef PD_SAMPLE_SSE2
  __m128 m0 = _mm_set1_ps(m), m1 = m0;
  for (; i + 8 <= n; i += 8) {
    m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
    m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
  }
  float t[4];
  _mm_storeu_ps(t, _mm_max_ps(m0, m1));
  for (int j = 0; j < 4; j++) m = t[j] > m ? t[j] : m;
#endif
  for (; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

/* The first i with x[i] == v (v occurs in x). */
static int32_t first_index_of(const float *x, int32_t n, float v) {
  int32_t i = 0;
#ifdef PD_SAMPLE_SSE2
  const __m128 vv = _mm_set1_ps(v);
  for (; i + 8 <= n; i += 8)
    if (_mm_movemask_ps(_mm_or_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), vv),
                                  _mm_cmpeq_ps(_mm_loadu_ps(x + i + 4), vv))))
      break;
#endif
  while (i < n && !(x[i] == v)) i++;
  PD_ASSERT(i < n);
  return i;
}

/* sum over i of exp(x[i] - m), in double: lane accumulators by i % 4 over the blocks of four,
 * combined as (l0 + l2) + (l1 + l3), then the tail. */
static double sum_exp(const float *x, int32_t n, float m) {
  double s = 0;
  int32_t i = 0;
#ifdef PD_SAMPLE_SSE2
  double acc[4] = {0, 0, 0, 0};
#ifdef PD_SAMPLE_AVX2
  if (use_avx2()) i = sum_exp_avx2(x, n, m, acc);
#endif
  __m128d a0 = _mm_loadu_pd(acc), a1 = _mm_loadu_pd(acc + 2);
  const __m128 vm = _mm_set1_ps(m);
  for (; i + 4 <= n; i += 4) {
    __m128 w = exp_ps(_mm_sub_ps(_mm_loadu_ps(x + i), vm));
    a0 = _mm_add_pd(a0, _mm_cvtps_pd(w));
    a1 = _mm_add_pd(a1, _mm_cvtps_pd(_mm_movehl_ps(w, w)));
  }
  double t[2];
  _mm_storeu_pd(t, _mm_add_pd(a0, a1));
  s = t[0] + t[1];
#endif
  for (; i < n; i++) s += fast_expf(x[i] - m);
  return s;
}

/* ------------------------------------------------------------------------------------------
 * Workspace */

#define BINS_PER_NAT 8.0f
#define NB0 336 /* level-0 bins: CUTOFF * BINS_PER_NAT = 320, plus slack for rounding */
#define NB1 256 /* sub-bins per refinement level */
#define NHC 8   /* partial level-0 histograms, chosen by row index % NHC */
#define SELECT_LEVELS 3 /* level 0 over the row, then up to two refinements of one bin */
#define SELECT_SMALL 48 /* sort directly below this many undecided candidates */

/* A set of candidates as parallel arrays. */
typedef struct cset {
  float *v;    /* processed logit (before / T) */
  float *w;    /* weight exp((v - m) / T) */
  int32_t *id; /* token id */
} cset;

struct pd_sample_ws {
  int32_t cap;
  /* Candidates of the current row, in id order, [n_cand]: c.w, c.id and bin (the level-0 bin);
   * c.v is unused (the logit is read back from the row when needed). */
  cset c;
  int16_t *bin;
  int32_t cnt[NB0];  /* level-0 histogram: candidates per bin */
  double mass[NB0];  /* and their weight */
  int32_t cnt4[NHC][NB0]; /* partial histograms (row index % NHC, see hist_copies_mask), */
  double mass4[NHC][NB0]; /* so that nearby updates of one bin do not wait on each other */
  double lane[NHC];       /* G_TOTAL: weight by row index % NHC */
  cset sub;          /* one level-0 bin being refined (top_k / top_p boundary) */
  cset scratch;      /* split buffer of refine_prefix */
  int32_t scnt[NB1];
  double smass[NB1];
  float *probs;      /* [cap] dense target distribution for speculative verification */
};

static bool cset_alloc(cset *s, size_t n) {
  s->v = malloc(n * sizeof(float));
  s->w = malloc(n * sizeof(float));
  s->id = malloc(n * sizeof(int32_t));
  return s->v && s->w && s->id;
}

static void cset_free(cset *s) {
  free(s->v);
  free(s->w);
  free(s->id);
}

pd_sample_ws *pd_sample_ws_new(int32_t max_vocab, pd_err *e) {
  if (max_vocab <= 0) {
    pd_err_set(e, PD_EINVAL, "sample workspace: vocab size must be positive, got %d", max_vocab);
    return NULL;
  }
  size_t n = (size_t)max_vocab;
  pd_sample_ws *ws = calloc(1, sizeof *ws);
  if (!ws) goto oom;
  ws->cap = max_vocab;
  bool ok_sub = cset_alloc(&ws->sub, n), ok_scratch = cset_alloc(&ws->scratch, n); /* both */
  bool ok = ok_sub && ok_scratch;
  ws->c.w = malloc(n * sizeof(float)); /* c.v stays NULL: see the struct */
  ws->c.id = malloc(n * sizeof(int32_t));
  ok = ok && ws->c.w && ws->c.id;
  ws->bin = malloc(n * sizeof(int16_t));
  ws->probs = malloc(n * sizeof(float));
  if (!ok || !ws->bin || !ws->probs) goto oom;
  return ws;
oom:
  pd_sample_ws_free(ws);
  pd_err_set(e, PD_ENOMEM, "sample workspace: out of memory for vocab %d", max_vocab);
  return NULL;
}

void pd_sample_ws_free(pd_sample_ws *ws) {
  if (!ws) return;
  cset_free(&ws->c);
  cset_free(&ws->sub);
  cset_free(&ws->scratch);
  free(ws->bin);
  free(ws->probs);
  free(ws);
}

/* ------------------------------------------------------------------------------------------
 * Sampler state */

typedef struct pen_entry {
  int32_t id;
  int32_t count;     /* occurrences in the output */
  int32_t in_prompt; /* seen in the prompt (repetition penalty) */
} pen_entry;

typedef struct undo_entry {
  int32_t id;
  float old;
} undo_entry;

struct pd_sampler {
  pd_sampling_params p; /* arrays point to the copies below; seed is the effective one */
  int32_t vocab;
  uint32_t key[2];      /* Philox key from (seed, sample_index) */
  int32_t n_gen;        /* output tokens accepted = the RNG position */

  pd_logit_bias *bias;  /* merged (one entry per id, biases summed), sorted by id */
  size_t n_bias;
  int32_t *stop_ids;    /* copy of stop_token_ids */
  int32_t *eos;
  size_t n_eos;
  int32_t *suppress;    /* min_tokens: stop_token_ids + EOS unless ignore_eos, unique */
  size_t n_suppress;

  /* Penalty counts: a dense entry list (iterated to apply penalties: O(distinct tokens))
   * and a map from token id to entry index. */
  bool penalties;
  pen_entry *ent;
  int32_t n_ent, ent_cap;
  pd_map index; /* id -> index into ent; room for ent_cap ids, so adding never allocates */
  int32_t *hist;        /* output ids, for rollback (only with penalties) */
  int32_t n_hist, hist_cap;

  undo_entry *undo;     /* edits made to the current row: n_suppress + n_bias + ent_cap */
  size_t n_undo, undo_cap;
};

static int cmp_bias_id(const void *a, const void *b) {
  int32_t x = ((const pd_logit_bias *)a)->id, y = ((const pd_logit_bias *)b)->id;
  return (x > y) - (x < y);
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* Grows the undo log to hold one edit per suppressed id, bias and penalty entry. */
static pd_status ensure_undo(pd_sampler *s, int32_t ent_cap, pd_err *e) {
  size_t need = s->n_suppress + s->n_bias + (size_t)ent_cap;
  if (need == 0) need = 1;
  if (need <= s->undo_cap) return PD_OK;
  undo_entry *u = realloc(s->undo, need * sizeof *u);
  if (!u) return pd_err_set(e, PD_ENOMEM, "sampler: out of memory");
  s->undo = u;
  s->undo_cap = need;
  return PD_OK;
}

void pd_sampler_free(pd_sampler *s) {
  if (!s) return;
  free(s->bias);
  free(s->stop_ids);
  free(s->eos);
  free(s->suppress);
  free(s->ent);
  pd_map_free(&s->index);
  free(s->hist);
  free(s->undo);
  free(s);
}

pd_sampler *pd_sampler_new(const pd_sampling_params *p, int32_t vocab_size,
                           const int32_t *eos_ids, size_t n_eos, uint32_t sample_index,
                           pd_err *e) {
  if (pd_sampling_params_validate(p, vocab_size, e) != PD_OK) return NULL;
  if (n_eos > 0 && !eos_ids) {
    pd_err_set(e, PD_EINVAL, "sampler: %zu eos ids but no array", n_eos);
    return NULL;
  }
  for (size_t i = 0; i < n_eos; i++)
    if (eos_ids[i] < 0 || eos_ids[i] >= vocab_size) {
      pd_err_set(e, PD_EINVAL, "sampler: eos id %d is out of vocabulary (size %d)", eos_ids[i],
                 vocab_size);
      return NULL;
    }
  pd_sampler *s = calloc(1, sizeof *s);
  if (!s) goto oom;
  pd_map_init(&s->index, 0, 0); /* allocates with the first penalty entry */
  s->p = *p;
  s->vocab = vocab_size;

  /* logit_bias: sorted and merged, so each id is edited once per step. */
  if (p->n_logit_bias > 0) {
    s->bias = malloc(p->n_logit_bias * sizeof *s->bias);
    if (!s->bias) goto oom;
    memcpy(s->bias, p->logit_bias, p->n_logit_bias * sizeof *s->bias);
    qsort(s->bias, p->n_logit_bias, sizeof *s->bias, cmp_bias_id);
    size_t m = 0;
    for (size_t i = 0; i < p->n_logit_bias; i++) {
      if (m > 0 && s->bias[m - 1].id == s->bias[i].id)
        s->bias[m - 1].bias += s->bias[i].bias;
      else
        s->bias[m++] = s->bias[i];
    }
    s->n_bias = m;
  }
  s->p.logit_bias = s->bias;
  s->p.n_logit_bias = s->n_bias;

  if (p->n_stop_token_ids > 0) {
    s->stop_ids = malloc(p->n_stop_token_ids * sizeof(int32_t));
    if (!s->stop_ids) goto oom;
    memcpy(s->stop_ids, p->stop_token_ids, p->n_stop_token_ids * sizeof(int32_t));
  }
  s->p.stop_token_ids = s->stop_ids;
  if (n_eos > 0) {
    s->eos = malloc(n_eos * sizeof(int32_t));
    if (!s->eos) goto oom;
    memcpy(s->eos, eos_ids, n_eos * sizeof(int32_t));
    s->n_eos = n_eos;
  }
  if (p->min_tokens > 0) {
    size_t n = p->n_stop_token_ids + (p->ignore_eos ? 0 : n_eos);
    if (n > 0) {
      s->suppress = malloc(n * sizeof(int32_t));
      if (!s->suppress) goto oom;
      size_t k = 0;
      for (size_t i = 0; i < p->n_stop_token_ids; i++) s->suppress[k++] = p->stop_token_ids[i];
      if (!p->ignore_eos)
        for (size_t i = 0; i < n_eos; i++) s->suppress[k++] = eos_ids[i];
      qsort(s->suppress, k, sizeof(int32_t), cmp_i32);
      size_t m = 0;
      for (size_t i = 0; i < k; i++)
        if (m == 0 || s->suppress[m - 1] != s->suppress[i]) s->suppress[m++] = s->suppress[i];
      s->n_suppress = m;
    }
  }

  uint64_t seed = p->has_seed ? p->seed : draw_global_seed();
  s->p.has_seed = true;
  s->p.seed = seed;
  uint64_t k64 = splitmix64(splitmix64(seed) ^ (uint64_t)sample_index);
  s->key[0] = (uint32_t)k64;
  s->key[1] = (uint32_t)(k64 >> 32);

  s->penalties = p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f ||
                 p->presence_penalty != 0.0f;
  if (ensure_undo(s, 0, e) != PD_OK) {
    pd_sampler_free(s);
    return NULL;
  }
  return s;
oom:
  pd_sampler_free(s);
  pd_err_set(e, PD_ENOMEM, "sampler: out of memory");
  return NULL;
}

uint64_t pd_sampler_seed(const pd_sampler *s) { return s->p.seed; }
int32_t pd_sampler_n_generated(const pd_sampler *s) { return s->n_gen; }
int32_t pd_sampler_vocab(const pd_sampler *s) { return s->vocab; }
const pd_sampling_params *pd_sampler_params(const pd_sampler *s) { return &s->p; }

double pd_sampler_uniform(const pd_sampler *s, uint32_t lane) {
  uint64_t pos = (uint64_t)(uint32_t)s->n_gen;
  uint32_t ctr[4] = {(uint32_t)pos, (uint32_t)(pos >> 32), lane, 0};
  uint32_t out[4];
  pd_philox4x32_10(ctr, s->key, out);
  uint64_t bits = ((uint64_t)out[0] << 32 | out[1]) >> 11;
  return (double)bits * 0x1.0p-53;
}

/* ---- penalty map ---- */

/* Makes room for one more entry. Nothing is committed until every allocation has succeeded;
 * arrays that grew before a failure are merely larger. */
static pd_status map_reserve(pd_sampler *s, pd_err *e) {
  if (s->n_ent + 1 <= s->ent_cap) return PD_OK;
  int32_t cap = s->ent_cap ? s->ent_cap * 2 : 64;
  pen_entry *ent = realloc(s->ent, (size_t)cap * sizeof *ent);
  if (!ent) return pd_err_set(e, PD_ENOMEM, "sampler: out of memory for penalty counts");
  s->ent = ent;
  pd_status st = ensure_undo(s, cap, e);
  if (st != PD_OK) return st;
  if (!pd_map_reserve(&s->index, (size_t)cap))
    return pd_err_set(e, PD_ENOMEM, "sampler: out of memory for penalty counts");
  s->ent_cap = cap;
  return PD_OK;
}

/* The entry of id, created (zeroed) when absent. Needs map_reserve first. */
static pen_entry *map_get(pd_sampler *s, int32_t id) {
  uint64_t k = (uint32_t)id, h = pd_map_hash_u64(k);
  const pd_map_slot *x = pd_map_u64_find(&s->index, h, k);
  if (x) return &s->ent[x->val];
  x = pd_map_u64_add(&s->index, h, k, (uint64_t)s->n_ent);
  PD_ASSERT(x); /* map_reserve made room */
  pen_entry *en = &s->ent[s->n_ent++];
  *en = (pen_entry){.id = id};
  return en;
}

static pen_entry *map_find(const pd_sampler *s, int32_t id) {
  uint64_t k = (uint32_t)id;
  const pd_map_slot *x = pd_map_u64_find(&s->index, pd_map_hash_u64(k), k);
  return x ? &s->ent[x->val] : NULL;
}

pd_status pd_sampler_add_prompt(pd_sampler *s, const int32_t *ids, size_t n, pd_err *e) {
  if (n > 0 && !ids) return pd_err_set(e, PD_EINVAL, "sampler: prompt ids missing");
  for (size_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= s->vocab)
      return pd_err_set(e, PD_EINVAL, "sampler: prompt token id %d is out of vocabulary (size %d)",
                        ids[i], s->vocab);
  if (s->p.repetition_penalty == 1.0f) return PD_OK; /* only repetition looks at the prompt */
  for (size_t i = 0; i < n; i++) {
    pd_status st = map_reserve(s, e);
    if (st != PD_OK) return st;
    map_get(s, ids[i])->in_prompt = 1;
  }
  return PD_OK;
}

pd_status pd_sampler_accept(pd_sampler *s, int32_t token, pd_finish_reason *finish,
                            pd_err *e) {
  if (token < 0 || token >= s->vocab)
    return pd_err_set(e, PD_EINVAL, "sampler: token id %d is out of vocabulary (size %d)", token,
                      s->vocab);
  if (s->n_gen == INT32_MAX) return pd_err_set(e, PD_ERANGE, "sampler: too many tokens");
  if (s->penalties) {
    if (s->n_hist == s->hist_cap) {
      int32_t cap = s->hist_cap ? s->hist_cap * 2 : 64;
      int32_t *h = realloc(s->hist, (size_t)cap * sizeof *h);
      if (!h) return pd_err_set(e, PD_ENOMEM, "sampler: out of memory for output history");
      s->hist = h;
      s->hist_cap = cap;
    }
    pd_status st = map_reserve(s, e);
    if (st != PD_OK) return st;
    map_get(s, token)->count++;
    s->hist[s->n_hist++] = token;
  }
  s->n_gen++;
  if (finish) *finish = pd_sampling_check_stop(&s->p, s->eos, s->n_eos, token, s->n_gen);
  return PD_OK;
}

pd_status pd_sampler_rollback(pd_sampler *s, int32_t n, pd_err *e) {
  if (n < 0 || n > s->n_gen)
    return pd_err_set(e, PD_EINVAL, "sampler: cannot roll back %d of %d tokens", n, s->n_gen);
  if (s->penalties) {
    PD_ASSERT(s->n_hist == s->n_gen);
    for (int32_t i = 0; i < n; i++) {
      pen_entry *x = map_find(s, s->hist[--s->n_hist]);
      PD_ASSERT(x && x->count > 0);
      x->count--;
    }
  }
  s->n_gen -= n;
  return PD_OK;
}

/* ---- steps 1-3: sparse edits of the row ---- */

static inline void edit(pd_sampler *s, float *x, int32_t id, float v, bool record) {
  if (record) {
    s->undo[s->n_undo].id = id;
    s->undo[s->n_undo].old = x[id];
    s->n_undo++;
  }
  x[id] = v;
}

/* The order and the float arithmetic follow vLLM: min_tokens, bias, then repetition,
 * frequency and presence penalties each as its own operation. */
static void apply_edits(pd_sampler *s, float *x, bool record) {
  s->n_undo = 0;
  if (s->n_gen < s->p.min_tokens)
    for (size_t i = 0; i < s->n_suppress; i++) edit(s, x, s->suppress[i], -INFINITY, record);
  for (size_t i = 0; i < s->n_bias; i++)
    edit(s, x, s->bias[i].id, x[s->bias[i].id] + s->bias[i].bias, record);
  if (s->penalties) {
    const float rep = s->p.repetition_penalty, fr = s->p.frequency_penalty,
                pr = s->p.presence_penalty;
    for (int32_t i = 0; i < s->n_ent; i++) {
      const pen_entry *en = &s->ent[i];
      float z = x[en->id];
      if (rep != 1.0f && (en->in_prompt || en->count > 0)) z = z > 0.0f ? z / rep : z * rep;
      if (en->count > 0) {
        z = z - fr * (float)en->count;
        z = z - pr;
      }
      if (z != x[en->id] || isnan(z)) edit(s, x, en->id, z, record);
    }
  }
}

static void restore_edits(pd_sampler *s, float *x) {
  for (size_t i = s->n_undo; i-- > 0;) x[s->undo[i].id] = s->undo[i].old;
  s->n_undo = 0;
}

pd_status pd_sampler_process_logits(pd_sampler *s, float *logits, pd_err *e) {
  if (!logits) return pd_err_set(e, PD_EINVAL, "sampler: logits missing");
  apply_edits(s, logits, false);
  return PD_OK;
}

/* ---- device sampling: the edits of apply_edits as a sparse list ---- */

/* Whether id is in the sorted array a[0, n). */
static bool sorted_has_i32(const int32_t *a, size_t n, int32_t id) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (a[mid] < id)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && a[lo] == id;
}

static bool sorted_has_bias(const pd_logit_bias *a, size_t n, int32_t id) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (a[mid].id < id)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && a[lo].id == id;
}

/* The penalty part of an edit (flags PD_DEV_EDIT_SEEN, count) from a penalty entry. */
static void pen_edit(const pd_sampler *s, const pen_entry *en, pd_dev_sample_edit *ed) {
  if (s->p.repetition_penalty != 1.0f && (en->in_prompt || en->count > 0))
    ed->flags |= PD_DEV_EDIT_SEEN;
  ed->count = en->count;
}

/* Writes edit number *n when it fits in cap, and counts it. */
static inline void put_edit(pd_dev_sample_edit *edits, int32_t cap, int32_t *n,
                            const pd_dev_sample_edit *ed) {
  if (*n < cap) edits[*n] = *ed;
  (*n)++;
}

/* The same edits as apply_edits, one entry per distinct id: first the suppressed and biased
 * ids (both lists sorted by id: a linear merge, penalty state from map_find), then the
 * penalty entries not among them. The second loop has to skip ids the first one emitted; it
 * binary-searches the two short sorted lists only when the first loop found some id in the
 * penalty map, so the cost is O(edits) in the usual cases and O(edits log(bias + suppress))
 * at worst. */
int32_t pd_sampler_dev_spec(const pd_sampler *s, pd_dev_sample_spec *spec,
                            pd_dev_sample_edit *edits, int32_t cap) {
  PD_ASSERT(s && spec && cap >= 0 && (cap == 0 || edits));
  memset(spec, 0, sizeof *spec);
  spec->row = 0;
  spec->edit_begin = 0;
  spec->top_k = s->p.top_k;
  spec->temperature = s->p.temperature;
  spec->top_p = s->p.top_p;
  spec->min_p = s->p.min_p;
  spec->rep_penalty = s->penalties ? s->p.repetition_penalty : 1.0f;
  spec->freq_penalty = s->penalties ? s->p.frequency_penalty : 0.0f;
  spec->pres_penalty = s->penalties ? s->p.presence_penalty : 0.0f;
  spec->u = pd_sampler_uniform(s, PD_RNG_LANE_SAMPLE);
  spec->n_top = s->p.logprobs < 0 ? -1 : s->p.logprobs;

  int32_t n = 0;
  const size_t ns = s->n_gen < s->p.min_tokens ? s->n_suppress : 0;
  size_t i = 0, j = 0, overlap = 0;
  while (i < ns || j < s->n_bias) {
    const int32_t a = i < ns ? s->suppress[i] : INT32_MAX; /* ids are < vocab <= INT32_MAX */
    const int32_t b = j < s->n_bias ? s->bias[j].id : INT32_MAX;
    pd_dev_sample_edit ed = {a < b ? a : b, 0, 0.0f, 0};
    if (a == ed.id) {
      ed.flags |= PD_DEV_EDIT_SUPPRESS;
      i++;
    }
    if (b == ed.id) {
      /* pd_sampler_new merged duplicates already; should any remain, they add up in order */
      ed.flags |= PD_DEV_EDIT_BIAS;
      ed.bias = s->bias[j++].bias;
      while (j < s->n_bias && s->bias[j].id == ed.id) ed.bias += s->bias[j++].bias;
    }
    if (s->penalties) {
      const pen_entry *en = map_find(s, ed.id);
      if (en) {
        pen_edit(s, en, &ed);
        overlap++;
      }
    }
    put_edit(edits, cap, &n, &ed);
  }
  if (s->penalties) {
    for (int32_t k = 0; k < s->n_ent; k++) {
      const pen_entry *en = &s->ent[k];
      pd_dev_sample_edit ed = {en->id, 0, 0.0f, 0};
      pen_edit(s, en, &ed);
      if (!ed.flags && ed.count <= 0) continue; /* no effect (rolled back) */
      if (overlap > 0 && ((ns > 0 && sorted_has_i32(s->suppress, ns, en->id)) ||
                          sorted_has_bias(s->bias, s->n_bias, en->id)))
        continue; /* emitted by the first loop */
      put_edit(edits, cap, &n, &ed);
    }
  }
  spec->edit_count = n;
  return n;
}

/* ---- steps 4-5: selection ---- */

/* Descending by value, then ascending by id. */
static inline bool before_vi(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

typedef struct cand {
  float v, w;
  int32_t id;
} cand;

static int cmp_cand(const void *a, const void *b) {
  const cand *x = a, *y = b;
  if (before_vi(x->v, x->id, y->v, y->id)) return -1;
  if (before_vi(y->v, y->id, x->v, x->id)) return 1;
  return 0;
}

static void insertion_sort(cset *s, int32_t a, int32_t b) {
  for (int32_t i = a + 1; i < b; i++) {
    float v = s->v[i], w = s->w[i];
    int32_t id = s->id[i], j = i;
    while (j > a && before_vi(v, id, s->v[j - 1], s->id[j - 1])) {
      s->v[j] = s->v[j - 1], s->w[j] = s->w[j - 1], s->id[j] = s->id[j - 1];
      j--;
    }
    s->v[j] = v, s->w[j] = w, s->id[j] = id;
  }
}

/* Sorts s[a, b) by (v desc, id asc). After refinement at most SELECT_SMALL candidates get
 * here (insertion sort), unless many logits are equal to float resolution (a degenerate row):
 * then a packed copy is allocated for qsort. */
static void sort_range(cset *s, int32_t a, int32_t b) {
  int32_t n = b - a;
  cand *c = n > 2 * SELECT_SMALL ? malloc((size_t)n * sizeof *c) : NULL;
  if (!c) { /* short, or no memory: in place */
    insertion_sort(s, a, b);
    return;
  }
  for (int32_t i = 0; i < n; i++) c[i] = (cand){s->v[a + i], s->w[a + i], s->id[a + i]};
  qsort(c, (size_t)n, sizeof *c, cmp_cand);
  for (int32_t i = 0; i < n; i++) s->v[a + i] = c[i].v, s->w[a + i] = c[i].w, s->id[a + i] = c[i].id;
  free(c);
}

static inline int level0_bin(float v, float m, float scale) {
  float d = (m - v) * scale;
  d = d < (float)(NB0 - 1) ? d : (float)(NB0 - 1);
  return (int)d;
}

/* Partial histograms in use, minus one: NHC for long rows; one for short rows, where clearing
 * and summing NHC copies would cost more than the row. A function of the row length only, so
 * every SIMD path assigns rows to copies alike. */
static inline int hist_copies_mask(int32_t n) { return n >= 4096 ? NHC - 1 : 0; }

/* What gather_candidates records besides the candidates. */
typedef enum {
  G_TOTAL,      /* only the total weight, in ws->lane (no filter needs the bins) */
  G_MASS,       /* bins and the per-bin mass */
  G_MASS_COUNT  /* and the per-bin count (top_k) */
} gather_mode;

#ifdef PD_SAMPLE_AVX2
/* gather_candidates over the blocks of eight; *pi, *pc: rows done and candidates so far. */
PD_AVX2_FN static void gather_avx2(pd_sample_ws *ws, const float *x, int32_t n, float lo,
                                   float m, float invT, float scale, gather_mode mode,
                                   int32_t *pi, int32_t *pc) {
  float *cw = ws->c.w;
  int32_t *cid = ws->c.id;
  int16_t *bin = ws->bin;
  int32_t c = *pc, i = *pi;
  const bool counts = mode == G_MASS_COUNT;
  const int hm = hist_copies_mask(n);
  const __m256 vlo = _mm256_set1_ps(lo), vm = _mm256_set1_ps(m), vinv = _mm256_set1_ps(invT),
               vsc = _mm256_set1_ps(scale), vtop = _mm256_set1_ps((float)(NB0 - 1));
  __m256d t0 = _mm256_loadu_pd(ws->lane), t1 = _mm256_loadu_pd(ws->lane + 4);
  __m256i vid = _mm256_setr_epi32(i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7);
  const __m256i eight = _mm256_set1_epi32(8);
  for (; i + 8 <= n; i += 8, vid = _mm256_add_epi32(vid, eight)) {
    __m256 xv = _mm256_loadu_ps(x + i);
    __m256 ge = _mm256_cmp_ps(xv, vlo, _CMP_GE_OQ); /* NaN fails */
    int mask = _mm256_movemask_ps(ge);
    if (!mask) continue;
    __m256 w = exp8(_mm256_mul_ps(_mm256_sub_ps(xv, vm), vinv));
    if (mode == G_TOTAL) {
      __m256 wk = _mm256_and_ps(w, ge); /* + 0 for the rows left out: exact */
      t0 = _mm256_add_pd(t0, _mm256_cvtps_pd(_mm256_castps256_ps128(wk)));
      t1 = _mm256_add_pd(t1, _mm256_cvtps_pd(_mm256_extractf128_ps(wk, 1)));
      if (mask == 0xFF) {
        _mm256_storeu_ps(cw + c, w);
        _mm256_storeu_si256((__m256i *)(void *)(cid + c), vid);
        c += 8;
      } else {
        float tw[8];
        _mm256_storeu_ps(tw, w);
        for (int j = 0; j < 8; j++)
          if (mask >> j & 1) cw[c] = tw[j], cid[c++] = i + j;
      }
      continue;
    }
    __m256i b = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(vm, xv), vsc), vtop));
    if (mask == 0xFF) {
      _mm256_storeu_ps(cw + c, w);
      _mm256_storeu_si256((__m256i *)(void *)(cid + c), vid);
      _mm_storeu_si128((__m128i *)(void *)(bin + c),
                       _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
      for (int j = 0; j < 8; j++) ws->mass4[j & hm][bin[c + j]] += cw[c + j];
      if (counts)
        for (int j = 0; j < 8; j++) ws->cnt4[j & hm][bin[c + j]]++;
      c += 8;
    } else {
      float tw[8];
      int32_t tb[8];
      _mm256_storeu_ps(tw, w);
      _mm256_storeu_si256((__m256i *)(void *)tb, b);
      for (int j = 0; j < 8; j++)
        if (mask >> j & 1) {
          cw[c] = tw[j], cid[c] = i + j, bin[c] = (int16_t)tb[j];
          ws->cnt4[j & hm][tb[j]] += counts;
          ws->mass4[j & hm][tb[j]] += tw[j];
          c++;
        }
    }
  }
  _mm256_storeu_pd(ws->lane, t0);
  _mm256_storeu_pd(ws->lane + 4, t1);
  *pi = i;
  *pc = c;
}
#endif

/* Step 2 in one pass: gathers the candidates x[i] >= lo of the row (in id order) with their
 * weight exp((x - m) / T) into ws->c, and, by mode, the total weight (ws->lane, per row index
 * % 8) or the level-0 bins (m - x) / T * BINS_PER_NAT (ws->bin) with the per-bin mass and
 * count (ws->mass, ws->cnt). Returns the count. */
static int32_t gather_candidates(pd_sample_ws *ws, const float *x, int32_t n, float lo, float m,
                                 float invT, float scale, gather_mode mode) {
  const bool counts = mode == G_MASS_COUNT;
  const int hm = hist_copies_mask(n);
  if (mode != G_TOTAL) {
    memset(ws->cnt4, 0, (size_t)(hm + 1) * sizeof ws->cnt4[0]);
    memset(ws->mass4, 0, (size_t)(hm + 1) * sizeof ws->mass4[0]);
  }
  memset(ws->lane, 0, sizeof ws->lane);
  float *cw = ws->c.w;
  int32_t *cid = ws->c.id;
  int16_t *bin = ws->bin;
  int32_t c = 0, i = 0;
#ifdef PD_SAMPLE_AVX2
  if (use_avx2()) gather_avx2(ws, x, n, lo, m, invT, scale, mode, &i, &c);
#endif
#ifdef PD_SAMPLE_SSE2
  const __m128 vlo = _mm_set1_ps(lo), vm = _mm_set1_ps(m), vinv = _mm_set1_ps(invT),
               vsc = _mm_set1_ps(scale), vtop = _mm_set1_ps((float)(NB0 - 1));
  __m128d t[4]; /* row-index lanes {0,1}, {2,3}, {4,5}, {6,7} */
  for (int h = 0; h < 4; h++) t[h] = _mm_loadu_pd(ws->lane + 2 * h);
  __m128i vid = _mm_setr_epi32(i, i + 1, i + 2, i + 3);
  const __m128i four = _mm_set1_epi32(4);
  for (; i + 4 <= n; i += 4, vid = _mm_add_epi32(vid, four)) {
    __m128 xv = _mm_loadu_ps(x + i);
    __m128 ge = _mm_cmpge_ps(xv, vlo); /* NaN fails */
    int mask = _mm_movemask_ps(ge);
    if (!mask) continue;
    __m128 w = exp_ps(_mm_mul_ps(_mm_sub_ps(xv, vm), vinv));
    const int h = i & (NHC - 1); /* 0 or 4: the G_TOTAL lanes */
    if (mode == G_TOTAL) {
      __m128 wk = _mm_and_ps(w, ge);
      t[h / 2] = _mm_add_pd(t[h / 2], _mm_cvtps_pd(wk));
      t[h / 2 + 1] = _mm_add_pd(t[h / 2 + 1], _mm_cvtps_pd(_mm_movehl_ps(wk, wk)));
      if (mask == 0xF) {
        _mm_storeu_ps(cw + c, w);
        _mm_storeu_si128((__m128i *)(void *)(cid + c), vid);
        c += 4;
      } else {
        float tw[4];
        _mm_storeu_ps(tw, w);
        for (int j = 0; j < 4; j++)
          if (mask >> j & 1) cw[c] = tw[j], cid[c++] = i + j;
      }
      continue;
    }
    __m128i b = _mm_cvttps_epi32(_mm_min_ps(_mm_mul_ps(_mm_sub_ps(vm, xv), vsc), vtop));
    if (mask == 0xF) {
      _mm_storeu_ps(cw + c, w);
      _mm_storeu_si128((__m128i *)(void *)(cid + c), vid);
      _mm_storel_epi64((__m128i *)(void *)(bin + c), _mm_packs_epi32(b, b));
      for (int j = 0; j < 4; j++) ws->mass4[(h + j) & hm][bin[c + j]] += cw[c + j];
      if (counts)
        for (int j = 0; j < 4; j++) ws->cnt4[(h + j) & hm][bin[c + j]]++;
      c += 4;
    } else {
      float tw[4];
      int32_t tb[4];
      _mm_storeu_ps(tw, w);
      _mm_storeu_si128((__m128i *)(void *)tb, b);
      for (int j = 0; j < 4; j++)
        if (mask >> j & 1) {
          cw[c] = tw[j], cid[c] = i + j, bin[c] = (int16_t)tb[j];
          ws->cnt4[(h + j) & hm][tb[j]] += counts;
          ws->mass4[(h + j) & hm][tb[j]] += tw[j];
          c++;
        }
    }
  }
  for (int h = 0; h < 4; h++) _mm_storeu_pd(ws->lane + 2 * h, t[h]);
#endif
  for (; i < n; i++) {
    if (!(x[i] >= lo)) continue;
    float w = fast_expf((x[i] - m) * invT);
    cw[c] = w, cid[c] = i;
    if (mode == G_TOTAL) {
      ws->lane[i & (NHC - 1)] += w;
    } else {
      int b = level0_bin(x[i], m, scale);
      bin[c] = (int16_t)b;
      ws->cnt4[i & hm][b] += counts;
      ws->mass4[i & hm][b] += w;
    }
    c++;
  }
  if (mode != G_TOTAL)
    for (int b = 0; b < NB0; b++) {
      int32_t cn = 0;
      double ms = 0;
      for (int h = 0; h <= hm; h++) cn += ws->cnt4[h][b], ms += ws->mass4[h][b];
      ws->cnt[b] = cn;
      ws->mass[b] = ms;
    }
  return c;
}

/* Copies the candidates of level-0 bin B, in candidate order, to ws->sub (logits read back
 * from the row x); returns the count. */
static int32_t extract_bin(pd_sample_ws *ws, const float *x, int32_t n_cand, int B) {
  int32_t k = 0, i = 0;
#ifdef PD_SAMPLE_SSE2
  const __m128i vb = _mm_set1_epi16((int16_t)B);
  for (; i + 8 <= n_cand; i += 8) {
    __m128i bb = _mm_loadu_si128((const __m128i *)(const void *)(ws->bin + i));
    if (!_mm_movemask_epi8(_mm_cmpeq_epi16(bb, vb))) continue;
    for (int j = i; j < i + 8; j++)
      if (ws->bin[j] == B) ws->sub.v[k] = x[ws->c.id[j]], ws->sub.w[k] = ws->c.w[j], ws->sub.id[k++] = ws->c.id[j];
  }
#endif
  for (; i < n_cand; i++)
    if (ws->bin[i] == B) ws->sub.v[k] = x[ws->c.id[i]], ws->sub.w[k] = ws->c.w[i], ws->sub.id[k++] = ws->c.id[i];
  return k;
}

/* The refinement bin of v: ((d - base) * sub) for the level-0 coordinate d, clamped in float
 * before the conversion (d may be huge or inf with an extreme temperature). */
static inline int sub_bin(float v, float m, float scale, float base, float sub) {
  float q = ((m - v) * scale - base) * sub;
  q = q < (float)(NB1 - 1) ? q : (float)(NB1 - 1);
  q = q > 0.0f ? q : 0.0f;
  return (int)q;
}

typedef enum { SEL_COUNT, SEL_MASS } sel_mode;

/* Reorders ws->sub[0, n) -- candidates of level-0 bin B -- so that [0, K) holds those kept
 * and returns K. Descending order is by logit, ties by id.
 *   SEL_COUNT: the `need` largest (1 <= need <= n), plus any others equal to the last one;
 *   SEL_MASS:  with `before` the weight of everything ahead of this bin, a candidate is kept
 *              iff before + the weight of the candidates ahead of it in the bin < target.
 * Refinement: sub-bins of the level-0 coordinate d = (m - v) * scale, NB1 per parent bin;
 * the sub-bins ahead of the crossing one are kept, those after it dropped, and the crossing
 * one is refined again, then sorted. d is monotone in v, so the order is exact. */
static int32_t refine_prefix(pd_sample_ws *ws, int32_t n, float m, float scale, int B,
                             sel_mode mode, int32_t need, double target, double before) {
  cset *s = &ws->sub, *t = &ws->scratch;
  int32_t a = 0, end = n; /* [0, a) kept, [a, end) undecided, the rest dropped */
  float base = (float)B, sub = (float)NB1;
  for (int level = 1; level < SELECT_LEVELS && end - a > SELECT_SMALL; level++) {
    memset(ws->scnt, 0, sizeof ws->scnt);
    memset(ws->smass, 0, sizeof ws->smass);
    for (int32_t i = a; i < end; i++) {
      int b = sub_bin(s->v[i], m, scale, base, sub);
      ws->scnt[b]++;
      ws->smass[b] += s->w[i];
    }
    int Bs = -1;
    int32_t cnt_less = 0;
    double mass_less = 0;
    for (int b = 0; b < NB1; b++) {
      if (mode == SEL_COUNT ? cnt_less + ws->scnt[b] >= need
                            : before + mass_less + ws->smass[b] >= target) {
        Bs = b;
        break;
      }
      cnt_less += ws->scnt[b];
      mass_less += ws->smass[b];
    }
    if (Bs < 0) return end; /* SEL_MASS, by rounding: the target is not reached: keep all */
    /* Branch-free split: sub-bins < Bs compact in place to the front, Bs to the scratch. */
    int32_t wp = a, sp = 0;
    for (int32_t i = a; i < end; i++) {
      float v = s->v[i], w = s->w[i];
      int32_t id = s->id[i];
      int b = sub_bin(v, m, scale, base, sub);
      s->v[wp] = v, s->w[wp] = w, s->id[wp] = id;
      wp += b < Bs;
      t->v[sp] = v, t->w[sp] = w, t->id[sp] = id;
      sp += b == Bs;
    }
    PD_ASSERT(wp - a == cnt_less && sp == ws->scnt[Bs]);
    memcpy(s->v + wp, t->v, (size_t)sp * sizeof(float));
    memcpy(s->w + wp, t->w, (size_t)sp * sizeof(float));
    memcpy(s->id + wp, t->id, (size_t)sp * sizeof(int32_t));
    a = wp;
    end = wp + sp;
    need -= cnt_less;
    before += mass_less;
    base += (float)Bs / sub; /* exact: a multiple of a power of two within float range */
    sub *= (float)NB1;
  }
  sort_range(s, a, end);
  if (mode == SEL_COUNT) {
    int32_t K = a + need;
    float kth = s->v[K - 1];
    while (K < end && s->v[K] == kth) K++;
    return K;
  }
  int32_t j = a;
  while (j < end && before < target) before += s->w[j++];
  return j;
}

/* What steps 4-5 keep of an edited row. Random sampling keeps every candidate (all), or the
 * candidates in level-0 bins < bcut (ws->c where ws->bin < bcut) plus ws->sub[0, n_tail) from
 * bin bcut. */
typedef struct selection {
  bool greedy;
  int32_t argmax;    /* greedy: the token */
  bool all;          /* no top_k / top_p: every candidate (ws->c[0, n_cand)) is kept */
  int32_t n_cand;
  int bcut;
  int32_t n_tail;
  double mass_full;  /* weight of bins < bcut (sum of ws->mass) */
  double mass;       /* mass_full + weight of the tail */
} selection;

static double tail_mass(const pd_sample_ws *ws, int32_t n) {
  double s = 0;
  for (int32_t i = 0; i < n; i++) s += ws->sub.w[i];
  return s;
}

static pd_status select_tokens(pd_sampler *s, pd_sample_ws *ws, const float *x, selection *sel,
                               pd_err *e) {
  const int32_t V = s->vocab;
  float m = row_max(x, V);
  if (m == -INFINITY) return pd_err_set(e, PD_EINVAL, "sampler: no token has a finite logit");
  if (m == INFINITY) return pd_err_set(e, PD_EINVAL, "sampler: logits contain +inf");
  if (pd_sampling_params_is_greedy(&s->p)) {
    sel->greedy = true;
    sel->argmax = first_index_of(x, V, m); /* ties go to the lowest id */
    return PD_OK;
  }
  sel->greedy = false;
  const float T = s->p.temperature, invT = 1.0f / T, scale = invT * BINS_PER_NAT;
  float lo = m - PD_SAMPLE_CUTOFF * T;
  if (s->p.min_p > 0.0f) {
    float lm = m + T * logf(s->p.min_p); /* p >= min_p * p_max  <=>  z >= m + T ln(min_p) */
    lo = lm > lo ? lm : lo;
  }
  if (!(lo > -FLT_MAX)) lo = -FLT_MAX; /* a huge T: still never keep -inf */
  const int32_t k = s->p.top_k;
  const bool use_k = k > 0 && k < V, use_p = s->p.top_p < 1.0f;
  const int32_t c = gather_candidates(ws, x, V, lo, m, invT, scale,
                                      use_k ? G_MASS_COUNT : use_p ? G_MASS : G_TOTAL);
  sel->n_cand = c;
  sel->all = !use_k && !use_p;
  if (sel->all) {
    sel->mass = 0;
    for (int h = 0; h < NHC; h++) sel->mass += ws->lane[h];
    return PD_OK;
  }
  sel->bcut = NB0;
  sel->n_tail = 0;
  sel->mass_full = 0;
  for (int b = 0; b < NB0; b++) sel->mass_full += ws->mass[b];

  if (k > 0 && k < c) {
    int32_t cum = 0;
    double mf = 0;
    int B = 0;
    while (cum + ws->cnt[B] < k) cum += ws->cnt[B], mf += ws->mass[B], B++;
    int32_t ns = extract_bin(ws, x, c, B);
    sel->n_tail = refine_prefix(ws, ns, m, scale, B, SEL_COUNT, k - cum, 0, 0);
    sel->bcut = B;
    sel->mass_full = mf;
  }
  sel->mass = sel->mass_full + tail_mass(ws, sel->n_tail);

  if (use_p) {
    const double target = (double)s->p.top_p * sel->mass;
    double before = 0;
    int Bp = -1;
    for (int b = 0; b < sel->bcut; b++) {
      if (before + ws->mass[b] >= target) {
        Bp = b;
        break;
      }
      before += ws->mass[b];
    }
    if (Bp >= 0) { /* the crossing is in a full bin */
      int32_t ns = extract_bin(ws, x, c, Bp);
      sel->n_tail = refine_prefix(ws, ns, m, scale, Bp, SEL_MASS, 0, target, before);
      sel->bcut = Bp;
      sel->mass_full = before;
    } else if (sel->n_tail > 0) { /* in the top_k tail (before == mass_full here) */
      sel->n_tail = refine_prefix(ws, sel->n_tail, m, scale, sel->bcut, SEL_MASS, 0, target,
                                  sel->mass_full);
    }
    sel->mass = sel->mass_full + tail_mass(ws, sel->n_tail);
  }
  return PD_OK;
}

/* Inverse-CDF draw over the kept set: bins in order (candidate order inside a bin), then the
 * tail. A bin's total and its scan add the same weights in different orders; the rounding
 * difference (~1e-16 relative) falls back to the bin's last candidate. */
/* Sum of w[0, 64) in double, eight lanes combined in a fixed order (vectorised by the
 * compiler, the same on every path). */
static double block_sum64(const float *w) {
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < 64; k += 8)
    for (int j = 0; j < 8; j++) a[j] += (double)w[k + j];
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The draw when every candidate is kept: block sums find the block of 64 holding u * W, then
 * one block is scanned. A block's sum and its scan round differently (~1e-16); a scan that
 * falls short simply continues into the next block. */
static int32_t draw_all(const pd_sample_ws *ws, const selection *sel, double u) {
  const int32_t n = sel->n_cand;
  const double x = u * sel->mass;
  double cum = 0;
  int32_t i = 0;
  for (; i + 64 <= n; i += 64) {
    double bs = block_sum64(ws->c.w + i);
    if (cum + bs > x) break;
    cum += bs;
  }
  int32_t last = n - 1;
  for (; i < n; i++) {
    cum += ws->c.w[i];
    if (ws->c.w[i] > 0.0f) last = i;
    if (cum > x) return ws->c.id[i];
  }
  return ws->c.id[last]; /* rounding */
}

static int32_t draw_kept(const pd_sample_ws *ws, const selection *sel, double u) {
  if (sel->all) return draw_all(ws, sel, u);
  double x = u * sel->mass;
  if (x >= sel->mass_full && sel->n_tail > 0) {
    double cum = sel->mass_full;
    int32_t last = 0;
    for (int32_t j = 0; j < sel->n_tail; j++) {
      cum += ws->sub.w[j];
      if (ws->sub.w[j] > 0.0f) last = j;
      if (cum > x) return ws->sub.id[j];
    }
    return ws->sub.id[last]; /* rounding */
  }
  double before = 0;
  int B = -1;
  for (int b = 0; b < sel->bcut; b++) {
    if (!(ws->mass[b] > 0)) continue; /* empty: every candidate weighs >= exp(-CUTOFF) */
    B = b;
    if (before + ws->mass[b] > x) break;
    before += ws->mass[b];
  }
  PD_ASSERT(B >= 0);
  double r = x - before, cum = 0;
  int32_t last = -1, i = 0;
#ifdef PD_SAMPLE_SSE2
  const __m128i vb = _mm_set1_epi16((int16_t)B);
  for (; i + 8 <= sel->n_cand; i += 8) {
    __m128i bb = _mm_loadu_si128((const __m128i *)(const void *)(ws->bin + i));
    if (!_mm_movemask_epi8(_mm_cmpeq_epi16(bb, vb))) continue;
    for (int32_t j = i; j < i + 8; j++) {
      if (ws->bin[j] != B) continue;
      cum += ws->c.w[j];
      last = j;
      if (cum > r) return ws->c.id[j];
    }
  }
#endif
  for (; i < sel->n_cand; i++) {
    if (ws->bin[i] != B) continue;
    cum += ws->c.w[i];
    last = i;
    if (cum > r) return ws->c.id[i];
  }
  return ws->c.id[last]; /* rounding: the bin's total came out above its scan */
}

static void fill_probs(const pd_sample_ws *ws, const selection *sel, int32_t V, float *probs) {
  memset(probs, 0, (size_t)V * sizeof(float));
  if (sel->greedy) {
    probs[sel->argmax] = 1.0f;
    return;
  }
  const double inv = 1.0 / sel->mass;
  if (sel->all) {
    for (int32_t i = 0; i < sel->n_cand; i++) probs[ws->c.id[i]] = (float)(ws->c.w[i] * inv);
    return;
  }
  for (int32_t i = 0; i < sel->n_cand; i++)
    if (ws->bin[i] < sel->bcut) probs[ws->c.id[i]] = (float)(ws->c.w[i] * inv);
  for (int32_t j = 0; j < sel->n_tail; j++) probs[ws->sub.id[j]] = (float)(ws->sub.w[j] * inv);
}

static pd_status check_call(const pd_sampler *s, const pd_sample_ws *ws, const float *logits,
                            pd_err *e) {
  if (!s || !ws || !logits) return pd_err_set(e, PD_EINVAL, "sampler: missing argument");
  if (ws->cap < s->vocab)
    return pd_err_set(e, PD_EINVAL, "sampler: workspace holds %d logits, the row has %d",
                      ws->cap, s->vocab);
  return PD_OK;
}

/* Edits the row, selects, and restores the row. */
static pd_status select_row(pd_sampler *s, pd_sample_ws *ws, float *logits, selection *sel,
                            pd_err *e) {
  apply_edits(s, logits, true);
  pd_status st = select_tokens(s, ws, logits, sel, e);
  restore_edits(s, logits);
  return st;
}

static pd_status fill_logprobs(const pd_sampler *s, const float *logits, int32_t token,
                               pd_logprobs *lp, pd_err *e) {
  int32_t n_top = s->p.logprobs > 0 ? s->p.logprobs : 0;
  return pd_logprobs_compute(logits, s->vocab, token, n_top, lp, e);
}

pd_status pd_sample_token(pd_sampler *s, pd_sample_ws *ws, float *logits, int32_t *token,
                          pd_logprobs *lp, pd_err *e) {
  pd_status st = check_call(s, ws, logits, e);
  if (st != PD_OK) return st;
  if (!token) return pd_err_set(e, PD_EINVAL, "sampler: missing argument");
  selection sel;
  if ((st = select_row(s, ws, logits, &sel, e)) != PD_OK) return st;
  *token = sel.greedy ? sel.argmax : draw_kept(ws, &sel, pd_sampler_uniform(s, PD_RNG_LANE_SAMPLE));
  return lp ? fill_logprobs(s, logits, *token, lp, e) : PD_OK;
}

pd_status pd_sampler_probs(pd_sampler *s, pd_sample_ws *ws, float *logits, float *probs,
                           pd_err *e) {
  pd_status st = check_call(s, ws, logits, e);
  if (st != PD_OK) return st;
  if (!probs) return pd_err_set(e, PD_EINVAL, "sampler: missing argument");
  selection sel;
  if ((st = select_row(s, ws, logits, &sel, e)) != PD_OK) return st;
  fill_probs(ws, &sel, s->vocab, probs);
  return PD_OK;
}

/* ------------------------------------------------------------------------------------------
 * Logprobs */

/* Inserts (i, v) into the descending list t[0, *n) of capacity cap; a later equal value
 * never displaces an earlier (lower) id, so ties come out by id. NaN counts as -inf. */
static inline void top_insert(pd_token_logprob *t, int32_t *n, int32_t cap, int32_t i, float v) {
  if (*n == cap && !(v > t[cap - 1].logprob)) return;
  if (isnan(v)) v = -INFINITY;
  int32_t j = *n < cap ? (*n)++ : cap - 1;
  while (j > 0 && v > t[j - 1].logprob) {
    t[j] = t[j - 1];
    j--;
  }
  t[j].id = i;
  t[j].logprob = v;
}

pd_status pd_logprobs_compute(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                              pd_logprobs *out, pd_err *e) {
  if (!logits || !out) return pd_err_set(e, PD_EINVAL, "logprobs: missing argument");
  if (vocab <= 0) return pd_err_set(e, PD_EINVAL, "logprobs: vocab must be positive, got %d", vocab);
  if (token < 0 || token >= vocab)
    return pd_err_set(e, PD_EINVAL, "logprobs: token id %d is out of vocabulary (size %d)", token,
                      vocab);
  if (n_top < 0 || n_top > PD_SAMPLE_MAX_LOGPROBS)
    return pd_err_set(e, PD_EINVAL, "logprobs: n_top must be in [0, %d], got %d",
                      PD_SAMPLE_MAX_LOGPROBS, n_top);
  if (n_top > vocab) n_top = vocab;
  const float zt = logits[token];
  const float m = row_max(logits, vocab);
  if (!(m > -INFINITY) || m == INFINITY)
    return pd_err_set(e, PD_EINVAL, "logprobs: logits have no finite maximum");
  int32_t greater = 0;
  for (int32_t i = 0; i < vocab; i++) greater += logits[i] > zt; /* vectorised by the compiler */
  const double lse = (double)m + log(sum_exp(logits, vocab, m));
  out->token = token;
  out->logprob = (float)((double)zt - lse);
  out->rank = greater + 1;
  out->n_top = 0;
  if (n_top > 0) {
    pd_token_logprob *t = out->top;
    int32_t n = 0, i = 0;
    for (; i < vocab && n < n_top; i++) top_insert(t, &n, n_top, i, logits[i]);
#ifdef PD_SAMPLE_SSE2
    /* once the list is full, skip blocks of four with nothing above its last entry */
    for (; i + 4 <= vocab; i += 4) {
      __m128 thr = _mm_set1_ps(t[n_top - 1].logprob);
      if (!_mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(logits + i), thr))) continue;
      for (int32_t j = i; j < i + 4; j++) top_insert(t, &n, n_top, j, logits[j]);
    }
#endif
    for (; i < vocab; i++) top_insert(t, &n, n_top, i, logits[i]);
    for (int32_t j = 0; j < n; j++) t[j].logprob = (float)((double)t[j].logprob - lse);
    out->n_top = n;
  }
  return PD_OK;
}

/* ------------------------------------------------------------------------------------------
 * Speculative decoding */

pd_status pd_spec_draft_token(pd_sampler *s, pd_sample_ws *ws, float *draft_logits,
                              float *q_out, int32_t *token, pd_err *e) {
  pd_status st = check_call(s, ws, draft_logits, e);
  if (st != PD_OK) return st;
  if (!token) return pd_err_set(e, PD_EINVAL, "spec draft: missing argument");
  selection sel;
  if ((st = select_row(s, ws, draft_logits, &sel, e)) != PD_OK) return st;
  *token = sel.greedy ? sel.argmax : draw_kept(ws, &sel, pd_sampler_uniform(s, PD_RNG_LANE_DRAFT));
  if (q_out) fill_probs(ws, &sel, s->vocab, q_out);
  return PD_OK;
}

/* Draw from norm(max(0, p - q)) over [vocab] with uniform u. q == NULL means one-hot at x.
 * Returns -1 when the residual is empty (p <= q everywhere, only possible by rounding). */
static int32_t draw_residual(const float *p, const float *q, int32_t x, int32_t V, double u) {
  double R = 0;
  for (int32_t i = 0; i < V; i++) {
    float qi = q ? q[i] : (i == x ? 1.0f : 0.0f);
    float r = p[i] - qi;
    R += r > 0.0f ? r : 0.0f;
  }
  if (!(R > 0)) return -1;
  double t = u * R, cum = 0;
  int32_t last = -1;
  for (int32_t i = 0; i < V; i++) {
    float qi = q ? q[i] : (i == x ? 1.0f : 0.0f);
    float r = p[i] - qi;
    if (r > 0.0f) {
      cum += r;
      last = i;
      if (cum > t) return i;
    }
  }
  return last;
}

pd_status pd_spec_verify(pd_sampler *s, pd_sample_ws *ws, float *target_logits,
                         const int32_t *draft, const float *draft_probs, int32_t k,
                         int32_t *out_tokens, int32_t *n_out, pd_logprobs *lp,
                         pd_finish_reason *finish, pd_err *e) {
  pd_status st = check_call(s, ws, target_logits, e);
  if (st != PD_OK) return st;
  if (k < 0 || (k > 0 && !draft) || !out_tokens || !n_out)
    return pd_err_set(e, PD_EINVAL, "spec verify: bad arguments (k = %d)", k);
  const int32_t V = s->vocab;
  for (int32_t j = 0; j < k; j++)
    if (draft[j] < 0 || draft[j] >= V)
      return pd_err_set(e, PD_EINVAL, "spec verify: draft token id %d is out of vocabulary (size %d)",
                        draft[j], V);
  *n_out = 0;
  if (finish) *finish = PD_FINISH_NONE;
  for (int32_t j = 0; j <= k; j++) {
    float *row = target_logits + (size_t)j * (size_t)V;
    selection sel;
    if ((st = select_row(s, ws, row, &sel, e)) != PD_OK) return st;
    int32_t tok;
    bool stop_here = true;
    if (j == k) { /* all drafts accepted: the bonus token, drawn as pd_sample_token would */
      tok = sel.greedy ? sel.argmax : draw_kept(ws, &sel, pd_sampler_uniform(s, PD_RNG_LANE_SAMPLE));
    } else if (sel.greedy) {
      tok = sel.argmax;
      stop_here = tok != draft[j];
    } else {
      const float *p = ws->probs;
      fill_probs(ws, &sel, V, ws->probs);
      const float *q = draft_probs ? draft_probs + (size_t)j * (size_t)V : NULL;
      int32_t x = draft[j];
      float px = p[x], qx = q ? q[x] : 1.0f;
      double u = pd_sampler_uniform(s, PD_RNG_LANE_ACCEPT);
      /* accept with probability min(1, px / qx); qx == 0 accepts iff px > 0 */
      if (u * (double)qx < (double)px) {
        tok = x;
        stop_here = false;
      } else {
        tok = draw_residual(p, q, x, V, pd_sampler_uniform(s, PD_RNG_LANE_RESIDUAL));
        if (tok < 0) tok = draw_kept(ws, &sel, pd_sampler_uniform(s, PD_RNG_LANE_RESIDUAL));
      }
    }
    if (lp && (st = fill_logprobs(s, row, tok, &lp[*n_out], e)) != PD_OK) return st;
    pd_finish_reason fin;
    if ((st = pd_sampler_accept(s, tok, &fin, e)) != PD_OK) return st;
    out_tokens[(*n_out)++] = tok;
    if (fin != PD_FINISH_NONE) {
      if (finish) *finish = fin;
      break;
    }
    if (stop_here) break;
  }
  return PD_OK;
}

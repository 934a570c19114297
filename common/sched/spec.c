/* Speculative decoding helpers: n-gram proposals and the adaptive policy's cost model
 * (pd/spec.h). */
#include "pd/spec.h"

#include <string.h>

const char *pd_spec_method_name(pd_spec_method m) {
  switch (m) {
  case PD_SPEC_NGRAM: return "ngram";
  case PD_SPEC_DRAFT: return "draft";
  default: return "none";
  }
}

int pd_spec_ngram_propose(const int32_t *t, int n, int ngram_min, int ngram_max, int k,
                          int32_t *out) {
  if (!t || n < 2 || k < 1 || ngram_min < 1 || ngram_max < ngram_min) return 0;
  int gmax = ngram_max < n - 1 ? ngram_max : n - 1;
  for (int g = gmax; g >= ngram_min; g--) {
    const int32_t *suf = t + n - g;
    const int32_t last = t[n - 1];
    /* match start i: t[i .. i+g) == suf with a continuation, i + g <= n - 1 */
    for (int i = n - g - 1; i >= 0; i--) {
      if (t[i + g - 1] != last) continue;
      if (memcmp(t + i, suf, (size_t)g * sizeof *t) != 0) continue;
      /* t[c..n) ends with the suffix again, which was followed by t[c..]: a continuation
       * that reaches the end repeats with period n - c */
      int c = i + g, p = n - c;
      for (int j = 0; j < k; j++) out[j] = t[c + j % p];
      return k;
    }
  }
  return 0;
}

static int bucket_of(int n) {
  int b = 0;
  while (b + 1 < PD_SPEC_BATCH_BUCKETS && (1 << (b + 1)) <= n) b++;
  return b;
}

void pd_spec_policy_init(pd_spec_policy *p, int K) {
  memset(p, 0, sizeof *p);
  p->K = K;
  for (int b = 0; b < PD_SPEC_BATCH_BUCKETS; b++) {
    p->b[b].inc = -1;
    p->b[b].explore_every = 4;
    p->b[b].dir = 1;
  }
}

bool pd_spec_policy_probing(const pd_spec_policy *p) {
  return p->left > 0 && p->k > 0 && p->b[p->bucket].inc == 0;
}

int pd_spec_policy_best(const pd_spec_policy *p, int n_decode) {
  return p->b[bucket_of(n_decode > 0 ? n_decode : 1)].inc;
}

/* Folds the window that ends: the incumbent's rate, or a challenger against the incumbent's
 * window just before it (windows side by side, so slow drifts such as growing contexts do
 * not favour whichever was measured earlier). */
static void close_window(pd_spec_policy *p) {
  if (p->n_obs == 0) return;
  int b = p->bucket, k = p->k;
  double sorted[PD_SPEC_WINDOW], tokens = 0, seconds = 0;
  for (int i = 0; i < p->n_obs; i++) { /* insertion sort: at most a window of values */
    int j = i;
    while (j > 0 && sorted[j - 1] > p->obs_seconds[i]) {
      sorted[j] = sorted[j - 1];
      j--;
    }
    sorted[j] = p->obs_seconds[i];
  }
  const double limit = 3 * sorted[p->n_obs / 2];
  for (int i = 0; i < p->n_obs; i++)
    if (p->obs_seconds[i] <= limit) {
      tokens += p->obs_tokens[i];
      seconds += p->obs_seconds[i];
    }
  p->n_obs = 0;
  if (!(seconds > 0)) return;
  double r = tokens / seconds;
  p->b[b].rate[k] = r;
  p->b[b].n[k]++;
  if (p->b[b].inc < 0 || k == p->b[b].inc) {
    p->b[b].inc = k;
    p->b[b].inc_rate = r;
  } else {
    if (r > 1.01 * p->b[b].inc_rate) { /* the challenger wins: it is the incumbent now, and
                                          the next challenge goes on in the same direction */
      p->b[b].dir = k > p->b[b].inc ? 1 : -1;
      p->b[b].inc = k;
      p->b[b].inc_rate = r;
      p->b[b].explore_every = 4;
    } else {
      /* the other side next, and later: at least twice as late, and late enough that a
       * challenge as slow as this one costs under 1% (it lost inc_rate / r - 1 of its half
       * window against a whole window per window in between) */
      p->b[b].dir = k > p->b[b].inc ? -1 : 1;
      double loss = r > 0 ? p->b[b].inc_rate / r - 1 : 1e9;
      double need = loss * 0.5 / 0.01;
      int every = 2 * p->b[b].explore_every;
      if (need > every) every = need < PD_SPEC_MAX_BACKOFF ? (int)need + 1 : PD_SPEC_MAX_BACKOFF;
      p->b[b].explore_every = every < PD_SPEC_MAX_BACKOFF ? every : PD_SPEC_MAX_BACKOFF;
    }
    p->b[b].next_explore = p->b[b].windows + p->b[b].explore_every;
  }
}

int pd_spec_policy_choose(pd_spec_policy *p, int n_decode) {
  int b = bucket_of(n_decode > 0 ? n_decode : 1);
  if (p->left > 0 && p->bucket == b) return p->k;
  close_window(p);
  int k = p->b[b].inc < 0 ? 0 : p->b[b].inc; /* plain first: the baseline */
  if (p->b[b].inc >= 0 && p->b[b].windows >= p->b[b].next_explore) {
    int c = p->b[b].inc + p->b[b].dir; /* a neighbour on the side `dir`, else the other */
    if (c < 0 || c > p->K) c = p->b[b].inc - p->b[b].dir;
    if (c >= 0 && c <= p->K) k = c;
  }
  p->b[b].windows++;
  p->bucket = b;
  p->k = k;
  /* a challenger's window is half as long: it is the one that may be slow */
  p->left = k == p->b[b].inc || p->b[b].inc < 0 ? PD_SPEC_WINDOW : PD_SPEC_WINDOW / 2;
  p->warm = PD_SPEC_WINDOW_WARM;
  return k;
}

void pd_spec_policy_observe(pd_spec_policy *p, int tokens, double seconds, bool counts) {
  if (p->left <= 0) return;
  p->left--;
  if (!counts) return;
  if (p->warm > 0) {
    p->warm--;
    return;
  }
  if (p->n_obs < PD_SPEC_WINDOW && seconds > 0) {
    p->obs_tokens[p->n_obs] = tokens;
    p->obs_seconds[p->n_obs++] = seconds;
  }
}

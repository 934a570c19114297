/* Speculative decoding helpers: n-gram proposals and the adaptive policy's cost model
 * (pd/spec.h). */
#include "pd/spec.h"

#include <math.h>
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

static int bucket_of(int tokens) {
  int b = 0;
  while (b + 1 < PD_SPEC_TIME_BUCKETS && (1 << (b + 1)) <= tokens) b++;
  return b;
}

void pd_spec_timing_add(pd_spec_timing *tm, int tokens, double seconds, uint64_t step) {
  if (tokens < 1 || !(seconds > 0)) return;
  int b = bucket_of(tokens);
  if (!tm->at[b]) {
    tm->x[b] = tokens;
    tm->t[b] = seconds;
  } else { /* a running average that follows changes within ~8 steps */
    tm->x[b] += 0.125 * (tokens - tm->x[b]);
    tm->t[b] += 0.125 * (seconds - tm->t[b]);
  }
  tm->at[b] = step ? step : 1;
}

double pd_spec_timing_estimate(const pd_spec_timing *tm, int tokens, uint64_t since) {
  bool have[PD_SPEC_TIME_BUCKETS];
  for (int j = 0; j < PD_SPEC_TIME_BUCKETS; j++) have[j] = tm->at[j] && tm->at[j] >= since;
  int b = bucket_of(tokens);
  if (!have[b]) { /* unmeasured: the nearest smaller measurement (optimistic, so it is tried
                       and measured), else the nearest larger one */
    for (int j = b - 1; j >= 0; j--)
      if (have[j]) return tm->t[j];
    for (int j = b + 1; j < PD_SPEC_TIME_BUCKETS; j++)
      if (have[j]) return tm->t[j];
    return 0;
  }
  /* measured: towards the adjacent bucket on tokens' side when that one is measured too */
  int n = tokens >= tm->x[b] ? b + 1 : b - 1;
  if (n < 0 || n >= PD_SPEC_TIME_BUCKETS || !have[n] || tm->x[n] == tm->x[b]) return tm->t[b];
  double f = (tokens - tm->x[b]) / (tm->x[n] - tm->x[b]);
  return tm->t[b] + f * (tm->t[n] - tm->t[b]);
}

bool pd_spec_timing_fresh(const pd_spec_timing *tm, int tokens, uint64_t since) {
  int b = bucket_of(tokens);
  return tm->at[b] && tm->at[b] >= since;
}

double pd_spec_expected_tokens(double a, int k) {
  double s = 1, p = 1;
  for (int j = 0; j < k; j++) {
    p *= a;
    s += p;
  }
  return s;
}

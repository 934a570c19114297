/* PCRE2 helpers: compile, find all matches into ranges, replace all. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* ================================================================ regex */

bool tk_ranges_push(tk_ranges *r, size_t s, size_t e) {
  if (r->n == r->cap) {
    size_t cap = r->cap ? r->cap * 2 : 64;
    tk_range *v = realloc(r->v, cap * sizeof *v);
    if (!v) return false;
    r->v = v;
    r->cap = cap;
  }
  r->v[r->n++] = (tk_range){s, e};
  return true;
}

void tk_ranges_free(tk_ranges *r) {
  free(r->v);
  r->v = NULL;
  r->n = r->cap = 0;
}

pcre2_code *tk_re_compile(const char *pat, size_t len, bool literal, const char *what, pd_err *e) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &err, &off, NULL);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    pd_err_set(e, PD_EUNSUPPORTED, "%s: cannot compile pattern at offset %zu: %s", what,
               (size_t)off, (const char *)msg);
    return NULL;
  }
  /* JIT is an optimisation only: without it pcre2_match interprets. */
  (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
  return re;
}

pd_status tk_re_find_all(const pcre2_code *re, const char *s, size_t n, pcre2_match_data *md,
                         tk_ranges *out, pd_err *e) {
  out->n = 0;
  size_t last_end = 0, last_match_end = 0;
  bool have_last = false;
  while (last_end <= n) {
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, md, NULL);
    /* The JIT stack is small (32 KiB); long runs of a repeated class can exhaust it. The
     * interpreter keeps its backtracking frames on the heap. */
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
      rc = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                       NULL);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      return pd_err_set(e, rc == PCRE2_ERROR_NOMEMORY ? PD_ENOMEM : PD_EINVAL,
                        "regex match failed: %s", (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t ms = ov[0], me = ov[1];
    if (ms > me || me > n) return pd_err_set(e, PD_EUNSUPPORTED, "regex match with \\K is not supported");
    if (ms == me && have_last && last_match_end == me) {
      if (last_end >= n) break;
      last_end += (size_t)tk_utf8_len((unsigned char)s[last_end]);
      continue;
    }
    last_end = me;
    last_match_end = me;
    have_last = true;
    if (!tk_ranges_push(out, ms, me)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  return PD_OK;
}

/* memmem without the GNU dependency on the needle length > 0. */
static const char *find_lit(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn > hn) return NULL;
  const char *end = h + (hn - nn);
  for (const char *p = h; p <= end;) {
    p = memchr(p, nd[0], (size_t)(end - p) + 1);
    if (!p) return NULL;
    if (memcmp(p, nd, nn) == 0) return p;
    p++;
  }
  return NULL;
}

pd_status tk_replace_all(const pcre2_code *re, const char *lit, size_t lit_len, const char *rep,
                         size_t rep_len, const char *s, size_t n, pcre2_match_data *md,
                         tk_ranges *scratch, tk_buf *out, pd_err *e) {
  if (!re) {
    PD_ASSERT(lit_len > 0);
    size_t i = 0;
    while (i < n) {
      const char *p = find_lit(s + i, n - i, lit, lit_len);
      size_t stop = p ? (size_t)(p - s) : n;
      if (!tk_buf_put(out, s + i, stop - i)) goto oom;
      if (!p) return PD_OK;
      if (!tk_buf_put(out, rep, rep_len)) goto oom;
      i = stop + lit_len;
    }
    return PD_OK;
  }
  pd_status st = tk_re_find_all(re, s, n, md, scratch, e);
  if (st) return st;
  size_t prev = 0;
  for (size_t k = 0; k < scratch->n; k++) {
    if (!tk_buf_put(out, s + prev, scratch->v[k].s - prev)) goto oom;
    if (!tk_buf_put(out, rep, rep_len)) goto oom;
    prev = scratch->v[k].e;
  }
  if (!tk_buf_put(out, s + prev, n - prev)) goto oom;
  return PD_OK;
oom:
  return pd_err_set(e, PD_ENOMEM, "out of memory");
}

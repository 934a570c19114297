/* Pre-tokenizers of tokenizer.json: Split (PCRE2 regex or string, five delimiter behaviours,
 * invert), ByteLevel (optional prefix space and GPT-2 regex, then bytes -> printable alphabet),
 * Metaspace, Sequence, and Whitespace / WhitespaceSplit / Digits / Punctuation /
 * CharDelimiterSplit expressed as Split patterns.
 *
 * The split semantics are those of NormalizedString::split in `tokenizers`: the text is cut
 * into alternating (match / non-match) events that cover it, the behaviour decides which
 * events are kept and which are glued together, and empty pieces are dropped. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* GPT-2's pre-tokenization regex (ByteLevel use_regex). */
static const char GPT2_RE[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

void tk_words_free(tk_words *w) {
  tk_buf_free(&w->text);
  free(w->v);
  w->v = NULL;
  w->n = w->cap = 0;
}

static bool words_push(tk_words *w, const char *s, size_t n, bool first) {
  if (w->n == w->cap) {
    size_t cap = w->cap ? w->cap * 2 : 32;
    tk_span *v = realloc(w->v, cap * sizeof *v);
    if (!v) return false;
    w->v = v;
    w->cap = cap;
  }
  size_t off = w->text.n;
  if (!tk_buf_put(&w->text, s, n)) return false;
  w->v[w->n++] = (tk_span){off, n, first};
  return true;
}

/* ================================================================ parsing */

static pd_status push_pt(tk_pretok **v, size_t *n, size_t *cap, tk_pretok x, pd_err *e) {
  if (*n == *cap) {
    size_t c = *cap ? *cap * 2 : 4;
    tk_pretok *p = realloc(*v, c * sizeof *p);
    if (!p) {
      pcre2_code_free(x.re);
      return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    *v = p;
    *cap = c;
  }
  (*v)[(*n)++] = x;
  return PD_OK;
}

static pd_status parse_behavior(const cJSON *j, tk_split_behavior dflt, tk_split_behavior *out,
                                pd_err *e) {
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(j, "behavior");
  if (!b) {
    *out = dflt;
    return PD_OK;
  }
  const char *s = cJSON_IsString(b) ? b->valuestring : "";
  if (!strcmp(s, "Removed")) *out = TK_SPLIT_REMOVED;
  else if (!strcmp(s, "Isolated")) *out = TK_SPLIT_ISOLATED;
  else if (!strcmp(s, "MergedWithPrevious")) *out = TK_SPLIT_MERGED_PREV;
  else if (!strcmp(s, "MergedWithNext")) *out = TK_SPLIT_MERGED_NEXT;
  else if (!strcmp(s, "Contiguous")) *out = TK_SPLIT_CONTIGUOUS;
  else return pd_err_set(e, PD_EFORMAT, "pre_tokenizer: unknown split behavior \"%s\"", s);
  return PD_OK;
}

/* Reads a one-character string member (Metaspace replacement, Strip content, delimiter). */
static pd_status one_char(const cJSON *j, const char *key, const char *dflt, char out[4], int *len,
                          const char *what, pd_err *e) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(j, key);
  const char *s = dflt;
  if (x) {
    if (!cJSON_IsString(x)) return pd_err_set(e, PD_EFORMAT, "%s: \"%s\" must be a string", what, key);
    s = x->valuestring;
  }
  size_t n = strlen(s);
  if (!n || tk_utf8_valid_prefix(s, n) != n || (size_t)tk_utf8_len((unsigned char)s[0]) != n)
    return pd_err_set(e, PD_EFORMAT, "%s: \"%s\" must be one character", what, key);
  memcpy(out, s, n);
  *len = (int)n;
  return PD_OK;
}

static pd_status parse_one(const cJSON *j, tk_pretok **v, size_t *n, size_t *cap, int depth,
                           pd_err *e) {
  if (depth > 16) return pd_err_set(e, PD_EFORMAT, "pre_tokenizer: Sequence nested too deeply");
  if (!cJSON_IsObject(j)) return pd_err_set(e, PD_EFORMAT, "pre_tokenizer: expected an object");
  const char *type = tk_json_str(j, "type");
  if (!type) return pd_err_set(e, PD_EFORMAT, "pre_tokenizer: missing \"type\"");
  tk_pretok x;
  memset(&x, 0, sizeof x);
  x.type = TK_PT_SPLIT;
  const char *pat = NULL;
  size_t pat_len = 0;
  bool literal = false;
  pd_status st;

  if (!strcmp(type, "Sequence")) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "pretokenizers");
    if (!cJSON_IsArray(list))
      return pd_err_set(e, PD_EFORMAT, "pre_tokenizer Sequence: \"pretokenizers\" must be an array");
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
      if ((st = parse_one(it, v, n, cap, depth + 1, e))) return st;
    }
    return PD_OK;
  } else if (!strcmp(type, "Split")) {
    bool is_re;
    if ((st = tk_json_pattern(j, "pre_tokenizer Split", &pat, &is_re, e))) return st;
    if (!is_re && !*pat) return pd_err_set(e, PD_EFORMAT, "pre_tokenizer Split: empty pattern");
    literal = !is_re;
    pat_len = strlen(pat);
    if ((st = parse_behavior(j, TK_SPLIT_REMOVED, &x.behavior, e))) return st;
    if (!cJSON_GetObjectItemCaseSensitive(j, "behavior"))
      return pd_err_set(e, PD_EFORMAT, "pre_tokenizer Split: missing \"behavior\"");
    x.invert = tk_json_bool(j, "invert", false);
  } else if (!strcmp(type, "ByteLevel")) {
    x.type = TK_PT_BYTELEVEL;
    x.add_prefix_space = tk_json_bool(j, "add_prefix_space", true);
    if (tk_json_bool(j, "use_regex", true)) {
      pat = GPT2_RE;
      pat_len = strlen(GPT2_RE);
    }
  } else if (!strcmp(type, "Metaspace")) {
    x.type = TK_PT_METASPACE;
    if ((st = one_char(j, "replacement", "\xE2\x96\x81", x.repl, &x.repl_len, "pre_tokenizer Metaspace", e)))
      return st;
    const char *scheme = tk_json_str(j, "prepend_scheme");
    if (scheme) {
      if (!strcmp(scheme, "always")) x.prepend = TK_PREPEND_ALWAYS;
      else if (!strcmp(scheme, "first")) x.prepend = TK_PREPEND_FIRST;
      else if (!strcmp(scheme, "never")) x.prepend = TK_PREPEND_NEVER;
      else return pd_err_set(e, PD_EFORMAT, "pre_tokenizer Metaspace: bad prepend_scheme \"%s\"", scheme);
    } else {
      x.prepend = tk_json_bool(j, "add_prefix_space", true) ? TK_PREPEND_ALWAYS : TK_PREPEND_NEVER;
    }
    x.split = tk_json_bool(j, "split", true);
  } else if (!strcmp(type, "Whitespace")) {
    pat = "\\w+|[^\\w\\s]+";
    x.behavior = TK_SPLIT_REMOVED;
    x.invert = true;
  } else if (!strcmp(type, "WhitespaceSplit")) {
    pat = "\\s";
    x.behavior = TK_SPLIT_REMOVED;
  } else if (!strcmp(type, "Digits")) {
    pat = "\\p{N}";
    x.behavior = tk_json_bool(j, "individual_digits", false) ? TK_SPLIT_ISOLATED : TK_SPLIT_CONTIGUOUS;
  } else if (!strcmp(type, "Punctuation")) {
    /* Rust: char::is_ascii_punctuation || Unicode punctuation. One match per character. */
    pat = "[\\p{P}!-/:-@\\[-`{-~]";
    if ((st = parse_behavior(j, TK_SPLIT_ISOLATED, &x.behavior, e))) return st;
  } else if (!strcmp(type, "CharDelimiterSplit")) {
    char d[4];
    int dl;
    if ((st = one_char(j, "delimiter", NULL, d, &dl, "pre_tokenizer CharDelimiterSplit", e))) return st;
    x.behavior = TK_SPLIT_REMOVED;
    x.re = tk_re_compile(d, (size_t)dl, true, "pre_tokenizer CharDelimiterSplit", e);
    if (!x.re) return e ? e->code : PD_EUNSUPPORTED;
    return push_pt(v, n, cap, x, e);
  } else {
    return pd_err_set(e, PD_EUNSUPPORTED, "pre_tokenizer type \"%s\" is not supported", type);
  }
  if (pat) {
    if (!pat_len) pat_len = strlen(pat);
    x.re = tk_re_compile(pat, pat_len, literal, "pre_tokenizer", e);
    if (!x.re) return e ? e->code : PD_EUNSUPPORTED;
  }
  return push_pt(v, n, cap, x, e);
}

pd_status tk_pretok_parse(const cJSON *j, tk_pretok **out, size_t *n, pd_err *e) {
  *out = NULL;
  *n = 0;
  if (!j || cJSON_IsNull(j)) return PD_OK;
  size_t cap = 0;
  pd_status st = parse_one(j, out, n, &cap, 0, e);
  if (st) {
    tk_pretok_free(*out, *n);
    *out = NULL;
    *n = 0;
  }
  return st;
}

void tk_pretok_free(tk_pretok *v, size_t n) {
  for (size_t i = 0; i < n; i++) pcre2_code_free(v[i].re);
  free(v);
}

/* ================================================================ splitting */

typedef struct event {
  size_t s, e;
  bool match;
} event;

typedef struct events {
  event *v;
  size_t n, cap;
} events;

static bool ev_push(events *ev, size_t s, size_t e, bool m) {
  if (ev->n == ev->cap) {
    size_t cap = ev->cap ? ev->cap * 2 : 64;
    event *v = realloc(ev->v, cap * sizeof *v);
    if (!v) return false;
    ev->v = v;
    ev->cap = cap;
  }
  ev->v[ev->n++] = (event){s, e, m};
  return true;
}

/* Cuts s[0,n) by the match ranges m (sorted, non-overlapping) with the given behaviour and
 * appends the non-empty pieces to out. */
static pd_status split_by(const char *s, size_t n, bool first, const tk_ranges *m,
                          tk_split_behavior behavior, bool invert, tk_words *out, pd_err *e) {
  events ev = {0};
  events pieces = {0};
  pd_status st = PD_OK;
  /* Pattern::find_matches: alternating events covering the whole text. */
  size_t prev = 0;
  for (size_t i = 0; i < m->n; i++) {
    if (prev != m->v[i].s && !ev_push(&ev, prev, m->v[i].s, invert)) goto oom;
    if (!ev_push(&ev, m->v[i].s, m->v[i].e, !invert)) goto oom;
    prev = m->v[i].e;
  }
  if (prev != n && !ev_push(&ev, prev, n, invert)) goto oom;

  switch (behavior) {
    case TK_SPLIT_ISOLATED:
      for (size_t i = 0; i < ev.n; i++)
        if (!ev_push(&pieces, ev.v[i].s, ev.v[i].e, false)) goto oom;
      break;
    case TK_SPLIT_REMOVED:
      for (size_t i = 0; i < ev.n; i++)
        if (!ev.v[i].match && !ev_push(&pieces, ev.v[i].s, ev.v[i].e, false)) goto oom;
      break;
    case TK_SPLIT_CONTIGUOUS: {
      bool prev_match = false;
      for (size_t i = 0; i < ev.n; i++) {
        if (ev.v[i].match == prev_match && pieces.n) pieces.v[pieces.n - 1].e = ev.v[i].e;
        else if (!ev_push(&pieces, ev.v[i].s, ev.v[i].e, false)) goto oom;
        prev_match = ev.v[i].match;
      }
      break;
    }
    case TK_SPLIT_MERGED_PREV: {
      bool prev_match = false;
      for (size_t i = 0; i < ev.n; i++) {
        if (ev.v[i].match && !prev_match && pieces.n) pieces.v[pieces.n - 1].e = ev.v[i].e;
        else if (!ev_push(&pieces, ev.v[i].s, ev.v[i].e, false)) goto oom;
        prev_match = ev.v[i].match;
      }
      break;
    }
    case TK_SPLIT_MERGED_NEXT: {
      /* Folded from the end, as in `tokenizers`; pieces come out reversed. */
      bool prev_match = false;
      for (size_t i = ev.n; i-- > 0;) {
        if (ev.v[i].match && !prev_match && pieces.n) pieces.v[pieces.n - 1].s = ev.v[i].s;
        else if (!ev_push(&pieces, ev.v[i].s, ev.v[i].e, false)) goto oom;
        prev_match = ev.v[i].match;
      }
      for (size_t i = 0, j = pieces.n; i < j / 2; i++) {
        event t = pieces.v[i];
        pieces.v[i] = pieces.v[j - 1 - i];
        pieces.v[j - 1 - i] = t;
      }
      break;
    }
  }
  for (size_t i = 0; i < pieces.n; i++) {
    size_t a = pieces.v[i].s, b = pieces.v[i].e;
    if (b > a && !words_push(out, s + a, b - a, first && a == 0)) goto oom;
  }
  goto done;
oom:
  st = pd_err_set(e, PD_ENOMEM, "out of memory");
done:
  free(ev.v);
  free(pieces.v);
  return st;
}

static pd_status apply_leaf(const tk_pretok *p, const char *s, size_t n, bool first, tk_words *out,
                            tk_scratch *sc, pd_err *e) {
  pd_status st;
  switch (p->type) {
    case TK_PT_SPLIT:
      if ((st = tk_re_find_all(p->re, s, n, sc->md, &sc->ranges, e))) return st;
      return split_by(s, n, first, &sc->ranges, p->behavior, p->invert, out, e);

    case TK_PT_BYTELEVEL: {
      tk_buf *t = &sc->tmp2;
      t->n = 0;
      if (p->add_prefix_space && s[0] != ' ' && !tk_buf_putc(t, ' ')) goto oom;
      if (!tk_buf_put(t, s, n)) goto oom;
      tk_buf *enc = &sc->tmp;
      if (!p->re) {
        enc->n = 0;
        if (!tk_bytelevel_encode(enc, t->p, t->n) || !words_push(out, enc->p, enc->n, first)) goto oom;
        return PD_OK;
      }
      if ((st = tk_re_find_all(p->re, t->p, t->n, sc->md, &sc->ranges, e))) return st;
      /* Isolated: every event becomes a piece. */
      size_t prev = 0;
      for (size_t i = 0; i <= sc->ranges.n; i++) {
        size_t ms = i < sc->ranges.n ? sc->ranges.v[i].s : t->n;
        size_t me = i < sc->ranges.n ? sc->ranges.v[i].e : t->n;
        size_t cuts[3] = {prev, ms, me};
        for (int k = 0; k < 2; k++) {
          size_t a = cuts[k], b = cuts[k + 1];
          if (b <= a) continue;
          enc->n = 0;
          if (!tk_bytelevel_encode(enc, t->p + a, b - a) ||
              !words_push(out, enc->p, enc->n, first && a == 0))
            goto oom;
        }
        prev = me;
      }
      return PD_OK;
    }

    case TK_PT_METASPACE: {
      tk_buf *t = &sc->tmp2;
      t->n = 0;
      bool starts = n >= (size_t)p->repl_len && memcmp(s, p->repl, (size_t)p->repl_len) == 0;
      /* The replacement is prepended after spaces are replaced, so test the replaced text. */
      if (!starts && s[0] == ' ') starts = true;
      if ((p->prepend == TK_PREPEND_ALWAYS || (p->prepend == TK_PREPEND_FIRST && first)) && !starts &&
          !tk_buf_put(t, p->repl, (size_t)p->repl_len))
        goto oom;
      for (size_t i = 0; i < n; i++) {
        bool ok = s[i] == ' ' ? tk_buf_put(t, p->repl, (size_t)p->repl_len) : tk_buf_putc(t, s[i]);
        if (!ok) goto oom;
      }
      if (!p->split) return words_push(out, t->p, t->n, first) ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
      sc->ranges.n = 0;
      for (size_t i = 0; i + (size_t)p->repl_len <= t->n;) {
        if (memcmp(t->p + i, p->repl, (size_t)p->repl_len) == 0) {
          if (!tk_ranges_push(&sc->ranges, i, i + (size_t)p->repl_len)) goto oom;
          i += (size_t)p->repl_len;
        } else {
          i += (size_t)tk_utf8_len((unsigned char)t->p[i]);
        }
      }
      return split_by(t->p, t->n, first, &sc->ranges, TK_SPLIT_MERGED_NEXT, false, out, e);
    }
  }
  return pd_err_set(e, PD_EUNSUPPORTED, "unknown pre-tokenizer");
oom:
  return pd_err_set(e, PD_ENOMEM, "out of memory");
}

pd_status tk_pretok_apply(const tk_pretok *v, size_t nv, const char *s, size_t n, bool first,
                          tk_words w[2], int *which, tk_scratch *sc, pd_err *e) {
  int cur = 0;
  w[0].n = 0;
  w[0].text.n = 0;
  if (n && !words_push(&w[0], s, n, first)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  for (size_t i = 0; i < nv; i++) {
    tk_words *in = &w[cur], *out = &w[cur ^ 1];
    out->n = 0;
    out->text.n = 0;
    for (size_t k = 0; k < in->n; k++) {
      pd_status st = apply_leaf(&v[i], in->text.p + in->v[k].off, in->v[k].len, in->v[k].first,
                                out, sc, e);
      if (st) return st;
    }
    cur ^= 1;
  }
  *which = cur;
  return PD_OK;
}

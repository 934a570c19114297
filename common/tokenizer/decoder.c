/* Decoders of tokenizer.json, run as a stream: ByteLevel, ByteFallback, Fuse, Strip, Replace,
 * Metaspace and Sequence (and " "-joining when there is no decoder).
 *
 * In `tokenizers` a decoder maps the list of token strings to a new list, and the final text is
 * the concatenation. Each stage here consumes that list one element at a time and forwards its
 * output to the next stage as soon as it is final, holding back only what later tokens can
 * still change: an incomplete UTF-8 sequence (ByteLevel), a run of <0xNN> byte tokens
 * (ByteFallback: an invalid run turns into one U+FFFD per byte, as a whole), trailing strip
 * characters, or the start of a Replace pattern. After a Fuse or a ByteLevel stage the list is
 * a single string, so later stages see chunks of one token ("fused" input): Strip's start cut
 * then applies only at the very start of the sequence and its stop cut only at the very end.
 *
 * pd_tokenizer_decode is this stream fed with every id and flushed, so one-shot and
 * incremental decoding agree by construction. Known simplifications: ByteFallback and
 * ByteLevel placed after a Fuse judge each chunk rather than the fused whole (no published
 * tokenizer does this). */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* ================================================================ parsing */

static pd_status push_dec(tk_dec **v, size_t *n, size_t *cap, tk_dec x, pd_err *e) {
  if (*n == *cap) {
    size_t c = *cap ? *cap * 2 : 4;
    tk_dec *p = realloc(*v, c * sizeof *p);
    if (!p) {
      free(x.pat);
      free(x.content);
      pcre2_code_free(x.re);
      return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    *v = p;
    *cap = c;
  }
  (*v)[(*n)++] = x;
  return PD_OK;
}

static bool read_count(const cJSON *j, const char *key, size_t *out) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(j, key);
  if (!x) {
    *out = 0;
    return true;
  }
  if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 1e9 ||
      x->valuedouble != (double)(size_t)x->valuedouble)
    return false;
  *out = (size_t)x->valuedouble;
  return true;
}

static pd_status one_char(const char *s, const char *what, char out[4], int *len, pd_err *e) {
  size_t n = s ? strlen(s) : 0;
  if (!n || tk_utf8_valid_prefix(s, n) != n || (size_t)tk_utf8_len((unsigned char)s[0]) != n)
    return pd_err_set(e, PD_EFORMAT, "%s must be one character", what);
  memcpy(out, s, n);
  *len = (int)n;
  return PD_OK;
}

static pd_status parse_one(const cJSON *j, tk_dec **v, size_t *n, size_t *cap, int depth, pd_err *e) {
  if (depth > 16) return pd_err_set(e, PD_EFORMAT, "decoder: Sequence nested too deeply");
  if (!cJSON_IsObject(j)) return pd_err_set(e, PD_EFORMAT, "decoder: expected an object");
  const char *type = tk_json_str(j, "type");
  if (!type) return pd_err_set(e, PD_EFORMAT, "decoder: missing \"type\"");
  tk_dec x;
  memset(&x, 0, sizeof x);
  pd_status st;
  if (!strcmp(type, "Sequence")) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "decoders");
    if (!cJSON_IsArray(list)) return pd_err_set(e, PD_EFORMAT, "decoder Sequence: \"decoders\" must be an array");
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
      if ((st = parse_one(it, v, n, cap, depth + 1, e))) return st;
    }
    return PD_OK;
  }
  if (!strcmp(type, "ByteLevel")) {
    x.type = TK_DEC_BYTELEVEL;
  } else if (!strcmp(type, "ByteFallback")) {
    x.type = TK_DEC_BYTEFALLBACK;
  } else if (!strcmp(type, "Fuse")) {
    x.type = TK_DEC_FUSE;
  } else if (!strcmp(type, "Strip")) {
    x.type = TK_DEC_STRIP;
    char c[4];
    int cl = 0;
    if ((st = one_char(tk_json_str(j, "content"), "decoder Strip: \"content\"", c, &cl, e))) return st;
    tk_utf8_next(c, (size_t)cl, &x.strip_cp);
    if (!read_count(j, "start", &x.strip_start) || !read_count(j, "stop", &x.strip_stop))
      return pd_err_set(e, PD_EFORMAT, "decoder Strip: \"start\"/\"stop\" must be counts");
  } else if (!strcmp(type, "Replace")) {
    x.type = TK_DEC_REPLACE;
    const char *pat, *content = tk_json_str(j, "content");
    bool is_re;
    if (!content) return pd_err_set(e, PD_EFORMAT, "decoder Replace: \"content\" must be a string");
    if ((st = tk_json_pattern(j, "decoder Replace", &pat, &is_re, e))) return st;
    if (!is_re && !*pat) return pd_err_set(e, PD_EFORMAT, "decoder Replace: empty pattern");
    x.content_len = strlen(content);
    x.content = malloc(x.content_len + 1);
    if (!x.content) return pd_err_set(e, PD_ENOMEM, "out of memory");
    memcpy(x.content, content, x.content_len + 1);
    if (is_re) {
      x.re = tk_re_compile(pat, strlen(pat), false, "decoder Replace", e);
      if (!x.re) {
        free(x.content);
        return e ? e->code : PD_EUNSUPPORTED;
      }
    } else {
      x.pat_len = strlen(pat);
      x.pat = malloc(x.pat_len + 1);
      if (!x.pat) {
        free(x.content);
        return pd_err_set(e, PD_ENOMEM, "out of memory");
      }
      memcpy(x.pat, pat, x.pat_len + 1);
    }
  } else if (!strcmp(type, "Metaspace")) {
    x.type = TK_DEC_METASPACE;
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "replacement");
    if ((st = one_char(r ? (cJSON_IsString(r) ? r->valuestring : NULL) : "\xE2\x96\x81",
                       "decoder Metaspace: \"replacement\"", x.meta, &x.meta_len, e)))
      return st;
    const char *scheme = tk_json_str(j, "prepend_scheme");
    if (scheme) {
      if (strcmp(scheme, "always") && strcmp(scheme, "first") && strcmp(scheme, "never"))
        return pd_err_set(e, PD_EFORMAT, "decoder Metaspace: bad prepend_scheme \"%s\"", scheme);
      x.meta_drop_first = strcmp(scheme, "never") != 0;
    } else {
      x.meta_drop_first = tk_json_bool(j, "add_prefix_space", true);
    }
  } else {
    return pd_err_set(e, PD_EUNSUPPORTED, "decoder type \"%s\" is not supported", type);
  }
  return push_dec(v, n, cap, x, e);
}

pd_status tk_dec_parse(const cJSON *j, tk_dec **out, size_t *n, pd_err *e) {
  *out = NULL;
  *n = 0;
  size_t cap = 0;
  pd_status st;
  if (!j || cJSON_IsNull(j)) {
    tk_dec x;
    memset(&x, 0, sizeof x);
    x.type = TK_DEC_JOIN;
    st = push_dec(out, n, &cap, x, e);
  } else {
    st = parse_one(j, out, n, &cap, 0, e);
  }
  if (st) {
    tk_dec_free(*out, *n);
    *out = NULL;
    *n = 0;
    return st;
  }
  bool fused = false;
  for (size_t i = 0; i < *n; i++) {
    (*out)[i].fused = fused;
    if ((*out)[i].type == TK_DEC_FUSE || (*out)[i].type == TK_DEC_BYTELEVEL) fused = true;
  }
  return PD_OK;
}

void tk_dec_free(tk_dec *v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(v[i].pat);
    free(v[i].content);
    pcre2_code_free(v[i].re);
  }
  free(v);
}

/* ================================================================ streaming state */

typedef struct dec_state {
  tk_buf hold;       /* held-back text (bytes for ByteLevel / ByteFallback) */
  uint64_t ntok;     /* tokens seen (unfused input) */
  size_t strip_left; /* fused Strip: start characters still to cut */
  size_t held_chars; /* fused Strip: content characters in hold */
  tk_buf tmp;        /* per-stage output buffer */
} dec_state;

struct pd_detok {
  const pd_tokenizer *t;
  bool skip_special;
  bool accumulate; /* one-shot decode: out keeps growing */
  dec_state *st;   /* [t->n_dec] */
  tk_buf out;
  pcre2_match_data *md;
  tk_ranges ranges;
  pd_err *e;
};

static pd_status feed(pd_detok *d, size_t k, const char *s, size_t n);

static pd_status oom(pd_detok *d) { return pd_err_set(d->e, PD_ENOMEM, "out of memory"); }

static bool is_byte_token(const char *s, size_t n, unsigned char *byte) {
  /* "<0xNN>" parsed like Rust's u8::from_str_radix(_, 16) (which accepts a leading '+'). */
  if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return false;
  int v = 0, digits = 0;
  for (int i = 3; i < 5; i++) {
    char c = s[i];
    int x;
    if (c >= '0' && c <= '9') x = c - '0';
    else if (c >= 'a' && c <= 'f') x = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') x = c - 'A' + 10;
    else if (c == '+' && i == 3) continue;
    else return false;
    v = v * 16 + x;
    digits++;
  }
  if (!digits) return false;
  *byte = (unsigned char)v;
  return true;
}

/* ByteFallback: emits the held byte run: as text when valid UTF-8, else U+FFFD per byte. */
static pd_status bf_release(pd_detok *d, size_t k) {
  dec_state *s = &d->st[k];
  if (!s->hold.n) return PD_OK;
  pd_status st = PD_OK;
  size_t n = s->hold.n;
  s->hold.n = 0; /* the bytes stay in place while forwarded; nothing re-enters this stage */
  if (tk_utf8_valid_prefix(s->hold.p, n) == n) {
    st = feed(d, k + 1, s->hold.p, n);
  } else {
    for (size_t i = 0; i < n && !st; i++) st = feed(d, k + 1, tk_fffd, 3);
  }
  return st;
}

/* Replace on one whole token. */
static pd_status replace_token(pd_detok *d, size_t k, const char *s, size_t n) {
  const tk_dec *x = &d->t->dec[k];
  dec_state *ds = &d->st[k];
  ds->tmp.n = 0;
  pd_status st = tk_replace_all(x->re, x->pat, x->pat_len, x->content, x->content_len, s, n, d->md,
                                &d->ranges, &ds->tmp, d->e);
  if (st) return st;
  return feed(d, k + 1, ds->tmp.p, ds->tmp.n);
}

/* Delivers s[0,n) (a token, or a chunk of the fused token) to stage k. */
static pd_status feed(pd_detok *d, size_t k, const char *s, size_t n) {
  const pd_tokenizer *t = d->t;
  if (k == t->n_dec) return tk_buf_put(&d->out, s, n) ? PD_OK : oom(d);
  const tk_dec *x = &t->dec[k];
  dec_state *ds = &d->st[k];
  if (x->fused && !n) return PD_OK;
  switch (x->type) {
    case TK_DEC_JOIN: {
      /* `tokenizers` without a decoder: tokens.join(" "). */
      pd_status st = PD_OK;
      if (ds->ntok++ > 0) st = feed(d, k + 1, " ", 1);
      return st ? st : feed(d, k + 1, s, n);
    }
    case TK_DEC_FUSE: return feed(d, k + 1, s, n);

    case TK_DEC_BYTEFALLBACK: {
      unsigned char b;
      if (!x->fused && is_byte_token(s, n, &b)) return tk_buf_putc(&ds->hold, (char)b) ? PD_OK : oom(d);
      pd_status st = bf_release(d, k);
      return st ? st : feed(d, k + 1, s, n);
    }

    case TK_DEC_BYTELEVEL: {
      /* A token made only of alphabet characters becomes its bytes; any other token (an added
       * token outside the alphabet) passes as its own UTF-8 bytes. */
      const tk_bytelevel *bl = tk_bytelevel_table();
      size_t start = ds->hold.n;
      bool mapped = true;
      for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = tk_utf8_next(s + i, n - i, &cp);
        if (cp >= 324 || bl->dec[cp] < 0) {
          mapped = false;
          break;
        }
        if (!tk_buf_putc(&ds->hold, (char)bl->dec[cp])) return oom(d);
        i += (size_t)l;
      }
      if (!mapped) {
        ds->hold.n = start;
        if (!tk_buf_put(&ds->hold, s, n)) return oom(d);
      }
      ds->tmp.n = 0;
      size_t used = tk_utf8_lossy(&ds->tmp, (const unsigned char *)ds->hold.p, ds->hold.n, false);
      if (used == (size_t)-1) return oom(d);
      memmove(ds->hold.p, ds->hold.p + used, ds->hold.n - used);
      ds->hold.n -= used;
      return ds->tmp.n ? feed(d, k + 1, ds->tmp.p, ds->tmp.n) : PD_OK;
    }

    case TK_DEC_METASPACE: {
      bool first = x->fused || ds->ntok == 0;
      ds->ntok++;
      ds->tmp.n = 0;
      for (size_t i = 0; i < n;) {
        if (n - i >= (size_t)x->meta_len && memcmp(s + i, x->meta, (size_t)x->meta_len) == 0) {
          if (!(first && x->meta_drop_first) && !tk_buf_putc(&ds->tmp, ' ')) return oom(d);
          i += (size_t)x->meta_len;
        } else {
          int l = tk_utf8_len((unsigned char)s[i]);
          if ((size_t)l > n - i) l = (int)(n - i);
          if (!tk_buf_put(&ds->tmp, s + i, (size_t)l)) return oom(d);
          i += (size_t)l;
        }
      }
      return feed(d, k + 1, ds->tmp.p, ds->tmp.n);
    }

    case TK_DEC_STRIP: {
      ds->tmp.n = 0;
      if (!x->fused) {
        /* Per token: cut up to `start` leading and `stop` trailing content characters. */
        size_t a = 0, b = n, cut = 0;
        while (a < b && cut < x->strip_start) {
          uint32_t cp;
          int l = tk_utf8_next(s + a, b - a, &cp);
          if (cp != x->strip_cp) break;
          a += (size_t)l;
          cut++;
        }
        cut = 0;
        while (b > a && cut < x->strip_stop) {
          size_t p = b - 1;
          while (p > a && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
          uint32_t cp;
          tk_utf8_next(s + p, b - p, &cp);
          if (cp != x->strip_cp) break;
          b = p;
          cut++;
        }
        return feed(d, k + 1, s + a, b - a);
      }
      /* Fused: the start cut applies to the beginning of the whole text; trailing content
       * characters (up to `stop`) are held until something else follows. */
      for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = tk_utf8_next(s + i, n - i, &cp);
        if (ds->strip_left) {
          if (cp == x->strip_cp) {
            ds->strip_left--;
            i += (size_t)l;
            continue;
          }
          ds->strip_left = 0;
        }
        if (x->strip_stop && cp == x->strip_cp) {
          if (ds->held_chars == x->strip_stop) {
            /* The oldest held character can no longer be trailing: release it. */
            int hl = tk_utf8_len((unsigned char)ds->hold.p[0]);
            if (!tk_buf_put(&ds->tmp, ds->hold.p, (size_t)hl)) return oom(d);
            memmove(ds->hold.p, ds->hold.p + hl, ds->hold.n - (size_t)hl);
            ds->hold.n -= (size_t)hl;
            ds->held_chars--;
          }
          if (!tk_buf_put(&ds->hold, s + i, (size_t)l)) return oom(d);
          ds->held_chars++;
        } else {
          if (!tk_buf_put(&ds->tmp, ds->hold.p, ds->hold.n) || !tk_buf_put(&ds->tmp, s + i, (size_t)l))
            return oom(d);
          ds->hold.n = 0;
          ds->held_chars = 0;
        }
        i += (size_t)l;
      }
      return ds->tmp.n ? feed(d, k + 1, ds->tmp.p, ds->tmp.n) : PD_OK;
    }

    case TK_DEC_REPLACE: {
      if (!x->fused) return replace_token(d, k, s, n);
      if (!tk_buf_put(&ds->hold, s, n)) return oom(d);
      if (x->re) return PD_OK; /* a regex over the fused text waits for the flush */
      /* Literal: replace complete occurrences; keep a tail that may start an occurrence. */
      ds->tmp.n = 0;
      const char *h = ds->hold.p;
      size_t hn = ds->hold.n, i = 0, emit_from = 0;
      while (i < hn) {
        if (hn - i >= x->pat_len) {
          if (memcmp(h + i, x->pat, x->pat_len) == 0) {
            if (!tk_buf_put(&ds->tmp, h + emit_from, i - emit_from) ||
                !tk_buf_put(&ds->tmp, x->content, x->content_len))
              return oom(d);
            i += x->pat_len;
            emit_from = i;
            continue;
          }
        } else if (memcmp(h + i, x->pat, hn - i) == 0) {
          break; /* h[i..] is a proper prefix of the pattern */
        }
        i++;
      }
      if (!tk_buf_put(&ds->tmp, h + emit_from, i - emit_from)) return oom(d);
      memmove(ds->hold.p, ds->hold.p + i, hn - i);
      ds->hold.n = hn - i;
      return ds->tmp.n ? feed(d, k + 1, ds->tmp.p, ds->tmp.n) : PD_OK;
    }
  }
  return pd_err_set(d->e, PD_EUNSUPPORTED, "unknown decoder");
}

/* Releases what stage k holds, then flushes the stages after it. */
static pd_status flush_from(pd_detok *d, size_t k) {
  const pd_tokenizer *t = d->t;
  if (k == t->n_dec) return PD_OK;
  const tk_dec *x = &t->dec[k];
  dec_state *ds = &d->st[k];
  pd_status st = PD_OK;
  switch (x->type) {
    case TK_DEC_BYTEFALLBACK: st = bf_release(d, k); break;
    case TK_DEC_BYTELEVEL: {
      ds->tmp.n = 0;
      if (tk_utf8_lossy(&ds->tmp, (const unsigned char *)ds->hold.p, ds->hold.n, true) == (size_t)-1)
        return oom(d);
      ds->hold.n = 0;
      if (ds->tmp.n) st = feed(d, k + 1, ds->tmp.p, ds->tmp.n);
      break;
    }
    case TK_DEC_STRIP:
      /* Held characters are trailing: the stop cut removes them. */
      ds->hold.n = 0;
      ds->held_chars = 0;
      break;
    case TK_DEC_REPLACE:
      if (x->fused && ds->hold.n) {
        size_t n = ds->hold.n;
        ds->hold.n = 0;
        if (x->re) {
          ds->tmp.n = 0;
          st = tk_replace_all(x->re, NULL, 0, x->content, x->content_len, ds->hold.p, n, d->md,
                              &d->ranges, &ds->tmp, d->e);
          if (!st && ds->tmp.n) st = feed(d, k + 1, ds->tmp.p, ds->tmp.n);
        } else {
          st = feed(d, k + 1, ds->hold.p, n); /* a proper prefix of the pattern: no match */
        }
      }
      break;
    default: break;
  }
  return st ? st : flush_from(d, k + 1);
}

/* ================================================================ public API */

pd_detok *pd_detok_new(const pd_tokenizer *t, bool skip_special) {
  if (!t) return NULL;
  pd_detok *d = calloc(1, sizeof *d);
  if (!d) return NULL;
  d->t = t;
  d->skip_special = skip_special;
  d->st = calloc(t->n_dec ? t->n_dec : 1, sizeof *d->st);
  d->md = pcre2_match_data_create(1, NULL);
  if (!d->st || !d->md) {
    pd_detok_free(d);
    return NULL;
  }
  for (size_t i = 0; i < t->n_dec; i++) d->st[i].strip_left = t->dec[i].strip_start;
  return d;
}

void pd_detok_free(pd_detok *d) {
  if (!d) return;
  if (d->st) {
    for (size_t i = 0; i < d->t->n_dec; i++) {
      tk_buf_free(&d->st[i].hold);
      tk_buf_free(&d->st[i].tmp);
    }
    free(d->st);
  }
  tk_buf_free(&d->out);
  tk_ranges_free(&d->ranges);
  pcre2_match_data_free(d->md);
  free(d);
}

static pd_status finish(pd_detok *d, pd_status st, const char **out, size_t *out_len) {
  if (!st && !tk_buf_cstr(&d->out)) st = oom(d);
  if (out) *out = st ? "" : d->out.p;
  if (out_len) *out_len = st ? 0 : d->out.n;
  return st;
}

pd_status pd_detok_push(pd_detok *d, int32_t id, const char **out, size_t *out_len, pd_err *e) {
  if (out) *out = "";
  if (out_len) *out_len = 0;
  if (!d) return pd_err_set(e, PD_EINVAL, "pd_detok_push: NULL decoder");
  const pd_tokenizer *t = d->t;
  if (id < 0 || id >= t->n_toks || !(t->toks[id].flags & TK_TOK_PRESENT))
    return pd_err_set(e, PD_EINVAL, "token id %d is not in the vocabulary", (int)id);
  if (!d->accumulate) d->out.n = 0;
  if (d->skip_special && (t->toks[id].flags & TK_TOK_SPECIAL)) return finish(d, PD_OK, out, out_len);
  d->e = e;
  return finish(d, feed(d, 0, t->toks[id].s, t->toks[id].len), out, out_len);
}

pd_status pd_detok_flush(pd_detok *d, const char **out, size_t *out_len, pd_err *e) {
  if (out) *out = "";
  if (out_len) *out_len = 0;
  if (!d) return pd_err_set(e, PD_EINVAL, "pd_detok_flush: NULL decoder");
  if (!d->accumulate) d->out.n = 0;
  d->e = e;
  return finish(d, flush_from(d, 0), out, out_len);
}

pd_status pd_tokenizer_decode(const pd_tokenizer *t, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **text, size_t *len, pd_err *e) {
  if (text) *text = NULL;
  if (len) *len = 0;
  if (!t || !text || (n_ids && !ids)) return pd_err_set(e, PD_EINVAL, "pd_tokenizer_decode: bad arguments");
  pd_detok *d = pd_detok_new(t, skip_special);
  if (!d) return pd_err_set(e, PD_ENOMEM, "out of memory");
  d->accumulate = true;
  pd_status st = PD_OK;
  for (size_t i = 0; i < n_ids && !st; i++) st = pd_detok_push(d, ids[i], NULL, NULL, e);
  if (!st) st = pd_detok_flush(d, NULL, NULL, e);
  if (!st && !tk_buf_cstr(&d->out)) st = pd_err_set(e, PD_ENOMEM, "out of memory");
  if (!st) {
    *text = d->out.p ? d->out.p : calloc(1, 1);
    if (!*text) st = pd_err_set(e, PD_ENOMEM, "out of memory");
    if (len) *len = d->out.n;
    d->out.p = NULL;
    d->out.n = d->out.cap = 0;
  }
  pd_detok_free(d);
  return st;
}

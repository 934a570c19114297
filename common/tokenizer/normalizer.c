/* Normalizers of tokenizer.json: NFC/NFD/NFKC/NFKD (utf8proc), Lowercase, Prepend, Append,
 * Replace (string or regex), Strip, StripAccents, ByteLevel, and Sequence of those.
 * Offsets are not tracked: the server needs ids, not alignments. */
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "tok_internal.h"

static pd_status parse_one(const cJSON *j, tk_norm **v, size_t *n, size_t *cap, int depth,
                           pd_err *e);

static pd_status push(tk_norm **v, size_t *n, size_t *cap, tk_norm x, pd_err *e) {
  if (*n == *cap) {
    size_t c = *cap ? *cap * 2 : 4;
    tk_norm *p = realloc(*v, c * sizeof *p);
    if (!p) return pd_err_set(e, PD_ENOMEM, "out of memory");
    *v = p;
    *cap = c;
  }
  (*v)[(*n)++] = x;
  return PD_OK;
}

static char *dup_str(const char *s, size_t *len) {
  size_t l = strlen(s);
  char *p = malloc(l + 1);
  if (p) memcpy(p, s, l + 1);
  if (len) *len = l;
  return p;
}

static pd_status parse_one(const cJSON *j, tk_norm **v, size_t *n, size_t *cap, int depth,
                           pd_err *e) {
  if (depth > 16) return pd_err_set(e, PD_EFORMAT, "normalizer: Sequence nested too deeply");
  if (!cJSON_IsObject(j)) return pd_err_set(e, PD_EFORMAT, "normalizer: expected an object");
  const char *type = tk_json_str(j, "type");
  if (!type) return pd_err_set(e, PD_EFORMAT, "normalizer: missing \"type\"");
  tk_norm x;
  memset(&x, 0, sizeof x);
  if (!strcmp(type, "Sequence")) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "normalizers");
    if (!cJSON_IsArray(list))
      return pd_err_set(e, PD_EFORMAT, "normalizer Sequence: \"normalizers\" must be an array");
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
      pd_status st = parse_one(it, v, n, cap, depth + 1, e);
      if (st) return st;
    }
    return PD_OK;
  }
  if (!strcmp(type, "NFC")) x.type = TK_NORM_NFC;
  else if (!strcmp(type, "NFD")) x.type = TK_NORM_NFD;
  else if (!strcmp(type, "NFKC")) x.type = TK_NORM_NFKC;
  else if (!strcmp(type, "NFKD")) x.type = TK_NORM_NFKD;
  else if (!strcmp(type, "Lowercase")) x.type = TK_NORM_LOWERCASE;
  else if (!strcmp(type, "StripAccents")) x.type = TK_NORM_STRIP_ACCENTS;
  else if (!strcmp(type, "ByteLevel")) x.type = TK_NORM_BYTELEVEL;
  else if (!strcmp(type, "Strip")) {
    x.type = TK_NORM_STRIP;
    x.left = tk_json_bool(j, "strip_left", true);
    x.right = tk_json_bool(j, "strip_right", true);
  } else if (!strcmp(type, "Prepend") || !strcmp(type, "Append")) {
    const char *key = type[0] == 'P' ? "prepend" : "append";
    const char *s = tk_json_str(j, key);
    if (!s) return pd_err_set(e, PD_EFORMAT, "normalizer %s: \"%s\" must be a string", type, key);
    x.type = type[0] == 'P' ? TK_NORM_PREPEND : TK_NORM_APPEND;
    if (!(x.str = dup_str(s, &x.str_len))) return pd_err_set(e, PD_ENOMEM, "out of memory");
  } else if (!strcmp(type, "Replace")) {
    const char *pat, *content = tk_json_str(j, "content");
    bool is_re;
    if (!content) return pd_err_set(e, PD_EFORMAT, "normalizer Replace: \"content\" must be a string");
    pd_status st = tk_json_pattern(j, "normalizer Replace", &pat, &is_re, e);
    if (st) return st;
    if (!is_re && !*pat) return pd_err_set(e, PD_EFORMAT, "normalizer Replace: empty pattern");
    x.type = TK_NORM_REPLACE;
    if (is_re) {
      x.re = tk_re_compile(pat, strlen(pat), false, "normalizer Replace", e);
      if (!x.re) return e ? e->code : PD_EUNSUPPORTED;
    } else if (!(x.pat = dup_str(pat, &x.pat_len))) {
      return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    if (!(x.str = dup_str(content, &x.str_len))) {
      pcre2_code_free(x.re);
      free(x.pat);
      return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
  } else {
    return pd_err_set(e, PD_EUNSUPPORTED, "normalizer type \"%s\" is not supported", type);
  }
  pd_status st = push(v, n, cap, x, e);
  if (st) {
    free(x.str);
    free(x.pat);
    pcre2_code_free(x.re);
  }
  return st;
}

pd_status tk_norm_parse(const cJSON *j, tk_norm **out, size_t *n, pd_err *e) {
  *out = NULL;
  *n = 0;
  if (!j || cJSON_IsNull(j)) return PD_OK;
  size_t cap = 0;
  pd_status st = parse_one(j, out, n, &cap, 0, e);
  if (st) {
    tk_norm_free(*out, *n);
    *out = NULL;
    *n = 0;
  }
  return st;
}

void tk_norm_free(tk_norm *v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(v[i].str);
    free(v[i].pat);
    pcre2_code_free(v[i].re);
  }
  free(v);
}

/* Applies one normalizer to s[0,n), appending to out. */
static pd_status apply_one(const tk_norm *x, const char *s, size_t n, tk_buf *out, tk_scratch *sc,
                           pd_err *e) {
  switch (x->type) {
    case TK_NORM_NFC:
    case TK_NORM_NFD:
    case TK_NORM_NFKC:
    case TK_NORM_NFKD: {
      if (!n) return PD_OK;
      int opts = UTF8PROC_STABLE;
      if (x->type == TK_NORM_NFC || x->type == TK_NORM_NFKC) opts |= UTF8PROC_COMPOSE;
      else opts |= UTF8PROC_DECOMPOSE;
      if (x->type == TK_NORM_NFKC || x->type == TK_NORM_NFKD) opts |= UTF8PROC_COMPAT;
      utf8proc_uint8_t *dst = NULL;
      utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                        (utf8proc_option_t)opts);
      if (r < 0) {
        free(dst);
        return pd_err_set(e, r == UTF8PROC_ERROR_NOMEM ? PD_ENOMEM : PD_EINVAL,
                          "unicode normalization failed: %s", utf8proc_errmsg(r));
      }
      bool ok = tk_buf_put(out, dst, (size_t)r);
      free(dst);
      return ok ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    case TK_NORM_LOWERCASE:
    case TK_NORM_STRIP_ACCENTS: {
      for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = tk_utf8_next(s + i, n - i, &cp);
        if (x->type == TK_NORM_LOWERCASE) {
          /* Rust's char::to_lowercase: the simple mapping, except U+0130 whose full mapping
           * (the only unconditional one in SpecialCasing.txt) is "i" + U+0307. */
          char enc[8];
          int el;
          if (cp == 0x130) {
            memcpy(enc, "i\xCC\x87", 3);
            el = 3;
          } else {
            el = tk_utf8_encode((uint32_t)utf8proc_tolower((utf8proc_int32_t)cp), enc);
          }
          if (!tk_buf_put(out, enc, (size_t)el)) return pd_err_set(e, PD_ENOMEM, "out of memory");
        } else {
          /* StripAccents drops every combining mark (Mn, Mc, Me), as `tokenizers` does. */
          utf8proc_category_t cat = utf8proc_category((utf8proc_int32_t)cp);
          bool mark = cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
          if (!mark && !tk_buf_put(out, s + i, (size_t)l)) return pd_err_set(e, PD_ENOMEM, "out of memory");
        }
        i += (size_t)l;
      }
      return PD_OK;
    }
    case TK_NORM_PREPEND:
    case TK_NORM_APPEND: {
      /* `tokenizers` leaves empty strings alone. */
      if (!n) return PD_OK;
      bool ok = x->type == TK_NORM_PREPEND
                    ? tk_buf_put(out, x->str, x->str_len) && tk_buf_put(out, s, n)
                    : tk_buf_put(out, s, n) && tk_buf_put(out, x->str, x->str_len);
      return ok ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    case TK_NORM_REPLACE:
      return tk_replace_all(x->re, x->pat, x->pat_len, x->str, x->str_len, s, n, sc->md,
                            &sc->ranges, out, e);
    case TK_NORM_STRIP: {
      size_t a = 0, b = n;
      if (x->left) {
        while (a < b) {
          uint32_t cp;
          int l = tk_utf8_next(s + a, b - a, &cp);
          if (!tk_is_white_space(cp)) break;
          a += (size_t)l;
        }
      }
      if (x->right) {
        while (b > a) {
          size_t k = b - 1;
          while (k > a && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
          uint32_t cp;
          tk_utf8_next(s + k, b - k, &cp);
          if (!tk_is_white_space(cp)) break;
          b = k;
        }
      }
      return tk_buf_put(out, s + a, b - a) ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    case TK_NORM_BYTELEVEL:
      return tk_bytelevel_encode(out, s, n) ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  return pd_err_set(e, PD_EUNSUPPORTED, "unknown normalizer");
}

pd_status tk_norm_apply(const tk_norm *v, size_t nv, const char *s, size_t n, tk_buf *out,
                        tk_scratch *sc, pd_err *e) {
  out->n = 0;
  if (!nv) return tk_buf_put(out, s, n) ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
  /* Ping-pong between out and sc->tmp2 so that the last stage writes into out. */
  tk_buf *bufs[2] = {out, &sc->tmp2};
  int cur = (nv % 2 == 1) ? 0 : 1; /* the buffer the first stage writes */
  const char *src = s;
  size_t srcn = n;
  for (size_t i = 0; i < nv; i++) {
    tk_buf *dst = bufs[cur];
    dst->n = 0;
    pd_status st = apply_one(&v[i], src, srcn, dst, sc, e);
    if (st) return st;
    src = dst->p ? dst->p : "";
    srcn = dst->n;
    cur ^= 1;
  }
  return PD_OK;
}

/* A Jinja2-subset interpreter for Hugging Face chat templates (see pd/chat_template.h).
 *
 * Reference behaviour: what transformers does in apply_chat_template, i.e.
 *   ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
 *                                 extensions=[AssistantTracker, jinja2.ext.loopcontrols])
 * with keep_trailing_newline=False, the "tojson" filter replaced by
 *   json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
 * and the globals raise_exception(msg) and strftime_now(fmt); render() gets messages, tools=None,
 * documents=None, add_generation_prompt and the special tokens (bos_token, eos_token).
 * Output must match Python jinja2 byte for byte, so values follow Python semantics: str() of None
 * is "None", floats print as Python's shortest repr, lists print as Python reprs, strings are
 * indexed by code point, str.strip() strips Unicode whitespace, undefined values render as "".
 *
 * Structure: source normalisation -> lexer (whitespace control happens here, as in jinja2's
 * lexer) -> recursive-descent parser to an AST (arena-owned by the template) -> tree-walking
 * evaluator. Every value made while rendering lives in one per-render arena, so values need no
 * reference counts and nothing can leak; errors unwind with longjmp to the render entry, which
 * frees the arena and the output buffer.
 *
 * Bounds (a template is untrusted input): parser nesting depth, evaluator recursion depth, a step
 * budget (statements, loop iterations and per-item work of filters), range() length (100000, as
 * jinja2's sandbox), output size and arena size (both scale with the size of the input messages).
 * Exceeding one is PD_EINVAL with a message that names the limit.
 *
 * Error codes: syntax errors PD_EINVAL; tags, filters, tests, methods and functions outside the
 * subset PD_EUNSUPPORTED (tags at parse time; filters, tests and functions when first evaluated,
 * since jinja2 accepts templates that name them in branches never taken); runtime type errors
 * and raise_exception() PD_EINVAL. Messages start with "chat template:LINE:COL:".
 *
 * Numbers are formatted and parsed with the C library in the "C" locale (the server never calls
 * setlocale for LC_NUMERIC). Integers are 64-bit: arithmetic that would overflow is an error where
 * Python would switch to big integers. Case mappings use utf8proc's simple mappings (plus the
 * German sharp s), which matches Python for everything but a handful of special-cased letters. */
#include "pd/chat_template.h"

#include <ctype.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <utf8proc.h>

/* ---- limits ------------------------------------------------------------------------------ */
#define CT_PARSE_DEPTH_MAX 200         /* nested expressions / blocks while parsing */
#define CT_RENDER_DEPTH_MAX 1000       /* evaluator recursion (expressions, blocks, macro calls) */
#define CT_STEPS_MAX 20000000ull       /* statements + loop iterations + per-item filter work */
#define CT_RANGE_MAX 100000            /* jinja2.sandbox.MAX_RANGE */
#define CT_OUT_BASE ((size_t)16 << 20) /* output cap: this + 4 x input bytes */
#define CT_MEM_BASE ((size_t)256 << 20) /* render arena cap: this + 16 x input bytes */
#define CT_BLOCK ((size_t)64 << 10)    /* arena block size */
#define CT_NOPOS UINT32_MAX

/* ---- errors: longjmp to the entry point ---------------------------------------------------- */
typedef struct jerr {
  jmp_buf jb;
  pd_status code;
  char msg[PD_ERR_MSG_MAX];
  const char *src; /* normalised template source, for line:col */
  size_t srcn;
} jerr;

static void pos_linecol(const char *src, size_t n, uint32_t pos, unsigned *line, unsigned *col) {
  unsigned l = 1, c = 1;
  for (size_t i = 0; i < n && i < pos; i++) {
    if (src[i] == '\n') {
      l++;
      c = 1;
    } else if (((unsigned char)src[i] & 0xC0) != 0x80) {
      c++;
    }
  }
  *line = l;
  *col = c;
}

static _Noreturn void __attribute__((format(printf, 4, 5)))
jfail(jerr *j, uint32_t pos, pd_status code, const char *fmt, ...) {
  char m[PD_ERR_MSG_MAX - 64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  if (pos == CT_NOPOS || !j->src) {
    snprintf(j->msg, sizeof j->msg, "chat template: %s", m);
  } else {
    unsigned l, c;
    pos_linecol(j->src, j->srcn, pos, &l, &c);
    snprintf(j->msg, sizeof j->msg, "chat template:%u:%u: %s", l, c, m);
  }
  j->code = code;
  longjmp(j->jb, 1);
}

/* ---- arena ---------------------------------------------------------------------------------- */
typedef struct ablk {
  struct ablk *next;
  size_t cap, used;
} ablk;
#define A16(x) (((x) + 15) & ~(size_t)15)
#define ABLK_HDR A16(sizeof(ablk))

typedef struct arena {
  ablk *head;
  size_t total, limit; /* bytes held in blocks; cap (SIZE_MAX: none) */
  char *last;          /* most recent allocation in head (can grow in place) */
  bool over;           /* the last failure was the cap, not malloc */
} arena;

/* Returns 16-byte aligned memory, or NULL when malloc fails or the cap would be exceeded. */
static void *arena_alloc(arena *a, size_t n) {
  size_t need = A16(n ? n : 1);
  if (need < n) return NULL;
  ablk *h = a->head;
  if (h && h->cap - h->used >= need) {
    char *p = (char *)h + ABLK_HDR + h->used;
    h->used += need;
    a->last = p;
    return p;
  }
  bool big = need > CT_BLOCK / 4;
  size_t cap = big ? need : CT_BLOCK;
  a->over = false;
  if (cap > a->limit || a->total > a->limit - cap) {
    a->over = true;
    return NULL;
  }
  ablk *b = malloc(ABLK_HDR + cap);
  if (!b) return NULL;
  a->total += cap;
  b->cap = cap;
  b->used = need;
  char *p = (char *)b + ABLK_HDR;
  if (big && h) { /* keep the head's free space usable */
    b->next = h->next;
    h->next = b;
  } else {
    b->next = h;
    a->head = b;
    a->last = p;
  }
  return p;
}

/* Grows the most recent allocation p to n bytes in place; false when that is not possible. */
static bool arena_extend(arena *a, void *p, size_t n) {
  ablk *h = a->head;
  if (!h || !p || p != a->last) return false;
  size_t start = (size_t)((char *)p - ((char *)h + ABLK_HDR));
  size_t need = A16(n);
  if (need < n || need > h->cap - start) return false;
  h->used = start + need;
  return true;
}

static void arena_free(arena *a) {
  ablk *b = a->head;
  while (b) {
    ablk *n = b->next;
    free(b);
    b = n;
  }
  a->head = NULL;
  a->total = 0;
  a->last = NULL;
}

/* ---- UTF-8 and Python's character classes ------------------------------------------------- */
/* Decodes one code point; invalid or truncated sequences decode as one byte (cp 0xFFFD) so that
 * byte-preserving operations keep them unchanged. Returns bytes consumed (>= 1). */
static size_t u8dec(const char *s, size_t n, uint32_t *cp) {
  const unsigned char *p = (const unsigned char *)s;
  unsigned char c = p[0];
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len;
  uint32_t v;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    v = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    v = c & 0x07;
  } else {
    *cp = 0xFFFD;
    return 1;
  }
  if (len > n) {
    *cp = 0xFFFD;
    return 1;
  }
  for (size_t i = 1; i < len; i++) {
    if ((p[i] & 0xC0) != 0x80) {
      *cp = 0xFFFD;
      return 1;
    }
    v = (v << 6) | (p[i] & 0x3F);
  }
  if ((len == 3 && v < 0x800) || (len == 4 && (v < 0x10000 || v > 0x10FFFF))) {
    *cp = 0xFFFD;
    return 1;
  }
  *cp = v;
  return len;
}

static size_t u8enc(uint32_t c, char *o) {
  if (c < 0x80) {
    o[0] = (char)c;
    return 1;
  }
  if (c < 0x800) {
    o[0] = (char)(0xC0 | (c >> 6));
    o[1] = (char)(0x80 | (c & 0x3F));
    return 2;
  }
  if (c < 0x10000) {
    o[0] = (char)(0xE0 | (c >> 12));
    o[1] = (char)(0x80 | ((c >> 6) & 0x3F));
    o[2] = (char)(0x80 | (c & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (c >> 18));
  o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((c >> 6) & 0x3F));
  o[3] = (char)(0x80 | (c & 0x3F));
  return 4;
}

/* Start of the code point that ends at s[n-1]. */
static size_t u8prev(const char *s, size_t n) {
  size_t i = n - 1;
  size_t k = 0;
  while (i > 0 && k < 3 && ((unsigned char)s[i] & 0xC0) == 0x80) {
    i--;
    k++;
  }
  uint32_t cp;
  if (u8dec(s + i, n - i, &cp) == n - i) return i;
  return n - 1;
}

/* Python str.isspace(): bidi class WS/B/S or category Zs. */
static bool py_isspace(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

/* Python str.splitlines() boundaries (\r\n is handled by the caller). */
static bool py_islinebreak(uint32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

static bool py_isprintable(uint32_t c) {
  if (c == ' ') return true;
  if (c < 0x20 || c == 0x7F) return false;
  if (c < 0x7F) return true;
  switch (utf8proc_category((utf8proc_int32_t)c)) {
  case UTF8PROC_CATEGORY_CN:
  case UTF8PROC_CATEGORY_CC:
  case UTF8PROC_CATEGORY_CF:
  case UTF8PROC_CATEGORY_CS:
  case UTF8PROC_CATEGORY_CO:
  case UTF8PROC_CATEGORY_ZS:
  case UTF8PROC_CATEGORY_ZL:
  case UTF8PROC_CATEGORY_ZP:
    return false;
  default:
    return true;
  }
}

static bool cp_iscased(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  int cat = utf8proc_category((utf8proc_int32_t)c);
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}
static bool cp_islower(uint32_t c) {
  if (c < 0x80) return c >= 'a' && c <= 'z';
  return utf8proc_category((utf8proc_int32_t)c) == UTF8PROC_CATEGORY_LL;
}
static bool cp_isupper(uint32_t c) {
  if (c < 0x80) return c >= 'A' && c <= 'Z';
  int cat = utf8proc_category((utf8proc_int32_t)c);
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LT;
}
static bool cp_isdigit(uint32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return utf8proc_category((utf8proc_int32_t)c) == UTF8PROC_CATEGORY_ND;
}
static bool cp_isalpha(uint32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  int cat = utf8proc_category((utf8proc_int32_t)c);
  return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}

/* ---- values --------------------------------------------------------------------------------- */
typedef enum vtype {
  VT_UNDEF, /* jinja2 Undefined: renders "", falsy, iterates as empty */
  VT_NONE,
  VT_BOOL,
  VT_INT,
  VT_FLOAT,
  VT_STR,
  VT_LIST, /* list or tuple (tuple flag) */
  VT_DICT,
  VT_NS,   /* namespace(): a mutable dict reached through attributes */
  VT_FUNC, /* builtin, macro or bound method */
  VT_LOOP  /* the "loop" variable of a for block */
} vtype;

typedef struct vlist vlist;
typedef struct vdict vdict;
typedef struct vfunc vfunc;
typedef struct vloop vloop;

typedef struct value {
  uint8_t t;
  uint8_t tuple; /* VT_LIST: Python tuple (repr uses parentheses) */
  union {
    bool b;
    int64_t i;
    double f;
    struct {
      const char *p;
      size_t n;
    } s;
    vlist *l;
    vdict *d;
    vfunc *fn;
    vloop *lp;
    const char *uname; /* VT_UNDEF: what was undefined, for messages (may be NULL) */
  } u;
} value;

struct vlist {
  size_t n;
  value *v;
};
struct vdict { /* insertion-ordered, linear lookup (template dicts are small) */
  size_t n, cap;
  value *k, *v;
};
enum { FN_BUILTIN, FN_MACRO, FN_METHOD };
struct stmt;
struct vfunc {
  int kind;
  int id;               /* FN_BUILTIN: BI_* */
  const char *name;     /* builtin / macro / method name */
  const struct stmt *macro;
  value self;           /* FN_METHOD: the receiver */
};
struct vloop {
  size_t i, n;          /* current index0, length */
  const value *items;
};

typedef struct strv {
  const char *p;
  size_t n;
} strv;

static value V_undef(const char *name) {
  value v;
  memset(&v, 0, sizeof v);
  v.t = VT_UNDEF;
  v.u.uname = name;
  return v;
}
static value V_none(void) {
  value v;
  memset(&v, 0, sizeof v);
  v.t = VT_NONE;
  return v;
}
static value V_bool(bool b) {
  value v = V_none();
  v.t = VT_BOOL;
  v.u.b = b;
  return v;
}
static value V_int(int64_t i) {
  value v = V_none();
  v.t = VT_INT;
  v.u.i = i;
  return v;
}
static value V_float(double f) {
  value v = V_none();
  v.t = VT_FLOAT;
  v.u.f = f;
  return v;
}
static value V_str(const char *p, size_t n) {
  value v = V_none();
  v.t = VT_STR;
  v.u.s.p = p;
  v.u.s.n = n;
  return v;
}
static value V_strv(strv s) { return V_str(s.p, s.n); }
static value V_cstr(const char *s) { return V_str(s, strlen(s)); }
static value V_list(vlist *l, bool tuple) {
  value v = V_none();
  v.t = VT_LIST;
  v.tuple = tuple;
  v.u.l = l;
  return v;
}
static value V_dict(vdict *d, vtype t) {
  value v = V_none();
  v.t = (uint8_t)t;
  v.u.d = d;
  return v;
}

static const char *type_name(const value *v) {
  switch (v->t) {
  case VT_UNDEF: return "Undefined";
  case VT_NONE: return "NoneType";
  case VT_BOOL: return "bool";
  case VT_INT: return "int";
  case VT_FLOAT: return "float";
  case VT_STR: return "str";
  case VT_LIST: return v->tuple ? "tuple" : "list";
  case VT_DICT: return "dict";
  case VT_NS: return "Namespace";
  case VT_FUNC: return "function";
  case VT_LOOP: return "LoopContext";
  }
  return "?";
}

static bool is_num(const value *v) { return v->t == VT_INT || v->t == VT_FLOAT || v->t == VT_BOOL; }
static double num_f(const value *v) {
  return v->t == VT_FLOAT ? v->u.f : v->t == VT_INT ? (double)v->u.i : (double)v->u.b;
}
/* Integer value of an int or bool (callers check the type first). */
static int64_t num_i(const value *v) { return v->t == VT_INT ? v->u.i : v->t == VT_BOOL ? (int64_t)v->u.b : 0; }
static bool strv_eq(strv a, const char *b) { return a.n == strlen(b) && memcmp(a.p, b, a.n) == 0; }

/* Python float repr (shortest string that round-trips; exponent form when the decimal point
 * position is < -3 or > 16). buf must hold 32 bytes. */
static size_t fmt_pyfloat(double d, char *buf, bool json) {
  if (isnan(d)) return (size_t)sprintf(buf, "%s", json ? "NaN" : "nan");
  if (isinf(d)) return (size_t)sprintf(buf, "%s", d < 0 ? (json ? "-Infinity" : "-inf") : (json ? "Infinity" : "inf"));
  if (d == 0) return (size_t)sprintf(buf, "%s", signbit(d) ? "-0.0" : "0.0");
  char tmp[48];
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(tmp, sizeof tmp, "%.*e", prec - 1, d);
    if (strtod(tmp, NULL) == d) break;
  }
  const char *p = tmp;
  bool neg = *p == '-';
  if (neg) p++;
  char dig[24];
  int nd = 0;
  while (*p && *p != 'e') {
    if (*p >= '0' && *p <= '9' && nd < 20) dig[nd++] = *p;
    p++;
  }
  int ex = *p == 'e' ? atoi(p + 1) : 0;
  while (nd > 1 && dig[nd - 1] == '0') nd--;
  int decpt = ex + 1;
  char *o = buf;
  if (neg) *o++ = '-';
  if (decpt > 16 || decpt < -3) {
    *o++ = dig[0];
    if (nd > 1) {
      *o++ = '.';
      memcpy(o, dig + 1, (size_t)nd - 1);
      o += nd - 1;
    }
    o += sprintf(o, "e%c%02d", ex < 0 ? '-' : '+', ex < 0 ? -ex : ex);
  } else if (decpt <= 0) {
    *o++ = '0';
    *o++ = '.';
    for (int i = 0; i < -decpt; i++) *o++ = '0';
    memcpy(o, dig, (size_t)nd);
    o += nd;
  } else if (decpt >= nd) {
    memcpy(o, dig, (size_t)nd);
    o += nd;
    for (int i = nd; i < decpt; i++) *o++ = '0';
    *o++ = '.';
    *o++ = '0';
  } else {
    memcpy(o, dig, (size_t)decpt);
    o += decpt;
    *o++ = '.';
    memcpy(o, dig + decpt, (size_t)(nd - decpt));
    o += nd - decpt;
  }
  *o = 0;
  return (size_t)(o - buf);
}

/* ---- AST -------------------------------------------------------------------------------------- */
typedef enum exkind {
  EX_CONST,
  EX_NAME,
  EX_LIST,   /* args */
  EX_TUPLE,  /* args */
  EX_DICT,   /* args: k0, v0, k1, v1, ... */
  EX_ATTR,   /* a.name */
  EX_ITEM,   /* a[b] */
  EX_SLICE,  /* a[args[0]:args[1]:args[2]], each may be NULL */
  EX_CALL,   /* a(args, kw) */
  EX_FILTER, /* a|name(args, kw); a is NULL in a filter block */
  EX_TEST,   /* a is [not] name(args, kw) */
  EX_NEG,
  EX_POS,
  EX_NOT,
  EX_BIN,    /* a op b for + - * / // % ** */
  EX_AND,
  EX_OR,
  EX_CMP,    /* a ops[0] args[0] ops[1] args[1] ... (chained like Python) */
  EX_CONCAT, /* args joined by ~ */
  EX_COND    /* b if a else c (c may be NULL) */
} exkind;

typedef struct expr {
  uint8_t kind, op;
  bool neg;      /* EX_TEST: "is not" */
  uint32_t pos;  /* byte offset in the normalised source */
  int fid;       /* EX_FILTER / EX_TEST: table index, -1 when not known */
  value cv;      /* EX_CONST */
  const char *name;
  struct expr *a, *b, *c;
  struct expr **args;
  size_t nargs;
  const char **kwn;
  struct expr **kwv;
  size_t nkw;
  uint8_t *ops;  /* EX_CMP: one OP_* per args[i] */
} expr;

typedef enum stkind {
  ST_DATA,
  ST_OUT,
  ST_IF,       /* e; body; orelse (an elif is a single ST_IF in orelse) */
  ST_FOR,      /* target in e [if cond]; body; orelse */
  ST_SET,      /* target = e */
  ST_SETBLOCK, /* target = capture(body) | filter */
  ST_MACRO,
  ST_BREAK,
  ST_CONTINUE,
  ST_BLOCK     /* {% generation %}: renders its body */
} stkind;

typedef struct stmt stmt;
typedef struct slist {
  stmt **v;
  size_t n;
} slist;

struct stmt {
  uint8_t kind;
  uint32_t pos;
  const char *text; /* ST_DATA */
  size_t len;
  expr *e;
  expr *cond;
  expr *target;     /* EX_NAME, EX_TUPLE of EX_NAME, or EX_ATTR on an EX_NAME (namespace) */
  expr *filter;     /* ST_SETBLOCK: filter chain whose innermost input is NULL */
  const char *name; /* ST_MACRO */
  const char **params;
  expr **defaults;  /* ST_MACRO: NULL entries for parameters without default */
  size_t nparams;
  slist body, orelse;
};

struct pd_chat_template {
  arena a;         /* owns the AST, strings and the normalised source */
  const char *src; /* normalised source: \r\n and \r -> \n, one trailing newline dropped */
  size_t n;
  slist body;
};

/* ---- lexer ------------------------------------------------------------------------------------ */
enum { TK_EOF, TK_DATA, TK_VBEGIN, TK_VEND, TK_BBEGIN, TK_BEND, TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP };
enum {
  OP_NONE,
  OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_TILDE,
  OP_LBRACKET, OP_RBRACKET, OP_LPAREN, OP_RPAREN, OP_LBRACE, OP_RBRACE,
  OP_EQ, OP_NE, OP_GT, OP_GE, OP_LT, OP_LE, OP_ASSIGN, OP_DOT, OP_COLON, OP_PIPE, OP_COMMA, OP_SEMI,
  OP_IN, OP_NOTIN /* comparison operators only, never lexed */
};
static const struct {
  const char *s;
  uint8_t op;
} OPS[] = {
    {"//", OP_FLOORDIV}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE}, {">=", OP_GE}, {"<=", OP_LE},
    {"+", OP_ADD}, {"-", OP_SUB}, {"/", OP_DIV}, {"*", OP_MUL}, {"%", OP_MOD}, {"~", OP_TILDE},
    {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"(", OP_LPAREN}, {")", OP_RPAREN}, {"{", OP_LBRACE},
    {"}", OP_RBRACE}, {">", OP_GT}, {"<", OP_LT}, {"=", OP_ASSIGN}, {".", OP_DOT}, {":", OP_COLON},
    {"|", OP_PIPE}, {",", OP_COMMA}, {";", OP_SEMI},
};

typedef struct token {
  uint8_t type, op;
  uint32_t pos;
  const char *s; /* TK_DATA / TK_NAME: slice of the source; TK_STRING: decoded, in the arena */
  size_t n;
  int64_t i;
  double f;
} token;

typedef struct P {
  jerr j;
  arena *a;   /* the template's arena */
  arena tmp;  /* token array */
  token *tk;
  size_t ntk, captk, i;
  int depth;  /* parser recursion */
  int loops;  /* enclosing for blocks (break/continue check) */
} P;

static void *pnew(P *p, size_t n) {
  void *m = arena_alloc(p->a, n);
  if (!m) jfail(&p->j, CT_NOPOS, PD_ENOMEM, "out of memory");
  memset(m, 0, n);
  return m;
}
static char *pstrdup(P *p, const char *s, size_t n) {
  char *m = pnew(p, n + 1);
  memcpy(m, s, n);
  m[n] = 0;
  return m;
}

static token *push_tok(P *p, int type, size_t pos) {
  if (p->ntk == p->captk) {
    size_t nc = p->captk ? p->captk * 2 : 256;
    token *nt = arena_alloc(&p->tmp, nc * sizeof *nt);
    if (!nt) jfail(&p->j, CT_NOPOS, PD_ENOMEM, "out of memory");
    if (p->ntk) memcpy(nt, p->tk, p->ntk * sizeof *nt);
    p->tk = nt;
    p->captk = nc;
  }
  token *t = &p->tk[p->ntk++];
  memset(t, 0, sizeof *t);
  t->type = (uint8_t)type;
  t->pos = (uint32_t)pos;
  return t;
}

static size_t skip_ws(const char *s, size_t n, size_t i) {
  while (i < n) {
    uint32_t c;
    size_t k = u8dec(s + i, n - i, &c);
    if (!py_isspace(c)) break;
    i += k;
  }
  return i;
}
static size_t rstrip_ws_len(const char *s, size_t n) {
  while (n) {
    size_t k = u8prev(s, n);
    uint32_t c;
    u8dec(s + k, n - k, &c);
    if (!py_isspace(c)) break;
    n = k;
  }
  return n;
}

/* The whitespace control that jinja2's lexer applies to the text before a tag: "-" strips all
 * trailing whitespace; otherwise, with lstrip_blocks and a block or comment tag (not "{{", not
 * "+"), spaces between the start of the line and the tag are removed. Returns the kept length. */
static size_t strip_before(const char *text, size_t n, char sign, bool is_var, bool line_starting) {
  if (sign == '-') return rstrip_ws_len(text, n);
  if (sign == '+' || is_var) return n;
  size_t l = n;
  while (l > 0 && text[l - 1] != '\n') l--;
  if ((l > 0 || line_starting) && n > l && skip_ws(text, n, l) == n) return l;
  return n;
}

/* Matches "{%[-+]? \s* word \s*" + an end at s+i. raw begin: "-%}\s*" | "%}" (no trim_blocks);
 * endraw: "+%}" | "-%}\s*" | "%}\n?". */
static bool match_rawtag(const char *s, size_t n, size_t i, const char *word, bool is_end, char *sign,
                         size_t *end) {
  if (i + 2 > n || s[i] != '{' || s[i + 1] != '%') return false;
  size_t j = i + 2;
  char sg = 0;
  if (j < n && (s[j] == '-' || s[j] == '+')) sg = s[j++];
  j = skip_ws(s, n, j);
  size_t wl = strlen(word);
  if (j + wl > n || memcmp(s + j, word, wl) != 0) return false;
  j = skip_ws(s, n, j + wl);
  if (is_end && j + 3 <= n && s[j] == '+' && s[j + 1] == '%' && s[j + 2] == '}') {
    j += 3;
  } else if (j + 3 <= n && s[j] == '-' && s[j + 1] == '%' && s[j + 2] == '}') {
    j = skip_ws(s, n, j + 3);
  } else if (j + 2 <= n && s[j] == '%' && s[j + 1] == '}') {
    j += 2;
    if (is_end && j < n && s[j] == '\n') j++;
  } else {
    return false;
  }
  *sign = sg;
  *end = j;
  return true;
}

static void emit_data(P *p, const char *s, size_t start, size_t len) {
  if (!len) return;
  token *t = push_tok(p, TK_DATA, start);
  t->s = s + start;
  t->n = len;
}

static bool isdig(char c) { return c >= '0' && c <= '9'; }

/* (\d+_)*\d+ at i; returns the end or i when no digit. */
static size_t scan_digits(const char *s, size_t n, size_t i) {
  if (i >= n || !isdig(s[i])) return i;
  size_t j = i;
  for (;;) {
    while (j < n && isdig(s[j])) j++;
    if (j + 1 < n && s[j] == '_' && isdig(s[j + 1])) {
      j++;
      continue;
    }
    return j;
  }
}

/* Decodes a string literal body like Python's unicode-escape after backslashreplace (what
 * jinja2's lexer does): known escapes are decoded, unknown ones keep their backslash. */
static strv decode_string(P *p, const char *s, size_t n, uint32_t pos) {
  char *o = pnew(p, 2 * n + 1);
  size_t k = 0;
  for (size_t i = 0; i < n;) {
    char c = s[i];
    if (c != '\\' || i + 1 >= n) {
      o[k++] = c;
      i++;
      continue;
    }
    char d = s[i + 1];
    i += 2;
    uint32_t cp;
    int nhex = 0;
    switch (d) {
    case '\n': continue;
    case '\\': o[k++] = '\\'; continue;
    case '\'': o[k++] = '\''; continue;
    case '"': o[k++] = '"'; continue;
    case 'a': o[k++] = 7; continue;
    case 'b': o[k++] = 8; continue;
    case 'f': o[k++] = 12; continue;
    case 'n': o[k++] = 10; continue;
    case 'r': o[k++] = 13; continue;
    case 't': o[k++] = 9; continue;
    case 'v': o[k++] = 11; continue;
    case 'x': nhex = 2; break;
    case 'u': nhex = 4; break;
    case 'U': nhex = 8; break;
    case 'N': jfail(&p->j, pos, PD_EUNSUPPORTED, "\\N{...} escapes are not supported");
    default:
      if (d >= '0' && d <= '7') {
        cp = (uint32_t)(d - '0');
        for (int q = 0; q < 2 && i < n && s[i] >= '0' && s[i] <= '7'; q++) cp = cp * 8 + (uint32_t)(s[i++] - '0');
        k += u8enc(cp, o + k);
      } else if ((unsigned char)d >= 0x80) {
        /* backslashreplace turned the character into \xhh / \uhhhh / \Uhhhhhhhh, and the
         * backslash before it escaped that escape's backslash */
        size_t len = u8dec(s + i - 1, n - (i - 1), &cp);
        i += len - 1;
        k += (size_t)sprintf(o + k, cp <= 0xFF ? "\\x%02x" : cp <= 0xFFFF ? "\\u%04x" : "\\U%08x", cp);
      } else {
        o[k++] = '\\';
        o[k++] = d;
      }
      continue;
    }
    cp = 0;
    for (int q = 0; q < nhex; q++) {
      char h = i < n ? s[i] : 0;
      int v = isdig(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
      if (v < 0) jfail(&p->j, pos, PD_EINVAL, "truncated \\%c escape in string literal", d);
      cp = cp * 16 + (uint32_t)v;
      i++;
    }
    if (cp > 0x10FFFF) jfail(&p->j, pos, PD_EINVAL, "illegal Unicode character in string literal");
    k += u8enc(cp, o + k);
  }
  o[k] = 0;
  return (strv){o, k};
}

/* Lexes one {{ }} or {% %} body starting at *pos (after the opening delimiter and its sign).
 * Returns with *pos after the end tag and *line_starting updated. */
static void lex_tag(P *p, const char *s, size_t n, size_t *pos, bool is_block, bool *line_starting) {
  size_t i = *pos;
  char bal[CT_PARSE_DEPTH_MAX];
  int nb = 0;
  for (;;) {
    if (i >= n) { /* unterminated: the parser reports it at the EOF token */
      *pos = n;
      return;
    }
    if (nb == 0) {
      size_t end = 0;
      if (is_block) {
        if (i + 3 <= n && s[i] == '+' && s[i + 1] == '%' && s[i + 2] == '}') end = i + 3;
        else if (i + 3 <= n && s[i] == '-' && s[i + 1] == '%' && s[i + 2] == '}') end = skip_ws(s, n, i + 3);
        else if (i + 2 <= n && s[i] == '%' && s[i + 1] == '}') {
          end = i + 2;
          if (end < n && s[end] == '\n') end++; /* trim_blocks */
        }
      } else {
        if (i + 3 <= n && s[i] == '-' && s[i + 1] == '}' && s[i + 2] == '}') end = skip_ws(s, n, i + 3);
        else if (i + 2 <= n && s[i] == '}' && s[i + 1] == '}') end = i + 2;
      }
      if (end) {
        push_tok(p, is_block ? TK_BEND : TK_VEND, i);
        *line_starting = s[end - 1] == '\n';
        *pos = end;
        return;
      }
    }
    size_t w = skip_ws(s, n, i);
    if (w != i) {
      i = w;
      continue;
    }
    char c = s[i];
    /* float: (?<!\.)(\d+_)*\d+((\.(\d+_)*\d+)?e[+\-]?(\d+_)*\d+|\.(\d+_)*\d+) */
    if (isdig(c) && !(i > 0 && s[i - 1] == '.')) {
      size_t j = scan_digits(s, n, i), k = j;
      bool frac = false, isf = false;
      if (k + 1 < n && s[k] == '.' && isdig(s[k + 1])) {
        k = scan_digits(s, n, k + 1);
        frac = true;
      }
      if (k < n && (s[k] == 'e' || s[k] == 'E')) {
        size_t m = k + 1;
        if (m < n && (s[m] == '+' || s[m] == '-')) m++;
        size_t e2 = scan_digits(s, n, m);
        if (e2 > m) {
          k = e2;
          isf = true;
        }
      }
      if (!isf && frac) isf = true;
      if (isf) {
        char buf[128];
        size_t bn = 0;
        for (size_t q = i; q < k && bn < sizeof buf - 1; q++)
          if (s[q] != '_') buf[bn++] = s[q];
        buf[bn] = 0;
        token *t = push_tok(p, TK_FLOAT, i);
        t->f = strtod(buf, NULL);
        i = k;
        continue;
      }
    }
    if (isdig(c)) { /* integer: 0b / 0o / 0x, [1-9](_?\d)*, 0(_?0)* */
      size_t j = i;
      int base = 10;
      if (c == '0' && i + 2 < n && strchr("bBoOxX", s[i + 1])) {
        char b = (char)tolower((unsigned char)s[i + 1]);
        base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
        size_t k = i + 2;
        size_t digits = 0;
        for (;;) {
          size_t m = k;
          if (m < n && s[m] == '_') m++;
          int v = -1;
          if (m < n) {
            char h = (char)tolower((unsigned char)s[m]);
            v = isdig(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : -1;
          }
          if (v < 0 || v >= base) break;
          k = m + 1;
          digits++;
        }
        if (digits) j = k;
        else base = 10;
      }
      if (base == 10) {
        j = i + 1;
        if (c == '0') {
          for (;;) {
            if (j < n && s[j] == '0') j++;
            else if (j + 1 < n && s[j] == '_' && s[j + 1] == '0') j += 2;
            else break;
          }
        } else {
          for (;;) {
            if (j < n && isdig(s[j])) j++;
            else if (j + 1 < n && s[j] == '_' && isdig(s[j + 1])) j += 2;
            else break;
          }
        }
      }
      uint64_t v = 0;
      size_t q = base == 10 ? i : i + 2;
      for (; q < j; q++) {
        if (s[q] == '_') continue;
        char h = (char)tolower((unsigned char)s[q]);
        uint64_t d = (uint64_t)(isdig(h) ? h - '0' : h - 'a' + 10);
        if (v > (UINT64_MAX - d) / (uint64_t)base || v * (uint64_t)base + d > (uint64_t)INT64_MAX)
          jfail(&p->j, (uint32_t)i, PD_EUNSUPPORTED, "integer literal does not fit in 64 bits");
        v = v * (uint64_t)base + d;
      }
      token *t = push_tok(p, TK_INT, i);
      t->i = (int64_t)v;
      i = j;
      continue;
    }
    if (c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
      size_t j = i + 1;
      while (j < n && (s[j] == '_' || isdig(s[j]) || (s[j] >= 'a' && s[j] <= 'z') || (s[j] >= 'A' && s[j] <= 'Z'))) j++;
      token *t = push_tok(p, TK_NAME, i);
      t->s = s + i;
      t->n = j - i;
      i = j;
      continue;
    }
    if (c == '\'' || c == '"') {
      size_t j = i + 1;
      while (j < n && s[j] != c) j += (s[j] == '\\' && j + 1 < n) ? 2 : 1;
      if (j >= n) jfail(&p->j, (uint32_t)i, PD_EINVAL, "unterminated string literal");
      strv d = decode_string(p, s + i + 1, j - i - 1, (uint32_t)i);
      token *t = push_tok(p, TK_STRING, i);
      t->s = d.p;
      t->n = d.n;
      i = j + 1;
      continue;
    }
    size_t oi;
    for (oi = 0; oi < sizeof OPS / sizeof OPS[0]; oi++) {
      size_t l = strlen(OPS[oi].s);
      if (i + l <= n && memcmp(s + i, OPS[oi].s, l) == 0) break;
    }
    if (oi == sizeof OPS / sizeof OPS[0]) {
      uint32_t cp;
      size_t l = u8dec(s + i, n - i, &cp);
      jfail(&p->j, (uint32_t)i, PD_EINVAL, "unexpected character '%.*s'", (int)l, s + i);
    }
    uint8_t op = OPS[oi].op;
    if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
      if (nb == (int)sizeof bal) jfail(&p->j, (uint32_t)i, PD_EINVAL, "brackets nested too deeply (limit %d)", CT_PARSE_DEPTH_MAX);
      bal[nb++] = op == OP_LPAREN ? ')' : op == OP_LBRACKET ? ']' : '}';
    } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
      if (!nb) jfail(&p->j, (uint32_t)i, PD_EINVAL, "unexpected '%c'", c);
      if (bal[nb - 1] != c) jfail(&p->j, (uint32_t)i, PD_EINVAL, "unexpected '%c', expected '%c'", c, bal[nb - 1]);
      nb--;
    }
    token *t = push_tok(p, TK_OP, i);
    t->op = op;
    i += strlen(OPS[oi].s);
  }
}

/* Tokenises the whole (normalised) source, mirroring jinja2.lexer.Lexer.tokeniter with
 * trim_blocks=True and lstrip_blocks=True. */
static void lex(P *p, const char *s, size_t n) {
  size_t pos = 0;
  bool line_starting = true;
  while (pos < n) {
    size_t i = pos;
    while (i + 1 < n && !(s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#'))) i++;
    if (i + 1 >= n) {
      emit_data(p, s, pos, n - pos);
      break;
    }
    char kind = s[i + 1];
    char sign = (i + 2 < n && (s[i + 2] == '-' || s[i + 2] == '+')) ? s[i + 2] : 0;
    size_t raw_end = 0;
    char raw_sign = 0;
    bool raw = kind == '%' && match_rawtag(s, n, i, "raw", false, &raw_sign, &raw_end);
    if (raw) sign = raw_sign;
    emit_data(p, s, pos, strip_before(s + pos, i - pos, sign, kind == '{', line_starting));
    if (raw) {
      line_starting = s[raw_end - 1] == '\n';
      size_t j = raw_end, end = 0;
      char esign = 0;
      for (; j + 1 < n; j++)
        if (s[j] == '{' && s[j + 1] == '%' && match_rawtag(s, n, j, "endraw", true, &esign, &end)) break;
      if (j + 1 >= n) jfail(&p->j, (uint32_t)i, PD_EINVAL, "missing end of raw directive");
      emit_data(p, s, raw_end, strip_before(s + raw_end, j - raw_end, esign, false, line_starting));
      line_starting = s[end - 1] == '\n';
      pos = end;
      continue;
    }
    size_t body = i + 2 + (sign ? 1 : 0);
    if (kind == '#') {
      size_t j = body, end = 0;
      for (; j < n; j++) {
        if (j + 2 < n && (s[j] == '+' || s[j] == '-') && s[j + 1] == '#' && s[j + 2] == '}') {
          end = s[j] == '-' ? skip_ws(s, n, j + 3) : j + 3;
          break;
        }
        if (j + 1 < n && s[j] == '#' && s[j + 1] == '}') {
          end = j + 2;
          if (end < n && s[end] == '\n') end++;
          break;
        }
      }
      if (!end) jfail(&p->j, (uint32_t)i, PD_EINVAL, "missing end of comment tag");
      line_starting = s[end - 1] == '\n';
      pos = end;
      continue;
    }
    push_tok(p, kind == '{' ? TK_VBEGIN : TK_BBEGIN, i);
    pos = body;
    lex_tag(p, s, n, &pos, kind == '%', &line_starting);
  }
  push_tok(p, TK_EOF, n);
}

/* ---- parser (mirrors jinja2.parser.Parser) -------------------------------------------------- */
static int filter_lookup(const char *name);
static int test_lookup(const char *name);

static token *cur(P *p) { return &p->tk[p->i]; }
static token *peek(P *p, size_t k) { return p->i + k < p->ntk ? &p->tk[p->i + k] : &p->tk[p->ntk - 1]; }
static void adv(P *p) {
  if (p->i + 1 < p->ntk) p->i++;
}
static bool tname(const token *t, const char *s) {
  return t->type == TK_NAME && t->n == strlen(s) && memcmp(t->s, s, t->n) == 0;
}
static bool top(const token *t, int op) { return t->type == TK_OP && t->op == op; }

static const char *tok_desc(const token *t, char *buf, size_t bn) {
  switch (t->type) {
  case TK_EOF: return "end of template";
  case TK_DATA: return "template data";
  case TK_VBEGIN: return "'{{'";
  case TK_VEND: return "end of print statement";
  case TK_BBEGIN: return "'{%'";
  case TK_BEND: return "end of statement block";
  case TK_STRING: return "string literal";
  case TK_INT: return "integer";
  case TK_FLOAT: return "float";
  case TK_NAME: snprintf(buf, bn, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->s); return buf;
  case TK_OP:
    for (size_t i = 0; i < sizeof OPS / sizeof OPS[0]; i++)
      if (OPS[i].op == t->op) {
        snprintf(buf, bn, "'%s'", OPS[i].s);
        return buf;
      }
  }
  return "token";
}

static _Noreturn void perr_unexpected(P *p, const char *expected) {
  char b[64];
  token *t = cur(p);
  if (expected) jfail(&p->j, t->pos, PD_EINVAL, "expected %s, got %s", expected, tok_desc(t, b, sizeof b));
  jfail(&p->j, t->pos, PD_EINVAL, "unexpected %s", tok_desc(t, b, sizeof b));
}

static void expect_op(P *p, int op, const char *what) {
  if (!top(cur(p), op)) perr_unexpected(p, what);
  adv(p);
}
static void expect_type(P *p, int type, const char *what) {
  if (cur(p)->type != type) perr_unexpected(p, what);
  adv(p);
}
static const char *expect_name(P *p) {
  token *t = cur(p);
  if (t->type != TK_NAME) perr_unexpected(p, "a name");
  adv(p);
  return pstrdup(p, t->s, t->n);
}

static void enter(P *p) {
  if (++p->depth > CT_PARSE_DEPTH_MAX)
    jfail(&p->j, cur(p)->pos, PD_EINVAL, "template nested too deeply (limit %d)", CT_PARSE_DEPTH_MAX);
}
static void leave(P *p) { p->depth--; }

static expr *mk(P *p, int kind, uint32_t pos) {
  expr *x = pnew(p, sizeof *x);
  x->kind = (uint8_t)kind;
  x->pos = pos;
  x->fid = -1;
  return x;
}
static expr *mk2(P *p, int kind, uint32_t pos, expr *a, expr *b) {
  expr *x = mk(p, kind, pos);
  x->a = a;
  x->b = b;
  return x;
}

/* A list / tuple display whose items are all constants becomes one constant, built once in the
 * template's arena, so that loops over literal lists allocate nothing per iteration. */
static expr *fold_seq(P *p, expr *x) {
  for (size_t i = 0; i < x->nargs; i++)
    if (x->args[i]->kind != EX_CONST) return x;
  vlist *l = pnew(p, sizeof *l);
  l->n = x->nargs;
  l->v = x->nargs ? pnew(p, x->nargs * sizeof(value)) : NULL;
  for (size_t i = 0; i < x->nargs; i++) l->v[i] = x->args[i]->cv;
  expr *c = mk(p, EX_CONST, x->pos);
  c->cv = V_list(l, x->kind == EX_TUPLE);
  return c;
}

/* Growable pointer vector in the template arena (only used while parsing). */
typedef struct pvec {
  void **v;
  size_t n, cap;
} pvec;
static void pv_push(P *p, pvec *v, void *x) {
  if (v->n == v->cap) {
    size_t nc = v->cap ? v->cap * 2 : 4;
    void **nv = pnew(p, nc * sizeof *nv);
    if (v->n) memcpy(nv, v->v, v->n * sizeof *nv);
    v->v = nv;
    v->cap = nc;
  }
  v->v[v->n++] = x;
}

static expr *parse_expression(P *p, bool with_condexpr);
static expr *parse_tuple(P *p, bool simplified, bool with_condexpr, const char *const *extra_end, bool explicit_parens);
static expr *parse_unary(P *p, bool with_filter);
static expr *parse_primary(P *p);
static expr *parse_postfix(P *p, expr *x);
static expr *parse_filter_expr(P *p, expr *x);

static bool is_tuple_end(P *p, const char *const *extra_end) {
  token *t = cur(p);
  if (t->type == TK_VEND || t->type == TK_BEND || top(t, OP_RPAREN)) return true;
  for (; extra_end && *extra_end; extra_end++)
    if (tname(t, *extra_end)) return true;
  return false;
}

static expr *parse_tuple(P *p, bool simplified, bool with_condexpr, const char *const *extra_end, bool explicit_parens) {
  uint32_t pos = cur(p)->pos;
  pvec items = {0};
  bool is_tuple = false;
  for (;;) {
    if (items.n) expect_op(p, OP_COMMA, "','");
    if (is_tuple_end(p, extra_end)) break;
    expr *x = simplified ? parse_primary(p) : parse_expression(p, with_condexpr);
    pv_push(p, &items, x);
    if (top(cur(p), OP_COMMA)) is_tuple = true;
    else break;
  }
  if (!is_tuple) {
    if (items.n) return items.v[0];
    if (!explicit_parens) perr_unexpected(p, "an expression");
  }
  expr *x = mk(p, EX_TUPLE, pos);
  x->args = (expr **)items.v;
  x->nargs = items.n;
  return fold_seq(p, x);
}

static expr *parse_condexpr(P *p);
static expr *parse_or(P *p);

static expr *parse_expression(P *p, bool with_condexpr) {
  return with_condexpr ? parse_condexpr(p) : parse_or(p);
}

static expr *parse_condexpr(P *p) {
  uint32_t pos = cur(p)->pos;
  expr *x = parse_or(p);
  while (tname(cur(p), "if")) {
    adv(p);
    expr *c = parse_or(p);
    expr *e = NULL;
    if (tname(cur(p), "else")) {
      adv(p);
      enter(p);
      e = parse_condexpr(p);
      leave(p);
    }
    expr *n = mk(p, EX_COND, pos);
    n->a = c;
    n->b = x;
    n->c = e;
    x = n;
  }
  return x;
}

static expr *parse_and(P *p);
static expr *parse_not(P *p);
static expr *parse_compare(P *p);
static expr *parse_math1(P *p);
static expr *parse_concat(P *p);
static expr *parse_math2(P *p);
static expr *parse_pow(P *p);

static expr *parse_or(P *p) {
  expr *x = parse_and(p);
  while (tname(cur(p), "or")) {
    uint32_t pos = cur(p)->pos;
    adv(p);
    x = mk2(p, EX_OR, pos, x, parse_and(p));
  }
  return x;
}
static expr *parse_and(P *p) {
  expr *x = parse_not(p);
  while (tname(cur(p), "and")) {
    uint32_t pos = cur(p)->pos;
    adv(p);
    x = mk2(p, EX_AND, pos, x, parse_not(p));
  }
  return x;
}
static expr *parse_not(P *p) {
  if (tname(cur(p), "not")) {
    uint32_t pos = cur(p)->pos;
    adv(p);
    enter(p);
    expr *x = mk2(p, EX_NOT, pos, parse_not(p), NULL);
    leave(p);
    return x;
  }
  return parse_compare(p);
}
static expr *parse_compare(P *p) {
  uint32_t pos = cur(p)->pos;
  expr *x = parse_math1(p);
  pvec rhs = {0};
  uint8_t ops[64];
  size_t nops = 0;
  for (;;) {
    token *t = cur(p);
    int op = 0;
    if (t->type == TK_OP && (t->op == OP_EQ || t->op == OP_NE || t->op == OP_LT || t->op == OP_LE ||
                             t->op == OP_GT || t->op == OP_GE)) {
      op = t->op;
      adv(p);
    } else if (tname(t, "in")) {
      op = OP_IN;
      adv(p);
    } else if (tname(t, "not") && tname(peek(p, 1), "in")) {
      op = OP_NOTIN;
      adv(p);
      adv(p);
    } else {
      break;
    }
    if (nops == sizeof ops) jfail(&p->j, t->pos, PD_EINVAL, "comparison chain too long");
    ops[nops++] = (uint8_t)op;
    pv_push(p, &rhs, parse_math1(p));
  }
  if (!nops) return x;
  expr *c = mk(p, EX_CMP, pos);
  c->a = x;
  c->args = (expr **)rhs.v;
  c->nargs = rhs.n;
  c->ops = pnew(p, nops);
  memcpy(c->ops, ops, nops);
  return c;
}
static expr *parse_math1(P *p) {
  expr *x = parse_concat(p);
  while (top(cur(p), OP_ADD) || top(cur(p), OP_SUB)) {
    token *t = cur(p);
    adv(p);
    expr *n = mk2(p, EX_BIN, t->pos, x, parse_concat(p));
    n->op = t->op;
    x = n;
  }
  return x;
}
static expr *parse_concat(P *p) {
  uint32_t pos = cur(p)->pos;
  expr *x = parse_math2(p);
  if (!top(cur(p), OP_TILDE)) return x;
  pvec args = {0};
  pv_push(p, &args, x);
  while (top(cur(p), OP_TILDE)) {
    adv(p);
    pv_push(p, &args, parse_math2(p));
  }
  expr *c = mk(p, EX_CONCAT, pos);
  c->args = (expr **)args.v;
  c->nargs = args.n;
  return c;
}
static expr *parse_math2(P *p) {
  expr *x = parse_pow(p);
  while (top(cur(p), OP_MUL) || top(cur(p), OP_DIV) || top(cur(p), OP_FLOORDIV) || top(cur(p), OP_MOD)) {
    token *t = cur(p);
    adv(p);
    expr *n = mk2(p, EX_BIN, t->pos, x, parse_pow(p));
    n->op = t->op;
    x = n;
  }
  return x;
}
static expr *parse_pow(P *p) {
  expr *x = parse_unary(p, true);
  while (top(cur(p), OP_POW)) {
    token *t = cur(p);
    adv(p);
    expr *n = mk2(p, EX_BIN, t->pos, x, parse_unary(p, true));
    n->op = OP_POW;
    x = n;
  }
  return x;
}

static expr *parse_unary(P *p, bool with_filter) {
  token *t = cur(p);
  expr *x;
  enter(p);
  if (top(t, OP_SUB) || top(t, OP_ADD)) {
    adv(p);
    x = mk2(p, t->op == OP_SUB ? EX_NEG : EX_POS, t->pos, parse_unary(p, false), NULL);
  } else {
    x = parse_primary(p);
  }
  x = parse_postfix(p, x);
  if (with_filter) x = parse_filter_expr(p, x);
  leave(p);
  return x;
}

static expr *parse_primary(P *p) {
  token *t = cur(p);
  expr *x;
  switch (t->type) {
  case TK_NAME:
    if (tname(t, "true") || tname(t, "True") || tname(t, "false") || tname(t, "False")) {
      x = mk(p, EX_CONST, t->pos);
      x->cv = V_bool(t->s[0] == 't' || t->s[0] == 'T');
    } else if (tname(t, "none") || tname(t, "None")) {
      x = mk(p, EX_CONST, t->pos);
      x->cv = V_none();
    } else {
      x = mk(p, EX_NAME, t->pos);
      x->name = pstrdup(p, t->s, t->n);
    }
    adv(p);
    return x;
  case TK_STRING: {
    x = mk(p, EX_CONST, t->pos);
    size_t total = 0;
    size_t k;
    for (k = 0; peek(p, k)->type == TK_STRING; k++) total += peek(p, k)->n;
    if (k == 1) {
      x->cv = V_str(t->s, t->n);
      adv(p);
      return x;
    }
    char *buf = pnew(p, total + 1);
    size_t o = 0;
    while (cur(p)->type == TK_STRING) { /* adjacent literals concatenate */
      memcpy(buf + o, cur(p)->s, cur(p)->n);
      o += cur(p)->n;
      adv(p);
    }
    x->cv = V_str(buf, o);
    return x;
  }
  case TK_INT:
    x = mk(p, EX_CONST, t->pos);
    x->cv = V_int(t->i);
    adv(p);
    return x;
  case TK_FLOAT:
    x = mk(p, EX_CONST, t->pos);
    x->cv = V_float(t->f);
    adv(p);
    return x;
  case TK_OP:
    if (t->op == OP_LPAREN) {
      adv(p);
      x = parse_tuple(p, false, true, NULL, true);
      expect_op(p, OP_RPAREN, "')'");
      return x;
    }
    if (t->op == OP_LBRACKET) {
      adv(p);
      pvec items = {0};
      while (!top(cur(p), OP_RBRACKET)) {
        if (items.n) expect_op(p, OP_COMMA, "','");
        if (top(cur(p), OP_RBRACKET)) break;
        pv_push(p, &items, parse_expression(p, true));
      }
      expect_op(p, OP_RBRACKET, "']'");
      x = mk(p, EX_LIST, t->pos);
      x->args = (expr **)items.v;
      x->nargs = items.n;
      return fold_seq(p, x);
    }
    if (t->op == OP_LBRACE) {
      adv(p);
      pvec items = {0};
      while (!top(cur(p), OP_RBRACE)) {
        if (items.n) expect_op(p, OP_COMMA, "','");
        if (top(cur(p), OP_RBRACE)) break;
        pv_push(p, &items, parse_expression(p, true));
        expect_op(p, OP_COLON, "':'");
        pv_push(p, &items, parse_expression(p, true));
      }
      expect_op(p, OP_RBRACE, "'}'");
      x = mk(p, EX_DICT, t->pos);
      x->args = (expr **)items.v;
      x->nargs = items.n;
      return x;
    }
    break;
  default:
    break;
  }
  perr_unexpected(p, NULL);
}

/* Call arguments: positional, then name=value; *args / **kwargs are not supported. */
static void parse_call_args(P *p, expr *x) {
  expect_op(p, OP_LPAREN, "'('");
  pvec args = {0}, kwn = {0}, kwv = {0};
  while (!top(cur(p), OP_RPAREN)) {
    if (args.n || kwn.n) {
      expect_op(p, OP_COMMA, "','");
      if (top(cur(p), OP_RPAREN)) break;
    }
    if (top(cur(p), OP_MUL) || top(cur(p), OP_POW))
      jfail(&p->j, cur(p)->pos, PD_EUNSUPPORTED, "*args / **kwargs in calls are not supported");
    if (cur(p)->type == TK_NAME && top(peek(p, 1), OP_ASSIGN)) {
      const char *k = pstrdup(p, cur(p)->s, cur(p)->n);
      adv(p);
      adv(p);
      pv_push(p, &kwn, (void *)k);
      pv_push(p, &kwv, parse_expression(p, true));
    } else {
      if (kwn.n) jfail(&p->j, cur(p)->pos, PD_EINVAL, "positional argument follows keyword argument");
      pv_push(p, &args, parse_expression(p, true));
    }
  }
  expect_op(p, OP_RPAREN, "')'");
  x->args = (expr **)args.v;
  x->nargs = args.n;
  x->kwn = (const char **)kwn.v;
  x->kwv = (expr **)kwv.v;
  x->nkw = kwn.n;
}

static expr *parse_subscript(P *p, expr *x) {
  token *t = cur(p);
  if (top(t, OP_DOT)) {
    adv(p);
    token *a = cur(p);
    if (a->type == TK_NAME) {
      expr *n = mk2(p, EX_ATTR, a->pos, x, NULL);
      n->name = pstrdup(p, a->s, a->n);
      adv(p);
      return n;
    }
    if (a->type == TK_INT) {
      expr *k = mk(p, EX_CONST, a->pos);
      k->cv = V_int(a->i);
      adv(p);
      return mk2(p, EX_ITEM, a->pos, x, k);
    }
    perr_unexpected(p, "an attribute name");
  }
  /* '[' subscript ']' : an expression or a slice a:b:c */
  adv(p);
  expr *parts[3] = {NULL, NULL, NULL};
  bool slice = false;
  if (top(cur(p), OP_COLON)) {
    slice = true;
  } else {
    parts[0] = parse_expression(p, true);
    if (top(cur(p), OP_COLON)) slice = true;
  }
  if (!slice) {
    if (top(cur(p), OP_COMMA)) jfail(&p->j, cur(p)->pos, PD_EUNSUPPORTED, "tuple subscripts are not supported");
    expect_op(p, OP_RBRACKET, "']'");
    return mk2(p, EX_ITEM, t->pos, x, parts[0]);
  }
  adv(p); /* first ':' */
  if (!top(cur(p), OP_COLON) && !top(cur(p), OP_RBRACKET)) parts[1] = parse_expression(p, true);
  if (top(cur(p), OP_COLON)) {
    adv(p);
    if (!top(cur(p), OP_RBRACKET)) parts[2] = parse_expression(p, true);
  }
  expect_op(p, OP_RBRACKET, "']'");
  expr *n = mk2(p, EX_SLICE, t->pos, x, NULL);
  n->args = pnew(p, 3 * sizeof(expr *));
  memcpy(n->args, parts, sizeof parts);
  n->nargs = 3;
  return n;
}

static expr *parse_postfix(P *p, expr *x) {
  for (;;) {
    token *t = cur(p);
    if (top(t, OP_DOT) || top(t, OP_LBRACKET)) {
      x = parse_subscript(p, x);
    } else if (top(t, OP_LPAREN)) {
      expr *c = mk2(p, EX_CALL, x->pos, x, NULL); /* errors point at the callee */
      parse_call_args(p, c);
      x = c;
    } else {
      return x;
    }
  }
}

/* name(.name)* as one string ("a.b" for dotted filter / test names). */
static const char *parse_dotted_name(P *p) {
  token *t = cur(p);
  if (t->type != TK_NAME) perr_unexpected(p, "a name");
  const char *start = t->s;
  const char *end = t->s + t->n;
  adv(p);
  while (top(cur(p), OP_DOT) && peek(p, 1)->type == TK_NAME) {
    adv(p);
    end = cur(p)->s + cur(p)->n;
    adv(p);
  }
  return pstrdup(p, start, (size_t)(end - start));
}

static expr *parse_filter(P *p, expr *x) {
  token *t = cur(p); /* '|' */
  adv(p);
  expr *f = mk2(p, EX_FILTER, t->pos, x, NULL);
  f->name = parse_dotted_name(p);
  f->fid = filter_lookup(f->name);
  if (top(cur(p), OP_LPAREN)) parse_call_args(p, f);
  return f;
}

static expr *parse_test(P *p, expr *x) {
  token *t = cur(p); /* 'is' */
  adv(p);
  expr *n = mk2(p, EX_TEST, t->pos, x, NULL);
  if (tname(cur(p), "not")) {
    adv(p);
    n->neg = true;
  }
  n->name = parse_dotted_name(p);
  n->fid = test_lookup(n->name);
  token *c = cur(p);
  if (top(c, OP_LPAREN)) {
    parse_call_args(p, n);
  } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT || c->type == TK_FLOAT ||
              top(c, OP_LPAREN) || top(c, OP_LBRACKET) || top(c, OP_LBRACE)) &&
             !tname(c, "else") && !tname(c, "or") && !tname(c, "and")) {
    if (tname(c, "is")) jfail(&p->j, c->pos, PD_EINVAL, "you cannot chain multiple tests with is");
    expr *arg = parse_postfix(p, parse_primary(p));
    n->args = pnew(p, sizeof(expr *));
    n->args[0] = arg;
    n->nargs = 1;
  }
  return n;
}

static expr *parse_filter_expr(P *p, expr *x) {
  for (;;) {
    token *t = cur(p);
    if (top(t, OP_PIPE)) x = parse_filter(p, x);
    else if (tname(t, "is")) x = parse_test(p, x);
    else if (top(t, OP_LPAREN)) {
      expr *c = mk2(p, EX_CALL, x ? x->pos : t->pos, x, NULL);
      parse_call_args(p, c);
      x = c;
    } else return x;
  }
}

/* ---- statements ---- */
static slist parse_body(P *p, const char *const *ends);

static void expect_end(P *p) { expect_type(p, TK_BEND, "end of statement block"); }

/* Consumes "{% endX %}" after parse_body stopped at the name "endX". */
static void eat_end_tag(P *p) {
  adv(p);
  expect_end(p);
}

static void check_assignable(P *p, expr *x) {
  if (x->kind == EX_NAME) {
    if (!strcmp(x->name, "loop") || !strcmp(x->name, "true") || !strcmp(x->name, "false") || !strcmp(x->name, "none"))
      jfail(&p->j, x->pos, PD_EINVAL, "can't assign to special name '%s'", x->name);
    return;
  }
  if (x->kind == EX_TUPLE) {
    for (size_t i = 0; i < x->nargs; i++) {
      if (x->args[i]->kind != EX_NAME) jfail(&p->j, x->args[i]->pos, PD_EINVAL, "can't assign to this expression");
      check_assignable(p, x->args[i]);
    }
    return;
  }
  jfail(&p->j, x->pos, PD_EINVAL, "can't assign to this expression");
}

static stmt *mkst(P *p, int kind, uint32_t pos) {
  stmt *s = pnew(p, sizeof *s);
  s->kind = (uint8_t)kind;
  s->pos = pos;
  return s;
}

static stmt *parse_for(P *p, uint32_t pos) {
  static const char *const in_end[] = {"in", NULL};
  static const char *const rec_end[] = {"recursive", NULL};
  static const char *const body_end[] = {"endfor", "else", NULL};
  static const char *const else_end[] = {"endfor", NULL};
  stmt *s = mkst(p, ST_FOR, pos);
  s->target = parse_tuple(p, true, false, in_end, false);
  check_assignable(p, s->target);
  if (!tname(cur(p), "in")) perr_unexpected(p, "'in'");
  adv(p);
  s->e = parse_tuple(p, false, false, rec_end, false);
  if (tname(cur(p), "if")) {
    adv(p);
    s->cond = parse_expression(p, true);
  }
  if (tname(cur(p), "recursive")) jfail(&p->j, cur(p)->pos, PD_EUNSUPPORTED, "recursive for loops are not supported");
  expect_end(p);
  p->loops++;
  s->body = parse_body(p, body_end);
  p->loops--;
  if (tname(cur(p), "else")) {
    adv(p);
    expect_end(p);
    s->orelse = parse_body(p, else_end);
  }
  eat_end_tag(p);
  return s;
}

static stmt *parse_if(P *p, uint32_t pos) {
  static const char *const body_end[] = {"elif", "else", "endif", NULL};
  static const char *const else_end[] = {"endif", NULL};
  stmt *s = mkst(p, ST_IF, pos);
  s->e = parse_tuple(p, false, false, NULL, false);
  expect_end(p);
  s->body = parse_body(p, body_end);
  stmt *last = s;
  int nested = 0;
  for (;;) {
    token *t = cur(p);
    if (tname(t, "elif")) {
      adv(p);
      stmt *e = mkst(p, ST_IF, t->pos);
      e->e = parse_tuple(p, false, false, NULL, false);
      expect_end(p);
      enter(p);
      nested++;
      e->body = parse_body(p, body_end);
      last->orelse.v = pnew(p, sizeof(stmt *));
      last->orelse.v[0] = e;
      last->orelse.n = 1;
      last = e;
    } else if (tname(t, "else")) {
      adv(p);
      expect_end(p);
      last->orelse = parse_body(p, else_end);
      eat_end_tag(p);
      break;
    } else {
      eat_end_tag(p);
      break;
    }
  }
  p->depth -= nested;
  return s;
}

static stmt *parse_set(P *p, uint32_t pos) {
  static const char *const set_end[] = {"endset", NULL};
  token *t = cur(p);
  expr *target;
  if (t->type == TK_NAME && top(peek(p, 1), OP_DOT) && peek(p, 2)->type == TK_NAME) {
    expr *ns = mk(p, EX_NAME, t->pos);
    ns->name = pstrdup(p, t->s, t->n);
    adv(p);
    adv(p);
    target = mk2(p, EX_ATTR, cur(p)->pos, ns, NULL);
    target->name = expect_name(p);
  } else {
    target = parse_tuple(p, true, false, NULL, false);
    check_assignable(p, target);
  }
  if (top(cur(p), OP_ASSIGN)) {
    adv(p);
    stmt *s = mkst(p, ST_SET, pos);
    s->target = target;
    s->e = parse_tuple(p, false, true, NULL, false);
    expect_end(p);
    return s;
  }
  stmt *s = mkst(p, ST_SETBLOCK, pos);
  s->target = target;
  while (top(cur(p), OP_PIPE)) s->filter = parse_filter(p, s->filter); /* filters only, as jinja2 */
  expect_end(p);
  s->body = parse_body(p, set_end);
  eat_end_tag(p);
  return s;
}

static stmt *parse_macro(P *p, uint32_t pos) {
  static const char *const mac_end[] = {"endmacro", NULL};
  stmt *s = mkst(p, ST_MACRO, pos);
  s->name = expect_name(p);
  expect_op(p, OP_LPAREN, "'('");
  pvec names = {0}, defs = {0};
  bool seen_default = false;
  while (!top(cur(p), OP_RPAREN)) {
    if (names.n) expect_op(p, OP_COMMA, "','");
    if (top(cur(p), OP_RPAREN)) break;
    uint32_t apos = cur(p)->pos;
    const char *n = expect_name(p);
    expr *d = NULL;
    if (top(cur(p), OP_ASSIGN)) {
      adv(p);
      d = parse_expression(p, true);
      seen_default = true;
    } else if (seen_default) {
      jfail(&p->j, apos, PD_EINVAL, "non-default argument follows default argument");
    }
    pv_push(p, &names, (void *)n);
    pv_push(p, &defs, d);
  }
  expect_op(p, OP_RPAREN, "')'");
  expect_end(p);
  s->params = (const char **)names.v;
  s->defaults = (expr **)defs.v;
  s->nparams = names.n;
  int saved = p->loops;
  p->loops = 0;
  s->body = parse_body(p, mac_end);
  p->loops = saved;
  eat_end_tag(p);
  return s;
}

static stmt *parse_statement(P *p) {
  static const char *const gen_end[] = {"endgeneration", NULL};
  static const char *const unsupported[] = {"include", "extends", "import", "from", "block", "call", "filter", "with",
                                            "autoescape", "do", "trans", "pluralize", "debug", NULL};
  token *t = cur(p);
  if (t->type != TK_NAME) perr_unexpected(p, "a tag name");
  uint32_t pos = t->pos;
  if (tname(t, "for")) {
    adv(p);
    return parse_for(p, pos);
  }
  if (tname(t, "if")) {
    adv(p);
    return parse_if(p, pos);
  }
  if (tname(t, "set")) {
    adv(p);
    return parse_set(p, pos);
  }
  if (tname(t, "macro")) {
    adv(p);
    return parse_macro(p, pos);
  }
  if (tname(t, "break") || tname(t, "continue")) {
    bool brk = tname(t, "break");
    if (!p->loops) jfail(&p->j, pos, PD_EINVAL, "'%s' outside of a loop", brk ? "break" : "continue");
    adv(p);
    expect_end(p);
    return mkst(p, brk ? ST_BREAK : ST_CONTINUE, pos);
  }
  if (tname(t, "generation")) { /* transformers' AssistantTracker: renders its body */
    adv(p);
    expect_end(p);
    stmt *s = mkst(p, ST_BLOCK, pos);
    s->body = parse_body(p, gen_end);
    eat_end_tag(p);
    return s;
  }
  for (size_t i = 0; unsupported[i]; i++)
    if (tname(t, unsupported[i]))
      jfail(&p->j, pos, PD_EUNSUPPORTED, "'%s' tags are not supported", unsupported[i]);
  char b[64];
  jfail(&p->j, pos, PD_EINVAL, "unknown or misplaced tag %s", tok_desc(t, b, sizeof b));
}

/* Statements until "{% <one of ends> %}" (the stream is left at that name) or the end of the
 * template (only valid when ends is NULL). */
static slist parse_body(P *p, const char *const *ends) {
  pvec v = {0};
  enter(p);
  for (;;) {
    token *t = cur(p);
    if (t->type == TK_DATA) {
      stmt *s = mkst(p, ST_DATA, t->pos);
      s->text = t->s;
      s->len = t->n;
      pv_push(p, &v, s);
      adv(p);
    } else if (t->type == TK_VBEGIN) {
      adv(p);
      stmt *s = mkst(p, ST_OUT, t->pos);
      s->e = parse_tuple(p, false, true, NULL, false);
      expect_type(p, TK_VEND, "end of print statement");
      pv_push(p, &v, s);
    } else if (t->type == TK_BBEGIN) {
      adv(p);
      if (ends)
        for (const char *const *e = ends; *e; e++)
          if (tname(cur(p), *e)) {
            leave(p);
            return (slist){(stmt **)v.v, v.n};
          }
      pv_push(p, &v, parse_statement(p));
    } else if (t->type == TK_EOF) {
      if (ends) {
        char want[160] = "";
        for (const char *const *e = ends; *e; e++)
          snprintf(want + strlen(want), sizeof want - strlen(want), "%s'%s'", e == ends ? "" : " or ", *e);
        jfail(&p->j, t->pos, PD_EINVAL, "unexpected end of template, expected %s", want);
      }
      leave(p);
      return (slist){(stmt **)v.v, v.n};
    } else {
      perr_unexpected(p, NULL);
    }
  }
}

/* ---- render context ---------------------------------------------------------------------------- */
typedef struct sink {
  char *p;
  size_t n, cap;
  bool heap; /* the top-level output (malloc'ed, handed to the caller); captures live in the arena */
} sink;

/* Variables of one frame: the template top level, one for-loop iteration, one macro call.
 * Scopes live on the C stack (never referenced after their block ends) and keep their first
 * few variables inline, so loops allocate nothing per iteration. */
#define SCOPE_INLINE 8
typedef struct scope {
  struct scope *parent;
  size_t n, cap;
  const char **k;
  value *v;
  const char *ik[SCOPE_INLINE];
  value iv[SCOPE_INLINE];
} scope;

static void scope_init(scope *s, scope *parent) {
  s->parent = parent;
  s->n = 0;
  s->cap = SCOPE_INLINE;
  s->k = s->ik;
  s->v = s->iv;
}

typedef struct R {
  jerr j;
  const pd_chat_template *t;
  arena a;
  sink out;
  size_t out_limit;
  uint64_t steps;
  int depth;
  scope globals;
  scope *root;
} R;

static _Noreturn void __attribute__((format(printf, 4, 5)))
rfail(R *r, uint32_t pos, pd_status code, const char *fmt, ...) {
  char m[PD_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m, sizeof m, fmt, ap);
  va_end(ap);
  jfail(&r->j, pos, code, "%s", m);
}

static void *ralloc(R *r, size_t n) {
  void *m = arena_alloc(&r->a, n);
  if (!m) {
    if (r->a.over)
      rfail(r, CT_NOPOS, PD_EINVAL, "rendering needs more than %zu MiB of memory", r->a.limit >> 20);
    rfail(r, CT_NOPOS, PD_ENOMEM, "out of memory");
  }
  return m;
}
static size_t mul_sz(R *r, size_t a, size_t b) {
  if (b && a > SIZE_MAX / b) rfail(r, CT_NOPOS, PD_EINVAL, "size overflow");
  return a * b;
}

static void charge(R *r, uint32_t pos, uint64_t n) {
  r->steps += n;
  if (r->steps > CT_STEPS_MAX)
    rfail(r, pos, PD_EINVAL, "template exceeded its step budget (%llu statements, loop iterations and items)",
          (unsigned long long)CT_STEPS_MAX);
}

static void deeper(R *r, uint32_t pos) {
  if (++r->depth > CT_RENDER_DEPTH_MAX)
    rfail(r, pos, PD_EINVAL, "template recursion too deep (limit %d)", CT_RENDER_DEPTH_MAX);
}

static void sink_reserve(R *r, sink *s, size_t extra) {
  if (s->cap - s->n >= extra) return;
  if (s->n + extra > r->out_limit || extra > r->out_limit) {
    if (s->heap) rfail(r, CT_NOPOS, PD_EINVAL, "rendered output exceeds %zu bytes", r->out_limit);
    rfail(r, CT_NOPOS, PD_EINVAL, "a string built by the template exceeds %zu bytes", r->out_limit);
  }
  size_t want = s->cap ? s->cap : 256;
  while (want - s->n < extra) want *= 2;
  if (want > r->out_limit + 1) want = r->out_limit + 1;
  if (s->heap) {
    char *np = realloc(s->p, want);
    if (!np) rfail(r, CT_NOPOS, PD_ENOMEM, "out of memory");
    s->p = np;
  } else if (!arena_extend(&r->a, s->p, want)) {
    char *np = ralloc(r, want);
    if (s->n) memcpy(np, s->p, s->n);
    s->p = np;
  }
  s->cap = want;
}
static void put(R *r, sink *s, const char *d, size_t n) {
  if (!n) return;
  sink_reserve(r, s, n);
  memcpy(s->p + s->n, d, n);
  s->n += n;
}
static void putc_(R *r, sink *s, char c) { put(r, s, &c, 1); }
static void puts_(R *r, sink *s, const char *z) { put(r, s, z, strlen(z)); }
static void putcp(R *r, sink *s, uint32_t cp) {
  char b[4];
  put(r, s, b, u8enc(cp, b));
}
static value sink_value(sink *s) { return V_str(s->p ? s->p : "", s->n); }

static strv rdup(R *r, const char *p, size_t n) {
  char *m = ralloc(r, n + 1);
  if (n) memcpy(m, p, n);
  m[n] = 0;
  return (strv){m, n};
}

/* ---- lists and dicts ---- */
static vlist *list_new(R *r, size_t n) {
  vlist *l = ralloc(r, sizeof *l);
  l->n = n;
  l->v = n ? ralloc(r, mul_sz(r, n, sizeof(value))) : NULL;
  return l;
}

typedef struct lbuild {
  value *v;
  size_t n, cap;
} lbuild;
static void lb_push(R *r, lbuild *b, value x) {
  if (b->n == b->cap) {
    size_t nc = b->cap ? b->cap * 2 : 8;
    value *nv = ralloc(r, mul_sz(r, nc, sizeof *nv));
    if (b->n) memcpy(nv, b->v, b->n * sizeof *nv);
    b->v = nv;
    b->cap = nc;
  }
  b->v[b->n++] = x;
}
static value lb_value(R *r, lbuild *b, bool tuple) {
  vlist *l = ralloc(r, sizeof *l);
  l->n = b->n;
  l->v = b->v;
  return V_list(l, tuple);
}

static bool v_eq(const value *a, const value *b);

static vdict *dict_new(R *r) {
  vdict *d = ralloc(r, sizeof *d);
  memset(d, 0, sizeof *d);
  return d;
}
static value *dict_get(const vdict *d, const value *k) {
  for (size_t i = 0; i < d->n; i++)
    if (v_eq(&d->k[i], k)) return &d->v[i];
  return NULL;
}
static value *dict_gets(const vdict *d, const char *k) {
  size_t kn = strlen(k);
  for (size_t i = 0; i < d->n; i++)
    if (d->k[i].t == VT_STR && d->k[i].u.s.n == kn && memcmp(d->k[i].u.s.p, k, kn) == 0) return &d->v[i];
  return NULL;
}
static void dict_set(R *r, vdict *d, value k, value v) {
  value *e = dict_get(d, &k);
  if (e) {
    *e = v;
    return;
  }
  if (d->n == d->cap) {
    size_t nc = d->cap ? d->cap * 2 : 4;
    value *nk = ralloc(r, mul_sz(r, nc, sizeof(value)));
    value *nv = ralloc(r, mul_sz(r, nc, sizeof(value)));
    if (d->n) {
      memcpy(nk, d->k, d->n * sizeof(value));
      memcpy(nv, d->v, d->n * sizeof(value));
    }
    d->k = nk;
    d->v = nv;
    d->cap = nc;
  }
  d->k[d->n] = k;
  d->v[d->n] = v;
  d->n++;
}
static void check_hashable(R *r, uint32_t pos, const value *k) {
  if (k->t == VT_LIST && !k->tuple) rfail(r, pos, PD_EINVAL, "unhashable type: 'list'");
  if (k->t == VT_DICT || k->t == VT_NS) rfail(r, pos, PD_EINVAL, "unhashable type: '%s'", type_name(k));
}

/* ---- scopes ---- */
static value *scope_find(scope *s, const char *name) {
  for (; s; s = s->parent)
    for (size_t i = s->n; i-- > 0;)
      if (!strcmp(s->k[i], name)) return &s->v[i];
  return NULL;
}
static void scope_set(R *r, scope *s, const char *name, value v) {
  for (size_t i = 0; i < s->n; i++)
    if (!strcmp(s->k[i], name)) {
      s->v[i] = v;
      return;
    }
  if (s->n == s->cap) {
    size_t nc = s->cap * 2;
    const char **nk = ralloc(r, nc * sizeof *nk);
    value *nv = ralloc(r, nc * sizeof *nv);
    if (s->n) {
      memcpy(nk, s->k, s->n * sizeof *nk);
      memcpy(nv, s->v, s->n * sizeof *nv);
    }
    s->k = nk;
    s->v = nv;
    s->cap = nc;
  }
  s->k[s->n] = name;
  s->v[s->n] = v;
  s->n++;
}

/* ---- conversions: Python str(), repr(), json.dumps() ---- */
static void put_repr(R *r, sink *s, const value *v, uint32_t pos);

static void put_int(R *r, sink *s, int64_t i) {
  char b[32];
  put(r, s, b, (size_t)sprintf(b, "%" PRId64, i));
}
static void put_float(R *r, sink *s, double f, bool json) {
  char b[40];
  put(r, s, b, fmt_pyfloat(f, b, json));
}

/* str(v) as Python / jinja2 print it (Undefined prints as ""). */
static void put_str(R *r, sink *s, const value *v, uint32_t pos) {
  switch (v->t) {
  case VT_UNDEF: return;
  case VT_NONE: puts_(r, s, "None"); return;
  case VT_BOOL: puts_(r, s, v->u.b ? "True" : "False"); return;
  case VT_INT: put_int(r, s, v->u.i); return;
  case VT_FLOAT: put_float(r, s, v->u.f, false); return;
  case VT_STR: put(r, s, v->u.s.p, v->u.s.n); return;
  default: put_repr(r, s, v, pos); return;
  }
}

static void put_repr_str(R *r, sink *s, const char *p, size_t n) {
  bool sq = memchr(p, '\'', n) != NULL, dq = memchr(p, '"', n) != NULL;
  char q = (sq && !dq) ? '"' : '\'';
  putc_(r, s, q);
  for (size_t i = 0; i < n;) {
    uint32_t c;
    size_t k = u8dec(p + i, n - i, &c);
    char b[16];
    if (c == (uint32_t)q || c == '\\') {
      b[0] = '\\';
      b[1] = (char)c;
      put(r, s, b, 2);
    } else if (c == '\t') puts_(r, s, "\\t");
    else if (c == '\n') puts_(r, s, "\\n");
    else if (c == '\r') puts_(r, s, "\\r");
    else if (c < 0x20 || c == 0x7F) put(r, s, b, (size_t)sprintf(b, "\\x%02x", c));
    else if (c < 0x7F || (k > 1 && py_isprintable(c)) || (k == 1 && c == 0xFFFD)) put(r, s, p + i, k);
    else if (c <= 0xFF) put(r, s, b, (size_t)sprintf(b, "\\x%02x", c));
    else if (c <= 0xFFFF) put(r, s, b, (size_t)sprintf(b, "\\u%04x", c));
    else put(r, s, b, (size_t)sprintf(b, "\\U%08x", c));
    i += k;
  }
  putc_(r, s, q);
}

static void put_repr(R *r, sink *s, const value *v, uint32_t pos) {
  deeper(r, pos);
  switch (v->t) {
  case VT_UNDEF: puts_(r, s, "Undefined"); break;
  case VT_STR: put_repr_str(r, s, v->u.s.p, v->u.s.n); break;
  case VT_LIST: {
    putc_(r, s, v->tuple ? '(' : '[');
    for (size_t i = 0; i < v->u.l->n; i++) {
      if (i) puts_(r, s, ", ");
      put_repr(r, s, &v->u.l->v[i], pos);
    }
    if (v->tuple && v->u.l->n == 1) putc_(r, s, ',');
    putc_(r, s, v->tuple ? ')' : ']');
    break;
  }
  case VT_DICT:
  case VT_NS: {
    if (v->t == VT_NS) puts_(r, s, "<Namespace ");
    putc_(r, s, '{');
    for (size_t i = 0; i < v->u.d->n; i++) {
      if (i) puts_(r, s, ", ");
      put_repr(r, s, &v->u.d->k[i], pos);
      puts_(r, s, ": ");
      put_repr(r, s, &v->u.d->v[i], pos);
    }
    putc_(r, s, '}');
    if (v->t == VT_NS) putc_(r, s, '>');
    break;
  }
  case VT_FUNC:
    puts_(r, s, "<function ");
    puts_(r, s, v->u.fn->name);
    putc_(r, s, '>');
    break;
  case VT_LOOP: {
    char b[64];
    put(r, s, b, (size_t)snprintf(b, sizeof b, "<LoopContext %zu/%zu>", v->u.lp->i + 1, v->u.lp->n));
    break;
  }
  default: put_str(r, s, v, pos); break;
  }
  r->depth--;
}

/* str(v) as a string value; strings are returned as they are, without copying. */
static strv to_str(R *r, const value *v, uint32_t pos) {
  if (v->t == VT_STR) return (strv){v->u.s.p, v->u.s.n};
  if (v->t == VT_UNDEF) return (strv){"", 0};
  sink s = {0};
  put_str(r, &s, v, pos);
  return (strv){s.p ? s.p : "", s.n};
}

typedef struct jsonopt {
  bool ensure_ascii, sort_keys;
  bool indent_on;
  strv indent;             /* per level */
  strv item_sep, key_sep;  /* ", " / ": " (",", ": " when indented) */
} jsonopt;

static void put_json_str(R *r, sink *s, const char *p, size_t n, bool ascii) {
  putc_(r, s, '"');
  size_t run = 0;
  for (size_t i = 0; i < n;) {
    unsigned char c = (unsigned char)p[i];
    const char *esc = NULL;
    char b[16];
    if (c == '"') esc = "\\\"";
    else if (c == '\\') esc = "\\\\";
    else if (c == '\n') esc = "\\n";
    else if (c == '\r') esc = "\\r";
    else if (c == '\t') esc = "\\t";
    else if (c == '\b') esc = "\\b";
    else if (c == '\f') esc = "\\f";
    else if (c < 0x20 || (ascii && c == 0x7F)) {
      sprintf(b, "\\u%04x", c);
      esc = b;
    } else if (ascii && c >= 0x80) {
      uint32_t cp;
      size_t k = u8dec(p + i, n - i, &cp);
      put(r, s, p + i - run, run);
      run = 0;
      if (cp >= 0x10000) {
        cp -= 0x10000;
        sprintf(b, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
      } else {
        sprintf(b, "\\u%04x", cp);
      }
      puts_(r, s, b);
      i += k;
      continue;
    }
    if (esc) {
      put(r, s, p + i - run, run);
      run = 0;
      puts_(r, s, esc);
    } else {
      run++;
    }
    i++;
  }
  put(r, s, p + n - run, run);
  putc_(r, s, '"');
}

static int v_cmp(R *r, uint32_t pos, const value *a, const value *b);

static void json_newline(R *r, sink *s, const jsonopt *o, int level) {
  putc_(r, s, '\n');
  for (int i = 0; i < level; i++) put(r, s, o->indent.p, o->indent.n);
}

static void put_json(R *r, sink *s, const value *v, const jsonopt *o, int level, uint32_t pos) {
  deeper(r, pos);
  switch (v->t) {
  case VT_NONE: puts_(r, s, "null"); break;
  case VT_BOOL: puts_(r, s, v->u.b ? "true" : "false"); break;
  case VT_INT: put_int(r, s, v->u.i); break;
  case VT_FLOAT: put_float(r, s, v->u.f, true); break;
  case VT_STR: put_json_str(r, s, v->u.s.p, v->u.s.n, o->ensure_ascii); break;
  case VT_LIST: {
    if (!v->u.l->n) {
      puts_(r, s, "[]");
      break;
    }
    putc_(r, s, '[');
    for (size_t i = 0; i < v->u.l->n; i++) {
      if (i) put(r, s, o->item_sep.p, o->item_sep.n);
      if (o->indent_on) json_newline(r, s, o, level + 1);
      put_json(r, s, &v->u.l->v[i], o, level + 1, pos);
    }
    if (o->indent_on) json_newline(r, s, o, level);
    putc_(r, s, ']');
    break;
  }
  case VT_DICT: {
    const vdict *d = v->u.d;
    if (!d->n) {
      puts_(r, s, "{}");
      break;
    }
    size_t *ord = ralloc(r, mul_sz(r, d->n, sizeof *ord));
    for (size_t i = 0; i < d->n; i++) ord[i] = i;
    if (o->sort_keys) /* insertion sort: stable, dicts are small */
      for (size_t i = 1; i < d->n; i++)
        for (size_t j = i; j > 0 && v_cmp(r, pos, &d->k[ord[j - 1]], &d->k[ord[j]]) > 0; j--) {
          size_t t = ord[j];
          ord[j] = ord[j - 1];
          ord[j - 1] = t;
        }
    putc_(r, s, '{');
    for (size_t q = 0; q < d->n; q++) {
      size_t i = ord[q];
      if (q) put(r, s, o->item_sep.p, o->item_sep.n);
      if (o->indent_on) json_newline(r, s, o, level + 1);
      const value *k = &d->k[i];
      switch (k->t) {
      case VT_STR: put_json_str(r, s, k->u.s.p, k->u.s.n, o->ensure_ascii); break;
      case VT_NONE: puts_(r, s, "\"null\""); break;
      case VT_BOOL: puts_(r, s, k->u.b ? "\"true\"" : "\"false\""); break;
      case VT_INT:
        putc_(r, s, '"');
        put_int(r, s, k->u.i);
        putc_(r, s, '"');
        break;
      case VT_FLOAT:
        putc_(r, s, '"');
        put_float(r, s, k->u.f, true);
        putc_(r, s, '"');
        break;
      default: rfail(r, pos, PD_EINVAL, "keys must be str, int, float, bool or None, not %s", type_name(k));
      }
      put(r, s, o->key_sep.p, o->key_sep.n);
      put_json(r, s, &d->v[i], o, level + 1, pos);
    }
    if (o->indent_on) json_newline(r, s, o, level);
    putc_(r, s, '}');
    break;
  }
  default:
    rfail(r, pos, PD_EINVAL, "Object of type %s is not JSON serializable", type_name(v));
  }
  r->depth--;
}

/* ---- truth, equality, ordering (Python semantics) ---- */
static bool truthy(const value *v) {
  switch (v->t) {
  case VT_UNDEF:
  case VT_NONE: return false;
  case VT_BOOL: return v->u.b;
  case VT_INT: return v->u.i != 0;
  case VT_FLOAT: return v->u.f != 0;
  case VT_STR: return v->u.s.n != 0;
  case VT_LIST: return v->u.l->n != 0;
  case VT_DICT: return v->u.d->n != 0;
  default: return true;
  }
}

static bool v_eq(const value *a, const value *b) {
  if (is_num(a) && is_num(b)) {
    if (a->t == VT_FLOAT || b->t == VT_FLOAT) return num_f(a) == num_f(b);
    return num_i(a) == num_i(b);
  }
  if (a->t != b->t) return false;
  switch (a->t) {
  case VT_UNDEF:
  case VT_NONE: return true;
  case VT_STR: return a->u.s.n == b->u.s.n && memcmp(a->u.s.p, b->u.s.p, a->u.s.n) == 0;
  case VT_LIST:
    if (a->tuple != b->tuple || a->u.l->n != b->u.l->n) return false;
    for (size_t i = 0; i < a->u.l->n; i++)
      if (!v_eq(&a->u.l->v[i], &b->u.l->v[i])) return false;
    return true;
  case VT_DICT:
    if (a->u.d->n != b->u.d->n) return false;
    for (size_t i = 0; i < a->u.d->n; i++) {
      value *o = dict_get(b->u.d, &a->u.d->k[i]);
      if (!o || !v_eq(&a->u.d->v[i], o)) return false;
    }
    return true;
  case VT_NS: return a->u.d == b->u.d;
  case VT_FUNC: return a->u.fn == b->u.fn;
  case VT_LOOP: return a->u.lp == b->u.lp;
  default: return false;
  }
}

/* <, <=, >, >= ordering; TypeError for types Python cannot order. */
static int v_cmp(R *r, uint32_t pos, const value *a, const value *b) {
  if (is_num(a) && is_num(b)) {
    if (a->t == VT_FLOAT || b->t == VT_FLOAT) {
      double x = num_f(a), y = num_f(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    int64_t x = num_i(a), y = num_i(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a->t == VT_STR && b->t == VT_STR) {
    size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
    int c = n ? memcmp(a->u.s.p, b->u.s.p, n) : 0;
    if (c) return c < 0 ? -1 : 1;
    return a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n ? 1 : 0;
  }
  if (a->t == VT_LIST && b->t == VT_LIST && a->tuple == b->tuple) {
    size_t n = a->u.l->n < b->u.l->n ? a->u.l->n : b->u.l->n;
    for (size_t i = 0; i < n; i++)
      if (!v_eq(&a->u.l->v[i], &b->u.l->v[i])) return v_cmp(r, pos, &a->u.l->v[i], &b->u.l->v[i]);
    return a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n ? 1 : 0;
  }
  if (a->t == VT_UNDEF || b->t == VT_UNDEF) {
    const value *u = a->t == VT_UNDEF ? a : b;
    rfail(r, pos, PD_EINVAL, "'%s' is undefined", u->u.uname ? u->u.uname : "value");
  }
  rfail(r, pos, PD_EINVAL, "'<' not supported between instances of '%s' and '%s'", type_name(a), type_name(b));
}

/* ---- strings by code point ---- */
static size_t cp_count(const char *p, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    i += u8dec(p + i, n - i, &cp);
    c++;
  }
  return c;
}
static bool is_ascii(const char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)p[i] >= 0x80) return false;
  return true;
}
/* Byte offsets of every code point boundary (n_cp + 1 entries) for strings with non-ASCII. */
static size_t *cp_offsets(R *r, const char *p, size_t n, size_t *ncp) {
  size_t c = cp_count(p, n);
  size_t *o = ralloc(r, mul_sz(r, c + 1, sizeof *o));
  size_t k = 0;
  for (size_t i = 0; i < n;) {
    o[k++] = i;
    uint32_t cp;
    i += u8dec(p + i, n - i, &cp);
  }
  o[k] = n;
  *ncp = c;
  return o;
}

static size_t v_len(R *r, uint32_t pos, const value *v) {
  switch (v->t) {
  case VT_UNDEF: return 0;
  case VT_STR: return cp_count(v->u.s.p, v->u.s.n);
  case VT_LIST: return v->u.l->n;
  case VT_DICT: return v->u.d->n;
  default: rfail(r, pos, PD_EINVAL, "object of type '%s' has no len()", type_name(v));
  }
}

/* The items a for loop (or a filter) iterates: list items, dict keys, string characters;
 * Undefined iterates as empty. */
static const value *v_iter(R *r, uint32_t pos, const value *v, size_t *n) {
  switch (v->t) {
  case VT_UNDEF: *n = 0; return NULL;
  case VT_LIST: *n = v->u.l->n; return v->u.l->v;
  case VT_DICT: *n = v->u.d->n; return v->u.d->k;
  case VT_STR: {
    size_t c = cp_count(v->u.s.p, v->u.s.n);
    value *o = c ? ralloc(r, mul_sz(r, c, sizeof *o)) : NULL;
    size_t k = 0;
    for (size_t i = 0; i < v->u.s.n;) {
      uint32_t cp;
      size_t l = u8dec(v->u.s.p + i, v->u.s.n - i, &cp);
      o[k++] = V_str(v->u.s.p + i, l);
      i += l;
    }
    *n = c;
    return o;
  }
  default: rfail(r, pos, PD_EINVAL, "'%s' object is not iterable", type_name(v));
  }
}

/* ---- string operations (Python str methods) ---------------------------------------------------- */
static bool cp_in(uint32_t c, strv set) {
  for (size_t i = 0; i < set.n;) {
    uint32_t d;
    i += u8dec(set.p + i, set.n - i, &d);
    if (d == c) return true;
  }
  return false;
}

/* strip / lstrip / rstrip; chars NULL strips whitespace. */
static strv str_strip(strv s, const strv *chars, bool left, bool right) {
  size_t b = 0, e = s.n;
  if (left)
    while (b < e) {
      uint32_t c;
      size_t k = u8dec(s.p + b, e - b, &c);
      if (chars ? !cp_in(c, *chars) : !py_isspace(c)) break;
      b += k;
    }
  if (right)
    while (e > b) {
      size_t k = u8prev(s.p + b, e - b) + b;
      uint32_t c;
      u8dec(s.p + k, e - k, &c);
      if (chars ? !cp_in(c, *chars) : !py_isspace(c)) break;
      e = k;
    }
  return (strv){s.p + b, e - b};
}

static const char *memmem_(const char *h, size_t hn, const char *n, size_t nn) {
  if (!nn) return h;
  if (nn > hn) return NULL;
  return memmem(h, hn, n, nn);
}
static const char *memrmem_(const char *h, size_t hn, const char *n, size_t nn) {
  if (!nn) return h + hn;
  if (nn > hn) return NULL;
  for (size_t i = hn - nn + 1; i-- > 0;)
    if (h[i] == n[0] && memcmp(h + i, n, nn) == 0) return h + i;
  return NULL;
}

static void put_case(R *r, sink *o, uint32_t c, int mode) { /* 0 upper, 1 lower, 2 title */
  if (c < 0x80) {
    if (mode == 1) putc_(r, o, (char)((c >= 'A' && c <= 'Z') ? c + 32 : c));
    else putc_(r, o, (char)((c >= 'a' && c <= 'z') ? c - 32 : c));
    return;
  }
  if (c == 0xDF && mode != 1) { /* sharp s: full case mapping */
    puts_(r, o, mode == 0 ? "SS" : "Ss");
    return;
  }
  if (c == 0x130 && mode == 1) {
    puts_(r, o, "i\xCC\x87");
    return;
  }
  utf8proc_int32_t m = mode == 0 ? utf8proc_toupper((utf8proc_int32_t)c)
                     : mode == 1 ? utf8proc_tolower((utf8proc_int32_t)c)
                                 : utf8proc_totitle((utf8proc_int32_t)c);
  putcp(r, o, (uint32_t)m);
}

enum { CM_UPPER, CM_LOWER, CM_CAPITALIZE, CM_PYTITLE, CM_JTITLE, CM_SWAPCASE };
static strv case_map(R *r, strv s, int mode) {
  sink o = {0};
  bool start = true, prev_cased = false;
  for (size_t i = 0; i < s.n;) {
    uint32_t c;
    size_t k = u8dec(s.p + i, s.n - i, &c);
    if (k == 1 && c == 0xFFFD && (unsigned char)s.p[i] >= 0x80) { /* invalid byte: keep */
      put(r, &o, s.p + i, 1);
      i++;
      continue;
    }
    switch (mode) {
    case CM_UPPER: put_case(r, &o, c, 0); break;
    case CM_LOWER: put_case(r, &o, c, 1); break;
    case CM_CAPITALIZE: put_case(r, &o, c, start ? 2 : 1); break;
    case CM_PYTITLE:
      put_case(r, &o, c, prev_cased ? 1 : 2);
      prev_cased = cp_iscased(c);
      break;
    case CM_JTITLE: { /* jinja2 do_title: words split at runs of [-\s({\[<] */
      bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
      if (sep) {
        put(r, &o, s.p + i, k);
        start = true;
        i += k;
        continue;
      }
      put_case(r, &o, c, start ? 0 : 1);
      break;
    }
    case CM_SWAPCASE: put_case(r, &o, c, cp_isupper(c) ? 1 : cp_islower(c) ? 0 : 3); break;
    }
    start = false;
    i += k;
  }
  return (strv){o.p ? o.p : "", o.n};
}

/* ---- attribute and item access (jinja2 sandbox getattr / getitem) ------------------------------- */
static const char *const STR_METHODS[] = {
    "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format",
    "format_map", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower",
    "isnumeric", "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower", "lstrip", "maketrans",
    "partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit",
    "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper", "zfill", NULL};
static const char *const DICT_METHODS[] = {"clear", "copy", "fromkeys", "get", "items", "keys", "pop",
                                           "popitem", "setdefault", "update", "values", NULL};
static const char *const LIST_METHODS[] = {"append", "clear", "copy", "count", "extend", "index", "insert",
                                           "pop", "remove", "reverse", "sort", NULL};
static bool in_names(const char *const *names, const char *s) {
  for (; *names; names++)
    if (!strcmp(*names, s)) return true;
  return false;
}

static value mk_method(R *r, const value *self, const char *name) {
  vfunc *f = ralloc(r, sizeof *f);
  memset(f, 0, sizeof *f);
  f->kind = FN_METHOD;
  f->name = name;
  f->self = *self;
  value v = V_none();
  v.t = VT_FUNC;
  v.u.fn = f;
  return v;
}

/* Undefined values carry either a name ("x" -> "'x' is undefined") or, when the hint contains a
 * space, a full sentence such as jinja2's "list object has no element 3". */
static _Noreturn void fail_undefined(R *r, uint32_t pos, const value *u) {
  const char *h = u->u.uname ? u->u.uname : "value";
  if (strchr(h, ' ')) rfail(r, pos, PD_EINVAL, "%s", h);
  rfail(r, pos, PD_EINVAL, "'%s' is undefined", h);
}
static value undef_msg(R *r, const char *fmt, const char *a, long long n) {
  char b[200];
  snprintf(b, sizeof b, fmt, a, n);
  return V_undef(rdup(r, b, strlen(b)).p);
}

static value loop_attr(R *r, const value *lv, const char *name) {
  const vloop *l = lv->u.lp;
  if (!strcmp(name, "index")) return V_int((int64_t)l->i + 1);
  if (!strcmp(name, "index0")) return V_int((int64_t)l->i);
  if (!strcmp(name, "revindex")) return V_int((int64_t)(l->n - l->i));
  if (!strcmp(name, "revindex0")) return V_int((int64_t)(l->n - l->i - 1));
  if (!strcmp(name, "first")) return V_bool(l->i == 0);
  if (!strcmp(name, "last")) return V_bool(l->i + 1 == l->n);
  if (!strcmp(name, "length")) return V_int((int64_t)l->n);
  if (!strcmp(name, "depth")) return V_int(1);
  if (!strcmp(name, "depth0")) return V_int(0);
  if (!strcmp(name, "previtem")) return l->i > 0 ? l->items[l->i - 1] : V_undef("previtem");
  if (!strcmp(name, "nextitem")) return l->i + 1 < l->n ? l->items[l->i + 1] : V_undef("nextitem");
  if (!strcmp(name, "cycle") || !strcmp(name, "changed")) return mk_method(r, lv, name);
  return V_undef(name);
}

static value v_getattr(R *r, uint32_t pos, const value *obj, const char *name) {
  switch (obj->t) {
  case VT_UNDEF: fail_undefined(r, pos, obj);
  case VT_DICT: {
    if (in_names(DICT_METHODS, name)) return mk_method(r, obj, name);
    value *v = dict_gets(obj->u.d, name);
    return v ? *v : undef_msg(r, "'dict object' has no attribute '%s'", name, 0);
  }
  case VT_NS: {
    value *v = dict_gets(obj->u.d, name);
    return v ? *v : V_undef(name);
  }
  case VT_STR: return in_names(STR_METHODS, name) ? mk_method(r, obj, name) : V_undef(name);
  case VT_LIST: return in_names(LIST_METHODS, name) ? mk_method(r, obj, name) : V_undef(name);
  case VT_LOOP: return loop_attr(r, obj, name);
  default: return V_undef(name);
  }
}

static bool index_of(const value *k, size_t n, size_t *out) {
  if (k->t != VT_INT && k->t != VT_BOOL) return false;
  int64_t i = num_i(k);
  if (i < 0) i += (int64_t)n;
  if (i < 0 || (uint64_t)i >= n) return false;
  *out = (size_t)i;
  return true;
}

static value v_getitem(R *r, uint32_t pos, const value *obj, const value *key) {
  size_t i;
  switch (obj->t) {
  case VT_UNDEF: fail_undefined(r, pos, obj);
  case VT_LIST:
    if (index_of(key, obj->u.l->n, &i)) return obj->u.l->v[i];
    if (key->t == VT_INT) return undef_msg(r, "%s object has no element %lld", type_name(obj), (long long)key->u.i);
    break;
  case VT_STR: {
    if (key->t != VT_INT && key->t != VT_BOOL) break;
    strv s = {obj->u.s.p, obj->u.s.n};
    if (is_ascii(s.p, s.n)) {
      if (index_of(key, s.n, &i)) return V_str(s.p + i, 1);
      return V_undef("index");
    }
    size_t ncp;
    size_t *off = cp_offsets(r, s.p, s.n, &ncp);
    if (index_of(key, ncp, &i)) return V_str(s.p + off[i], off[i + 1] - off[i]);
    return V_undef("index");
  }
  case VT_DICT: {
    if (key->t == VT_LIST && !key->tuple) break;
    value *v = dict_get(obj->u.d, key);
    if (v) return *v;
    break;
  }
  default: break;
  }
  if (key->t == VT_STR) {
    strv k = {key->u.s.p, key->u.s.n};
    return v_getattr(r, pos, obj, rdup(r, k.p, k.n).p);
  }
  return V_undef("item");
}

/* Python slice semantics (PySlice_AdjustIndices). */
static int64_t slice_arg(R *r, uint32_t pos, const value *v, bool *given) {
  *given = v && v->t != VT_NONE && v->t != VT_UNDEF;
  if (!*given) return 0;
  if (v->t != VT_INT && v->t != VT_BOOL) rfail(r, pos, PD_EINVAL, "slice indices must be integers or None");
  return num_i(v);
}
static value v_slice(R *r, uint32_t pos, const value *obj, const value *a, const value *b, const value *c) {
  if (obj->t == VT_UNDEF) fail_undefined(r, pos, obj);
  if (obj->t != VT_LIST && obj->t != VT_STR) return V_undef("slice");
  bool ga, gb, gc;
  int64_t start = slice_arg(r, pos, a, &ga), stop = slice_arg(r, pos, b, &gb), step = slice_arg(r, pos, c, &gc);
  if (!gc) step = 1;
  if (step == 0) rfail(r, pos, PD_EINVAL, "slice step cannot be zero");
  size_t *off = NULL;
  size_t len;
  if (obj->t == VT_LIST) len = obj->u.l->n;
  else if (is_ascii(obj->u.s.p, obj->u.s.n)) len = obj->u.s.n;
  else off = cp_offsets(r, obj->u.s.p, obj->u.s.n, &len);
  int64_t L = (int64_t)len;
  int64_t lower = step > 0 ? 0 : -1, upper = step > 0 ? L : L - 1;
  if (!ga) start = step < 0 ? upper : lower;
  else {
    if (start < 0) start += L;
    if (start < lower) start = lower;
    else if (start > upper) start = upper;
  }
  if (!gb) stop = step < 0 ? lower : upper;
  else {
    if (stop < 0) stop += L;
    if (stop < lower) stop = lower;
    else if (stop > upper) stop = upper;
  }
  int64_t cnt = 0;
  if (step > 0 && start < stop) cnt = (stop - start - 1) / step + 1;
  if (step < 0 && stop < start) cnt = (start - stop - 1) / (-step) + 1;
  charge(r, pos, (uint64_t)cnt / 16);
  if (obj->t == VT_LIST) {
    vlist *l = list_new(r, (size_t)cnt);
    for (int64_t k = 0; k < cnt; k++) l->v[k] = obj->u.l->v[start + k * step];
    return V_list(l, obj->tuple);
  }
  if (step == 1) {
    size_t b0 = off ? off[start] : (size_t)start, b1 = off ? off[start + cnt] : (size_t)(start + cnt);
    return V_str(obj->u.s.p + b0, b1 - b0);
  }
  sink o = {0};
  for (int64_t k = 0; k < cnt; k++) {
    int64_t q = start + k * step;
    size_t b0 = off ? off[q] : (size_t)q, b1 = off ? off[q + 1] : (size_t)q + 1;
    put(r, &o, obj->u.s.p + b0, b1 - b0);
  }
  return sink_value(&o);
}

/* ---- operators ------------------------------------------------------------------------------------ */
static const char *op_sym(int op) {
  switch (op) {
  case OP_ADD: return "+";
  case OP_SUB: return "-";
  case OP_MUL: return "*";
  case OP_DIV: return "/";
  case OP_FLOORDIV: return "//";
  case OP_MOD: return "%";
  case OP_POW: return "**";
  default: return "?";
  }
}

static _Noreturn void fail_operands(R *r, uint32_t pos, int op, const value *a, const value *b) {
  rfail(r, pos, PD_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'", op_sym(op), type_name(a), type_name(b));
}

static value repeat_seq(R *r, uint32_t pos, const value *seq, int64_t times) {
  if (times < 0) times = 0;
  if (seq->t == VT_STR) {
    size_t total = mul_sz(r, seq->u.s.n, (size_t)times);
    char *m = ralloc(r, total + 1);
    for (int64_t i = 0; i < times; i++) memcpy(m + (size_t)i * seq->u.s.n, seq->u.s.p, seq->u.s.n);
    m[total] = 0;
    return V_str(m, total);
  }
  size_t n = seq->u.l->n;
  vlist *l = list_new(r, mul_sz(r, n, (size_t)times));
  charge(r, pos, l->n / 16);
  for (size_t i = 0; i < l->n; i++) l->v[i] = seq->u.l->v[i % n];
  return V_list(l, seq->tuple);
}

static double py_fmod(double x, double y) {
  double m = fmod(x, y);
  if (m != 0) {
    if ((y < 0) != (m < 0)) m += y;
  } else {
    m = copysign(0.0, y);
  }
  return m;
}
static double py_floordiv(double x, double y) {
  double m = fmod(x, y);
  double div = (x - m) / y;
  if (m != 0 && ((y < 0) != (m < 0))) div -= 1.0;
  if (div != 0) {
    double f = floor(div);
    if (div - f > 0.5) f += 1.0;
    return f;
  }
  return copysign(0.0, x / y);
}

static value binop(R *r, uint32_t pos, int op, const value *a, const value *b) {
  if (a->t == VT_UNDEF) fail_undefined(r, pos, a);
  if (b->t == VT_UNDEF) fail_undefined(r, pos, b);
  bool nums = is_num(a) && is_num(b);
  bool fl = nums && (a->t == VT_FLOAT || b->t == VT_FLOAT);
  int64_t x = (nums && !fl) ? num_i(a) : 0, y = (nums && !fl) ? num_i(b) : 0, z;
  double fx = nums ? num_f(a) : 0, fy = nums ? num_f(b) : 0;
  switch (op) {
  case OP_ADD:
    if (nums) {
      if (fl) return V_float(fx + fy);
      if (__builtin_add_overflow(x, y, &z)) break;
      return V_int(z);
    }
    if (a->t == VT_STR && b->t == VT_STR) {
      size_t n = a->u.s.n + b->u.s.n;
      char *m = ralloc(r, n + 1);
      memcpy(m, a->u.s.p, a->u.s.n);
      memcpy(m + a->u.s.n, b->u.s.p, b->u.s.n);
      m[n] = 0;
      return V_str(m, n);
    }
    if (a->t == VT_LIST && b->t == VT_LIST && a->tuple == b->tuple) {
      vlist *l = list_new(r, a->u.l->n + b->u.l->n);
      if (a->u.l->n) memcpy(l->v, a->u.l->v, a->u.l->n * sizeof(value));
      if (b->u.l->n) memcpy(l->v + a->u.l->n, b->u.l->v, b->u.l->n * sizeof(value));
      return V_list(l, a->tuple);
    }
    if (a->t == VT_STR)
      rfail(r, pos, PD_EINVAL, "can only concatenate str (not \"%s\") to str", type_name(b));
    fail_operands(r, pos, op, a, b);
  case OP_SUB:
    if (!nums) fail_operands(r, pos, op, a, b);
    if (fl) return V_float(fx - fy);
    if (__builtin_sub_overflow(x, y, &z)) break;
    return V_int(z);
  case OP_MUL:
    if (nums) {
      if (fl) return V_float(fx * fy);
      if (__builtin_mul_overflow(x, y, &z)) break;
      return V_int(z);
    }
    if ((a->t == VT_STR || a->t == VT_LIST) && (b->t == VT_INT || b->t == VT_BOOL)) return repeat_seq(r, pos, a, num_i(b));
    if ((b->t == VT_STR || b->t == VT_LIST) && (a->t == VT_INT || a->t == VT_BOOL)) return repeat_seq(r, pos, b, num_i(a));
    fail_operands(r, pos, op, a, b);
  case OP_DIV:
    if (!nums) fail_operands(r, pos, op, a, b);
    if (fy == 0) rfail(r, pos, PD_EINVAL, "division by zero");
    return V_float(fx / fy);
  case OP_FLOORDIV:
  case OP_MOD:
    if (a->t == VT_STR && op == OP_MOD) rfail(r, pos, PD_EUNSUPPORTED, "printf-style string formatting is not supported");
    if (!nums) fail_operands(r, pos, op, a, b);
    if (fl) {
      if (fy == 0) rfail(r, pos, PD_EINVAL, "float division by zero");
      return V_float(op == OP_MOD ? py_fmod(fx, fy) : py_floordiv(fx, fy));
    }
    if (y == 0) rfail(r, pos, PD_EINVAL, "integer division or modulo by zero");
    if (x == INT64_MIN && y == -1) {
      if (op == OP_MOD) return V_int(0);
      break;
    }
    {
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        q--;
        m += y;
      }
      return V_int(op == OP_MOD ? m : q);
    }
  case OP_POW:
    if (!nums) fail_operands(r, pos, op, a, b);
    if (!fl && y >= 0) {
      int64_t res = 1, base = x, e = y;
      bool ovf = false;
      while (e > 0 && !ovf) {
        if (e & 1) ovf |= __builtin_mul_overflow(res, base, &res);
        e >>= 1;
        if (e) ovf |= __builtin_mul_overflow(base, base, &base);
      }
      if (ovf) break;
      return V_int(res);
    }
    if (fx == 0 && fy < 0) rfail(r, pos, PD_EINVAL, "0.0 cannot be raised to a negative power");
    if (fx < 0 && fy != floor(fy)) rfail(r, pos, PD_EUNSUPPORTED, "complex results are not supported");
    return V_float(pow(fx, fy));
  default: break;
  }
  rfail(r, pos, PD_EUNSUPPORTED, "integer overflow in '%s' (integers are 64-bit)", op_sym(op));
}

static bool v_contains(R *r, uint32_t pos, const value *hay, const value *needle) {
  switch (hay->t) {
  case VT_UNDEF: return false;
  case VT_STR:
    if (needle->t != VT_STR)
      rfail(r, pos, PD_EINVAL, "'in <string>' requires string as left operand, not %s", type_name(needle));
    charge(r, pos, hay->u.s.n / 64);
    return memmem_(hay->u.s.p, hay->u.s.n, needle->u.s.p, needle->u.s.n) != NULL;
  case VT_LIST:
    charge(r, pos, hay->u.l->n / 16);
    for (size_t i = 0; i < hay->u.l->n; i++)
      if (v_eq(&hay->u.l->v[i], needle)) return true;
    return false;
  case VT_DICT:
    check_hashable(r, pos, needle);
    return dict_get(hay->u.d, needle) != NULL;
  default: rfail(r, pos, PD_EINVAL, "argument of type '%s' is not iterable", type_name(hay));
  }
}

static bool compare_op(R *r, uint32_t pos, int op, const value *a, const value *b) {
  switch (op) {
  case OP_EQ: return v_eq(a, b);
  case OP_NE: return !v_eq(a, b);
  case OP_LT: return v_cmp(r, pos, a, b) < 0;
  case OP_LE: return v_cmp(r, pos, a, b) <= 0;
  case OP_GT: return v_cmp(r, pos, a, b) > 0;
  case OP_GE: return v_cmp(r, pos, a, b) >= 0;
  case OP_IN: return v_contains(r, pos, b, a);
  case OP_NOTIN: return !v_contains(r, pos, b, a);
  default: return false;
  }
}

/* ---- calls: argument binding --------------------------------------------------------------------- */
typedef struct cargs {
  const value *pos;
  size_t npos;
  const char *const *kwn;
  const value *kwv;
  size_t nkw;
} cargs;

/* Binds a call's arguments to the named parameters like Python does; given[i] says whether
 * parameter i was passed. */
static void bind(R *r, uint32_t pos, const char *fn, const cargs *a, const char *const *params, size_t np,
                 value *out, bool *given) {
  for (size_t i = 0; i < np; i++) {
    out[i] = V_undef(params[i]);
    given[i] = false;
  }
  if (a->npos > np) rfail(r, pos, PD_EINVAL, "%s() takes at most %zu argument(s) (%zu given)", fn, np, a->npos);
  for (size_t i = 0; i < a->npos; i++) {
    out[i] = a->pos[i];
    given[i] = true;
  }
  for (size_t k = 0; k < a->nkw; k++) {
    size_t j;
    for (j = 0; j < np; j++)
      if (!strcmp(params[j], a->kwn[k])) break;
    if (j == np) rfail(r, pos, PD_EINVAL, "%s() got an unexpected keyword argument '%s'", fn, a->kwn[k]);
    if (given[j]) rfail(r, pos, PD_EINVAL, "%s() got multiple values for argument '%s'", fn, a->kwn[k]);
    out[j] = a->kwv[k];
    given[j] = true;
  }
}
#define BIND(fn, ...)                                                       \
  static const char *const prm_[] = {__VA_ARGS__};                          \
  enum { NP_ = sizeof prm_ / sizeof prm_[0] };                              \
  value av[NP_];                                                            \
  bool ag[NP_];                                                             \
  bind(r, pos, fn, a, prm_, NP_, av, ag)

static void no_args(R *r, uint32_t pos, const char *fn, const cargs *a) {
  if (a->npos || a->nkw) rfail(r, pos, PD_EINVAL, "%s() takes no arguments", fn);
}

static int64_t arg_int(R *r, uint32_t pos, const value *v, const char *fn) {
  if (v->t != VT_INT && v->t != VT_BOOL) rfail(r, pos, PD_EINVAL, "%s(): expected an integer, got %s", fn, type_name(v));
  return num_i(v);
}
static strv arg_str(R *r, uint32_t pos, const value *v, const char *fn) {
  if (v->t != VT_STR) rfail(r, pos, PD_EINVAL, "%s(): expected a string, got %s", fn, type_name(v));
  return (strv){v->u.s.p, v->u.s.n};
}
static bool absent(const value *v) { return v->t == VT_UNDEF || v->t == VT_NONE; }

/* ---- str methods ---- */
static value str_split(R *r, uint32_t pos, strv s, const value *sepv, int64_t maxsplit, bool right) {
  lbuild b = {0};
  charge(r, pos, s.n / 64);
  if (absent(sepv)) {
    if (!right) {
      size_t i = 0;
      int64_t cnt = 0;
      for (;;) {
        i = skip_ws(s.p, s.n, i);
        if (i >= s.n) break;
        if (maxsplit >= 0 && cnt == maxsplit) {
          lb_push(r, &b, V_str(s.p + i, s.n - i));
          break;
        }
        size_t j = i;
        while (j < s.n) {
          uint32_t c;
          size_t k = u8dec(s.p + j, s.n - j, &c);
          if (py_isspace(c)) break;
          j += k;
        }
        lb_push(r, &b, V_str(s.p + i, j - i));
        cnt++;
        i = j;
      }
    } else {
      size_t e = s.n;
      int64_t cnt = 0;
      for (;;) {
        e = rstrip_ws_len(s.p, e);
        if (e == 0) break;
        if (maxsplit >= 0 && cnt == maxsplit) {
          lb_push(r, &b, V_str(s.p, e));
          break;
        }
        size_t j = e;
        while (j > 0) {
          size_t k = u8prev(s.p, j);
          uint32_t c;
          u8dec(s.p + k, j - k, &c);
          if (py_isspace(c)) break;
          j = k;
        }
        lb_push(r, &b, V_str(s.p + j, e - j));
        cnt++;
        e = j;
      }
    }
  } else {
    strv sep = arg_str(r, pos, sepv, "split");
    if (!sep.n) rfail(r, pos, PD_EINVAL, "empty separator");
    if (!right) {
      size_t i = 0;
      int64_t cnt = 0;
      for (;;) {
        const char *f = (maxsplit >= 0 && cnt == maxsplit) ? NULL : memmem_(s.p + i, s.n - i, sep.p, sep.n);
        if (!f) {
          lb_push(r, &b, V_str(s.p + i, s.n - i));
          break;
        }
        lb_push(r, &b, V_str(s.p + i, (size_t)(f - (s.p + i))));
        i = (size_t)(f - s.p) + sep.n;
        cnt++;
      }
    } else {
      size_t e = s.n;
      int64_t cnt = 0;
      for (;;) {
        const char *f = (maxsplit >= 0 && cnt == maxsplit) ? NULL : memrmem_(s.p, e, sep.p, sep.n);
        if (!f) {
          lb_push(r, &b, V_str(s.p, e));
          break;
        }
        size_t fe = (size_t)(f - s.p) + sep.n;
        lb_push(r, &b, V_str(s.p + fe, e - fe));
        e = (size_t)(f - s.p);
        cnt++;
      }
    }
  }
  if (right)
    for (size_t i = 0; i < b.n / 2; i++) {
      value t = b.v[i];
      b.v[i] = b.v[b.n - 1 - i];
      b.v[b.n - 1 - i] = t;
    }
  return lb_value(r, &b, false);
}

static value str_splitlines(R *r, strv s, bool keepends) {
  lbuild b = {0};
  size_t i = 0, start = 0;
  while (i < s.n) {
    uint32_t c;
    size_t k = u8dec(s.p + i, s.n - i, &c);
    if (py_islinebreak(c)) {
      size_t eol = i + k;
      if (c == '\r' && eol < s.n && s.p[eol] == '\n') eol++;
      lb_push(r, &b, V_str(s.p + start, (keepends ? eol : i) - start));
      i = start = eol;
    } else {
      i += k;
    }
  }
  if (start < s.n) lb_push(r, &b, V_str(s.p + start, s.n - start));
  return lb_value(r, &b, false);
}

static strv str_replace(R *r, uint32_t pos, strv s, strv old, strv neu, int64_t count) {
  sink o = {0};
  charge(r, pos, s.n / 64);
  if (!old.n) { /* Python inserts the replacement between all characters */
    int64_t done = 0;
    size_t i = 0;
    while (count < 0 || done < count) {
      put(r, &o, neu.p, neu.n);
      done++;
      if (i >= s.n) break;
      uint32_t c;
      size_t k = u8dec(s.p + i, s.n - i, &c);
      put(r, &o, s.p + i, k);
      i += k;
    }
    put(r, &o, s.p + i, s.n - i);
    return (strv){o.p ? o.p : "", o.n};
  }
  size_t i = 0;
  int64_t done = 0;
  for (;;) {
    const char *f = (count >= 0 && done >= count) ? NULL : memmem_(s.p + i, s.n - i, old.p, old.n);
    if (!f) break;
    put(r, &o, s.p + i, (size_t)(f - (s.p + i)));
    put(r, &o, neu.p, neu.n);
    i = (size_t)(f - s.p) + old.n;
    done++;
  }
  if (!done) return s;
  put(r, &o, s.p + i, s.n - i);
  return (strv){o.p ? o.p : "", o.n};
}

static bool str_pred(strv s, int kind) { /* 0 digit 1 alpha 2 alnum 3 space 4 lower 5 upper */
  if (!s.n) return false;
  bool cased = false;
  for (size_t i = 0; i < s.n;) {
    uint32_t c;
    i += u8dec(s.p + i, s.n - i, &c);
    switch (kind) {
    case 0: if (!cp_isdigit(c)) return false; break;
    case 1: if (!cp_isalpha(c)) return false; break;
    case 2: if (!cp_isalpha(c) && !cp_isdigit(c)) return false; break;
    case 3: if (!py_isspace(c)) return false; break;
    case 4:
      if (cp_isupper(c)) return false;
      cased |= cp_islower(c);
      break;
    case 5:
      if (cp_islower(c)) return false;
      cased |= cp_isupper(c);
      break;
    }
  }
  return kind < 4 ? true : cased;
}

static strv str_pad(R *r, strv s, int64_t width, strv fill, int how) { /* 0 center 1 ljust 2 rjust */
  int64_t len = (int64_t)cp_count(s.p, s.n);
  if (width <= len) return s;
  int64_t marg = width - len, left;
  if (how == 0) left = marg / 2 + (marg & width & 1);
  else left = how == 1 ? 0 : marg;
  sink o = {0};
  for (int64_t i = 0; i < left; i++) put(r, &o, fill.p, fill.n);
  put(r, &o, s.p, s.n);
  for (int64_t i = 0; i < marg - left; i++) put(r, &o, fill.p, fill.n);
  return (strv){o.p, o.n};
}

static bool match_affix(R *r, uint32_t pos, strv s, const value *arg, bool end, const char *fn) {
  if (arg->t == VT_LIST && arg->tuple) {
    for (size_t i = 0; i < arg->u.l->n; i++)
      if (match_affix(r, pos, s, &arg->u.l->v[i], end, fn)) return true;
    return false;
  }
  if (arg->t != VT_STR)
    rfail(r, pos, PD_EINVAL, "%s first arg must be str or a tuple of str, not %s", fn, type_name(arg));
  size_t n = arg->u.s.n;
  if (n > s.n) return false;
  return memcmp(end ? s.p + s.n - n : s.p, arg->u.s.p, n) == 0;
}

/* str.format with "{}", "{0}" and "{name}" fields; format specs and conversions are not
 * supported. */
static value str_format(R *r, uint32_t pos, strv s, const cargs *a) {
  sink o = {0};
  size_t auto_idx = 0;
  for (size_t i = 0; i < s.n; i++) {
    char c = s.p[i];
    if (c == '}') {
      if (i + 1 < s.n && s.p[i + 1] == '}') i++;
      else rfail(r, pos, PD_EINVAL, "Single '}' encountered in format string");
      putc_(r, &o, '}');
      continue;
    }
    if (c != '{') {
      putc_(r, &o, c);
      continue;
    }
    if (i + 1 < s.n && s.p[i + 1] == '{') {
      putc_(r, &o, '{');
      i++;
      continue;
    }
    size_t j = i + 1;
    while (j < s.n && s.p[j] != '}') j++;
    if (j >= s.n) rfail(r, pos, PD_EINVAL, "Single '{' encountered in format string");
    strv f = {s.p + i + 1, j - i - 1};
    const value *v = NULL;
    bool digits = f.n > 0;
    for (size_t q = 0; q < f.n; q++) {
      if (strchr(":![.", f.p[q])) rfail(r, pos, PD_EUNSUPPORTED, "str.format(): format specs are not supported");
      digits &= isdig(f.p[q]);
    }
    if (!f.n || digits) {
      size_t idx = f.n ? (size_t)strtoul(rdup(r, f.p, f.n).p, NULL, 10) : auto_idx++;
      if (idx >= a->npos) rfail(r, pos, PD_EINVAL, "Replacement index %zu out of range for positional args tuple", idx);
      v = &a->pos[idx];
    } else {
      for (size_t k = 0; k < a->nkw && !v; k++)
        if (strv_eq(f, a->kwn[k])) v = &a->kwv[k];
      if (!v) rfail(r, pos, PD_EINVAL, "str.format(): missing keyword argument '%.*s'", (int)f.n, f.p);
    }
    put_str(r, &o, v, pos);
    i = j;
  }
  return sink_value(&o);
}

static value call_str_method(R *r, uint32_t pos, strv s, const char *m, const cargs *a) {
  if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
    if (a->npos != 1 || a->nkw) rfail(r, pos, PD_EUNSUPPORTED, "str.%s() is supported with one argument only", m);
    return V_bool(match_affix(r, pos, s, &a->pos[0], m[0] == 'e', m));
  }
  if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
    BIND(m, "chars");
    strv chars;
    bool has = !absent(&av[0]);
    if (has) chars = arg_str(r, pos, &av[0], m);
    return V_strv(str_strip(s, has ? &chars : NULL, m[0] != 'r', m[0] != 'l'));
  }
  if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
    BIND(m, "sep", "maxsplit");
    int64_t mx = ag[1] ? arg_int(r, pos, &av[1], m) : -1;
    return str_split(r, pos, s, &av[0], mx, m[0] == 'r');
  }
  if (!strcmp(m, "splitlines")) {
    BIND(m, "keepends");
    return str_splitlines(r, s, truthy(&av[0]));
  }
  if (!strcmp(m, "upper")) return no_args(r, pos, m, a), V_strv(case_map(r, s, CM_UPPER));
  if (!strcmp(m, "lower")) return no_args(r, pos, m, a), V_strv(case_map(r, s, CM_LOWER));
  if (!strcmp(m, "title")) return no_args(r, pos, m, a), V_strv(case_map(r, s, CM_PYTITLE));
  if (!strcmp(m, "capitalize")) return no_args(r, pos, m, a), V_strv(case_map(r, s, CM_CAPITALIZE));
  if (!strcmp(m, "swapcase")) return no_args(r, pos, m, a), V_strv(case_map(r, s, CM_SWAPCASE));
  if (!strcmp(m, "replace")) {
    BIND(m, "old", "new", "count");
    int64_t cnt = ag[2] ? arg_int(r, pos, &av[2], m) : -1;
    return V_strv(str_replace(r, pos, s, arg_str(r, pos, &av[0], m), arg_str(r, pos, &av[1], m), cnt));
  }
  if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "rindex") || !strcmp(m, "count")) {
    if (a->npos != 1 || a->nkw) rfail(r, pos, PD_EUNSUPPORTED, "str.%s() is supported with one argument only", m);
    strv sub = arg_str(r, pos, &a->pos[0], m);
    charge(r, pos, s.n / 64);
    if (!strcmp(m, "count")) {
      if (!sub.n) return V_int((int64_t)cp_count(s.p, s.n) + 1);
      int64_t c = 0;
      for (const char *f = s.p; (f = memmem_(f, s.n - (size_t)(f - s.p), sub.p, sub.n)); f += sub.n) c++;
      return V_int(c);
    }
    const char *f = m[0] == 'r' ? memrmem_(s.p, s.n, sub.p, sub.n) : memmem_(s.p, s.n, sub.p, sub.n);
    if (!f) {
      if (strstr(m, "index")) rfail(r, pos, PD_EINVAL, "substring not found");
      return V_int(-1);
    }
    return V_int((int64_t)cp_count(s.p, (size_t)(f - s.p)));
  }
  if (!strcmp(m, "join")) {
    if (a->npos != 1 || a->nkw) rfail(r, pos, PD_EINVAL, "join() takes exactly one argument");
    size_t n;
    const value *it = v_iter(r, pos, &a->pos[0], &n);
    charge(r, pos, n);
    sink o = {0};
    for (size_t i = 0; i < n; i++) {
      if (it[i].t != VT_STR)
        rfail(r, pos, PD_EINVAL, "sequence item %zu: expected str instance, %s found", i, type_name(&it[i]));
      if (i) put(r, &o, s.p, s.n);
      put(r, &o, it[i].u.s.p, it[i].u.s.n);
    }
    return sink_value(&o);
  }
  if (!strcmp(m, "isdigit") || !strcmp(m, "isdecimal") || !strcmp(m, "isnumeric"))
    return no_args(r, pos, m, a), V_bool(str_pred(s, 0));
  if (!strcmp(m, "isalpha")) return no_args(r, pos, m, a), V_bool(str_pred(s, 1));
  if (!strcmp(m, "isalnum")) return no_args(r, pos, m, a), V_bool(str_pred(s, 2));
  if (!strcmp(m, "isspace")) return no_args(r, pos, m, a), V_bool(str_pred(s, 3));
  if (!strcmp(m, "islower")) return no_args(r, pos, m, a), V_bool(str_pred(s, 4));
  if (!strcmp(m, "isupper")) return no_args(r, pos, m, a), V_bool(str_pred(s, 5));
  if (!strcmp(m, "center") || !strcmp(m, "ljust") || !strcmp(m, "rjust")) {
    BIND(m, "width", "fillchar");
    strv fill = ag[1] ? arg_str(r, pos, &av[1], m) : (strv){" ", 1};
    if (cp_count(fill.p, fill.n) != 1) rfail(r, pos, PD_EINVAL, "The fill character must be exactly one character long");
    return V_strv(str_pad(r, s, arg_int(r, pos, &av[0], m), fill, m[0] == 'c' ? 0 : m[0] == 'l' ? 1 : 2));
  }
  if (!strcmp(m, "removeprefix") || !strcmp(m, "removesuffix")) {
    BIND(m, "affix");
    strv x = arg_str(r, pos, &av[0], m);
    bool suf = m[6] == 's';
    if (x.n <= s.n && memcmp(suf ? s.p + s.n - x.n : s.p, x.p, x.n) == 0)
      return suf ? V_str(s.p, s.n - x.n) : V_str(s.p + x.n, s.n - x.n);
    return V_strv(s);
  }
  if (!strcmp(m, "format")) return str_format(r, pos, s, a);
  rfail(r, pos, PD_EUNSUPPORTED, "str.%s() is not supported", m);
}

static value call_method(R *r, uint32_t pos, const value *self, const char *m, const cargs *a) {
  switch (self->t) {
  case VT_STR: return call_str_method(r, pos, (strv){self->u.s.p, self->u.s.n}, m, a);
  case VT_DICT: {
    const vdict *d = self->u.d;
    if (!strcmp(m, "get")) {
      BIND(m, "key", "default");
      check_hashable(r, pos, &av[0]);
      value *v = dict_get(d, &av[0]);
      return v ? *v : ag[1] ? av[1] : V_none();
    }
    if (!strcmp(m, "items") || !strcmp(m, "keys") || !strcmp(m, "values")) {
      no_args(r, pos, m, a);
      vlist *l = list_new(r, d->n);
      for (size_t i = 0; i < d->n; i++) {
        if (m[0] == 'k') l->v[i] = d->k[i];
        else if (m[0] == 'v') l->v[i] = d->v[i];
        else {
          vlist *p = list_new(r, 2);
          p->v[0] = d->k[i];
          p->v[1] = d->v[i];
          l->v[i] = V_list(p, true);
        }
      }
      return V_list(l, false);
    }
    if (!strcmp(m, "copy")) {
      vdict *c = dict_new(r);
      for (size_t i = 0; i < d->n; i++) dict_set(r, c, d->k[i], d->v[i]);
      return V_dict(c, VT_DICT);
    }
    rfail(r, pos, PD_EUNSUPPORTED, "dict.%s() is not supported (template values are immutable)", m);
  }
  case VT_LIST: {
    if (!strcmp(m, "index") || !strcmp(m, "count")) {
      if (a->npos != 1 || a->nkw) rfail(r, pos, PD_EUNSUPPORTED, "list.%s() is supported with one argument only", m);
      int64_t c = 0;
      for (size_t i = 0; i < self->u.l->n; i++)
        if (v_eq(&self->u.l->v[i], &a->pos[0])) {
          if (m[0] == 'i') return V_int((int64_t)i);
          c++;
        }
      if (m[0] == 'i') rfail(r, pos, PD_EINVAL, "list.index(x): x not in list");
      return V_int(c);
    }
    if (!strcmp(m, "copy")) return V_list(self->u.l, self->tuple);
    rfail(r, pos, PD_EUNSUPPORTED, "list.%s() is not supported (template values are immutable)", m);
  }
  case VT_LOOP:
    if (!strcmp(m, "cycle")) {
      if (!a->npos) rfail(r, pos, PD_EINVAL, "no items for cycling given");
      return a->pos[self->u.lp->i % a->npos];
    }
    rfail(r, pos, PD_EUNSUPPORTED, "loop.%s() is not supported", m);
  default: rfail(r, pos, PD_EUNSUPPORTED, "%s.%s() is not supported", type_name(self), m);
  }
}

/* ---- filters (jinja2.filters, with transformers' tojson) ----------------------------------------- */
typedef value (*filter_fn)(R *r, uint32_t pos, value in, const cargs *a);
typedef bool (*test_fn)(R *r, uint32_t pos, const value *v, const cargs *a);
static value apply_filter_name(R *r, uint32_t pos, strv name, value in, const cargs *a);
static bool apply_test_name(R *r, uint32_t pos, strv name, const value *v, const cargs *a);

/* jinja2 make_attrgetter: "a.b.0" looks up each part with getitem (digits as integers). */
static value attr_path(R *r, uint32_t pos, value item, const value *attr) {
  if (attr->t == VT_INT) return v_getitem(r, pos, &item, attr);
  strv path = arg_str(r, pos, attr, "attribute");
  size_t i = 0;
  for (;;) {
    size_t j = i;
    while (j < path.n && path.p[j] != '.') j++;
    bool digits = j > i;
    int64_t num = 0;
    for (size_t q = i; q < j; q++) {
      if (!isdig(path.p[q]) || num > INT64_MAX / 10 - 10) {
        digits = false;
        break;
      }
      num = num * 10 + (path.p[q] - '0');
    }
    value key = digits ? V_int(num) : V_str(path.p + i, j - i);
    if (item.t == VT_UNDEF) fail_undefined(r, pos, &item);
    item = v_getitem(r, pos, &item, &key);
    if (j >= path.n) return item;
    i = j + 1;
  }
}

static value lower_key(R *r, value v) { return v.t == VT_STR ? V_strv(case_map(r, (strv){v.u.s.p, v.u.s.n}, CM_LOWER)) : v; }

/* Stable merge sort of idx[0..n) by keys (descending when rev, still stable like Python). */
static void msort(R *r, uint32_t pos, size_t *idx, size_t *tmp, size_t n, const value *keys, bool rev) {
  if (n < 2) return;
  size_t h = n / 2;
  msort(r, pos, idx, tmp, h, keys, rev);
  msort(r, pos, idx + h, tmp, n - h, keys, rev);
  size_t i = 0, j = h, k = 0;
  while (i < h && j < n) {
    int c = v_cmp(r, pos, &keys[idx[j]], &keys[idx[i]]);
    if (rev ? c > 0 : c < 0) tmp[k++] = idx[j++];
    else tmp[k++] = idx[i++];
  }
  while (i < h) tmp[k++] = idx[i++];
  while (j < n) tmp[k++] = idx[j++];
  memcpy(idx, tmp, n * sizeof *idx);
}

/* Sorted copy of items by key (attribute, case folding) like jinja2's sort filter. */
static value sorted_items(R *r, uint32_t pos, const value *items, size_t n, const value *attr, bool ci, bool rev,
                          bool tuple) {
  charge(r, pos, n * 4);
  value *keys = n ? ralloc(r, mul_sz(r, n, sizeof *keys)) : NULL;
  size_t *idx = n ? ralloc(r, mul_sz(r, n, sizeof *idx)) : NULL;
  size_t *tmp = n ? ralloc(r, mul_sz(r, n, sizeof *tmp)) : NULL;
  for (size_t i = 0; i < n; i++) {
    keys[i] = attr ? attr_path(r, pos, items[i], attr) : items[i];
    if (ci) keys[i] = lower_key(r, keys[i]);
    idx[i] = i;
  }
  msort(r, pos, idx, tmp, n, keys, rev);
  vlist *l = list_new(r, n);
  for (size_t i = 0; i < n; i++) l->v[i] = items[idx[i]];
  return V_list(l, tuple);
}

static value f_trim(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("trim", "chars");
  strv s = to_str(r, &in, pos), chars;
  bool has = !absent(&av[0]);
  if (has) chars = to_str(r, &av[0], pos);
  return V_strv(str_strip(s, has ? &chars : NULL, true, true));
}
static value f_length(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "length", a);
  return V_int((int64_t)v_len(r, pos, &in));
}
static value f_upper(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "upper", a);
  return V_strv(case_map(r, to_str(r, &in, pos), CM_UPPER));
}
static value f_lower(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "lower", a);
  return V_strv(case_map(r, to_str(r, &in, pos), CM_LOWER));
}
static value f_capitalize(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "capitalize", a);
  return V_strv(case_map(r, to_str(r, &in, pos), CM_CAPITALIZE));
}
static value f_title(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "title", a);
  return V_strv(case_map(r, to_str(r, &in, pos), CM_JTITLE));
}
static value f_string(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "string", a);
  return V_strv(to_str(r, &in, pos));
}
static value f_safe(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "safe", a);
  return in;
}
static value f_escape(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "escape", a);
  strv s = to_str(r, &in, pos);
  sink o = {0};
  for (size_t i = 0; i < s.n; i++) {
    switch (s.p[i]) {
    case '&': puts_(r, &o, "&amp;"); break;
    case '<': puts_(r, &o, "&lt;"); break;
    case '>': puts_(r, &o, "&gt;"); break;
    case '"': puts_(r, &o, "&#34;"); break;
    case '\'': puts_(r, &o, "&#39;"); break;
    default: putc_(r, &o, s.p[i]);
    }
  }
  return sink_value(&o);
}
static value f_tojson(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("tojson", "ensure_ascii", "indent", "separators", "sort_keys");
  jsonopt o;
  memset(&o, 0, sizeof o);
  o.ensure_ascii = truthy(&av[0]);
  o.sort_keys = truthy(&av[3]);
  if (!absent(&av[1])) {
    o.indent_on = true;
    if (av[1].t == VT_STR) {
      o.indent = (strv){av[1].u.s.p, av[1].u.s.n};
    } else {
      int64_t w = arg_int(r, pos, &av[1], "tojson");
      if (w > 1024) w = 1024;
      char *sp = ralloc(r, (size_t)(w > 0 ? w : 0) + 1);
      memset(sp, ' ', (size_t)(w > 0 ? w : 0));
      o.indent = (strv){sp, (size_t)(w > 0 ? w : 0)};
    }
  }
  o.item_sep = o.indent_on ? (strv){",", 1} : (strv){", ", 2};
  o.key_sep = (strv){": ", 2};
  if (!absent(&av[2])) {
    if (av[2].t != VT_LIST || av[2].u.l->n != 2 || av[2].u.l->v[0].t != VT_STR || av[2].u.l->v[1].t != VT_STR)
      rfail(r, pos, PD_EINVAL, "tojson(): separators must be a pair of strings");
    o.item_sep = (strv){av[2].u.l->v[0].u.s.p, av[2].u.l->v[0].u.s.n};
    o.key_sep = (strv){av[2].u.l->v[1].u.s.p, av[2].u.l->v[1].u.s.n};
  }
  sink s = {0};
  put_json(r, &s, &in, &o, 0, pos);
  return sink_value(&s);
}
static value f_default(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("default", "default_value", "boolean");
  if (in.t == VT_UNDEF || (truthy(&av[1]) && !truthy(&in))) return ag[0] ? av[0] : V_str("", 0);
  return in;
}
static value f_first(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "first", a);
  if (in.t == VT_STR) return in.u.s.n ? v_getitem(r, pos, &in, &(value){.t = VT_INT, .u.i = 0}) : V_undef("first");
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  return n ? it[0] : V_undef("first");
}
static value f_last(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "last", a);
  if (in.t == VT_STR) return in.u.s.n ? v_getitem(r, pos, &in, &(value){.t = VT_INT, .u.i = -1}) : V_undef("last");
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  return n ? it[n - 1] : V_undef("last");
}
static value f_join(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("join", "d", "attribute");
  strv sep = ag[0] ? to_str(r, &av[0], pos) : (strv){"", 0};
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  charge(r, pos, n);
  sink o = {0};
  for (size_t i = 0; i < n; i++) {
    if (i) put(r, &o, sep.p, sep.n);
    value x = ag[1] && !absent(&av[1]) ? attr_path(r, pos, it[i], &av[1]) : it[i];
    put_str(r, &o, &x, pos);
  }
  return sink_value(&o);
}
static value f_list(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "list", a);
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  charge(r, pos, n / 16);
  vlist *l = list_new(r, n);
  if (n) memcpy(l->v, it, n * sizeof(value));
  return V_list(l, false);
}
static value f_items(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "items", a);
  if (in.t == VT_UNDEF) return V_list(list_new(r, 0), false);
  if (in.t != VT_DICT) rfail(r, pos, PD_EINVAL, "Can only get item pairs from a mapping.");
  return call_method(r, pos, &in, "items", &(cargs){0});
}
static value f_replace(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("replace", "old", "new", "count");
  int64_t cnt = absent(&av[2]) ? -1 : arg_int(r, pos, &av[2], "replace");
  return V_strv(str_replace(r, pos, to_str(r, &in, pos), to_str(r, &av[0], pos), to_str(r, &av[1], pos), cnt));
}

/* Python int(str, base) / float(str); false when Python would raise ValueError. */
static bool parse_pyint(strv s, int64_t base, int64_t *out) {
  s = str_strip(s, NULL, true, true);
  size_t i = 0;
  bool neg = false;
  if (i < s.n && (s.p[i] == '+' || s.p[i] == '-')) neg = s.p[i++] == '-';
  if (i + 1 < s.n && s.p[i] == '0') {
    char c = (char)tolower((unsigned char)s.p[i + 1]);
    int pb = c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0;
    if (pb && (base == pb || base == 0)) {
      base = pb;
      i += 2;
      if (i < s.n && s.p[i] == '_') i++;
    }
  }
  if (base == 0) base = 10;
  if (base < 2 || base > 36 || i >= s.n) return false;
  uint64_t v = 0;
  bool prev_digit = false;
  for (; i < s.n; i++) {
    char c = (char)tolower((unsigned char)s.p[i]);
    if (c == '_') {
      if (!prev_digit || i + 1 >= s.n) return false;
      prev_digit = false;
      continue;
    }
    int d = isdig(c) ? c - '0' : (c >= 'a' && c <= 'z') ? c - 'a' + 10 : 99;
    if (d >= base) return false;
    if (v > ((uint64_t)INT64_MAX + 1 - (uint64_t)d) / (uint64_t)base) return false;
    v = v * (uint64_t)base + (uint64_t)d;
    prev_digit = true;
  }
  if (!prev_digit || v > (uint64_t)INT64_MAX + (neg ? 1 : 0)) return false;
  *out = neg ? (int64_t)(0 - v) : (int64_t)v;
  return true;
}
static bool parse_pyfloat(strv s, double *out) {
  s = str_strip(s, NULL, true, true);
  if (!s.n || s.n > 400) return false;
  char buf[416];
  size_t k = 0;
  for (size_t i = 0; i < s.n; i++) {
    char c = s.p[i];
    if (c == '_') {
      if (!(i > 0 && isdig(s.p[i - 1]) && i + 1 < s.n && isdig(s.p[i + 1]))) return false;
      continue;
    }
    if (c == 'x' || c == 'X' || c == 'p' || c == 'P' || (unsigned char)c >= 0x80 || c == 0) return false;
    buf[k++] = c;
  }
  buf[k] = 0;
  char *end;
  double d = strtod(buf, &end);
  if (end != buf + k) return false;
  *out = d;
  return true;
}
static value f_int(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("int", "default", "base");
  value def = ag[0] ? av[0] : V_int(0);
  int64_t base = ag[1] ? arg_int(r, pos, &av[1], "int") : 10;
  int64_t i;
  double d;
  switch (in.t) {
  case VT_INT: return in;
  case VT_BOOL: return V_int(in.u.b);
  case VT_FLOAT: d = in.u.f; break;
  case VT_STR:
    if (parse_pyint((strv){in.u.s.p, in.u.s.n}, base, &i)) return V_int(i);
    if (!parse_pyfloat((strv){in.u.s.p, in.u.s.n}, &d)) return def;
    break;
  default: return def;
  }
  if (isnan(d) || isinf(d) || d >= 9.2233720368547758e18 || d < -9.2233720368547758e18) return def;
  return V_int((int64_t)d);
}
static value f_float(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("float", "default");
  value def = ag[0] ? av[0] : V_float(0.0);
  double d;
  if (is_num(&in)) return V_float(num_f(&in));
  if (in.t == VT_STR && parse_pyfloat((strv){in.u.s.p, in.u.s.n}, &d)) return V_float(d);
  return def;
}
static value f_abs(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "abs", a);
  if (in.t == VT_FLOAT) return V_float(fabs(in.u.f));
  if (in.t == VT_INT || in.t == VT_BOOL) {
    int64_t i = num_i(&in);
    if (i == INT64_MIN) rfail(r, pos, PD_EUNSUPPORTED, "integer overflow in abs");
    return V_int(i < 0 ? -i : i);
  }
  rfail(r, pos, PD_EINVAL, "bad operand type for abs(): '%s'", type_name(&in));
}
static value f_round(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("round", "precision", "method");
  int64_t prec = ag[0] ? arg_int(r, pos, &av[0], "round") : 0;
  strv method = ag[1] ? arg_str(r, pos, &av[1], "round") : (strv){"common", 6};
  if (!is_num(&in)) rfail(r, pos, PD_EINVAL, "round(): expected a number, got %s", type_name(&in));
  if (prec > 300) prec = 300;
  if (prec < -300) prec = -300;
  if (strv_eq(method, "common")) {
    if (in.t != VT_FLOAT && prec >= 0) return V_int(num_i(&in));
    double x = num_f(&in);
    if (isnan(x) || isinf(x)) return V_float(x);
    if (prec >= 0) { /* correctly rounded, half to even, like Python's round() */
      char buf[512];
      snprintf(buf, sizeof buf, "%.*f", (int)prec, x);
      return V_float(strtod(buf, NULL));
    }
    double p10 = pow(10.0, (double)-prec);
    return V_float(nearbyint(x / p10) * p10);
  }
  if (!strv_eq(method, "ceil") && !strv_eq(method, "floor"))
    rfail(r, pos, PD_EINVAL, "method must be common, ceil or floor");
  double p10 = pow(10.0, (double)prec);
  double x = num_f(&in) * p10;
  return V_float((method.p[0] == 'c' ? ceil(x) : floor(x)) / p10);
}

static const value *kwarg(const cargs *a, const char *name) {
  for (size_t i = 0; i < a->nkw; i++)
    if (!strcmp(a->kwn[i], name)) return &a->kwv[i];
  return NULL;
}

static value f_map(R *r, uint32_t pos, value in, const cargs *a) {
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  charge(r, pos, n);
  vlist *l = list_new(r, n);
  const value *attr = kwarg(a, "attribute");
  if (attr) {
    const value *def = kwarg(a, "default");
    for (size_t k = 0; k < a->nkw; k++)
      if (strcmp(a->kwn[k], "attribute") && strcmp(a->kwn[k], "default"))
        rfail(r, pos, PD_EINVAL, "map(): unexpected keyword argument '%s'", a->kwn[k]);
    for (size_t i = 0; i < n; i++) {
      value v = attr_path(r, pos, it[i], attr);
      l->v[i] = (v.t == VT_UNDEF && def) ? *def : v;
    }
    return V_list(l, false);
  }
  if (!a->npos) rfail(r, pos, PD_EINVAL, "map requires a filter argument");
  strv name = arg_str(r, pos, &a->pos[0], "map");
  cargs rest = {a->pos + 1, a->npos - 1, a->kwn, a->kwv, a->nkw};
  for (size_t i = 0; i < n; i++) l->v[i] = apply_filter_name(r, pos, name, it[i], &rest);
  return V_list(l, false);
}

/* select / reject / selectattr / rejectattr */
static value select_common(R *r, uint32_t pos, value in, const cargs *a, bool attr, bool want) {
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  charge(r, pos, n);
  size_t k = 0;
  const value *attrv = NULL;
  if (a->nkw) rfail(r, pos, PD_EINVAL, "select filters take no keyword arguments");
  if (attr) {
    if (!a->npos) rfail(r, pos, PD_EINVAL, "missing attribute argument");
    attrv = &a->pos[k++];
  }
  bool has_test = a->npos > k;
  strv tname_ = has_test ? arg_str(r, pos, &a->pos[k], "select") : (strv){0};
  cargs targs = {has_test ? a->pos + k + 1 : NULL, has_test ? a->npos - k - 1 : 0, NULL, NULL, 0};
  lbuild b = {0};
  for (size_t i = 0; i < n; i++) {
    value v = attrv ? attr_path(r, pos, it[i], attrv) : it[i];
    bool ok = has_test ? apply_test_name(r, pos, tname_, &v, &targs) : truthy(&v);
    if (ok == want) lb_push(r, &b, it[i]);
  }
  return lb_value(r, &b, false);
}
static value f_select(R *r, uint32_t pos, value in, const cargs *a) { return select_common(r, pos, in, a, false, true); }
static value f_reject(R *r, uint32_t pos, value in, const cargs *a) { return select_common(r, pos, in, a, false, false); }
static value f_selectattr(R *r, uint32_t pos, value in, const cargs *a) { return select_common(r, pos, in, a, true, true); }
static value f_rejectattr(R *r, uint32_t pos, value in, const cargs *a) { return select_common(r, pos, in, a, true, false); }

static value f_sort(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("sort", "reverse", "case_sensitive", "attribute");
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  return sorted_items(r, pos, it, n, absent(&av[2]) ? NULL : &av[2], !truthy(&av[1]), truthy(&av[0]), false);
}
static value f_dictsort(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("dictsort", "case_sensitive", "by", "reverse");
  if (in.t != VT_DICT) rfail(r, pos, PD_EINVAL, "dictsort(): expected a mapping, got %s", type_name(&in));
  value items = call_method(r, pos, &in, "items", &(cargs){0});
  strv by = ag[1] ? arg_str(r, pos, &av[1], "dictsort") : (strv){"key", 3};
  value idx = V_int(strv_eq(by, "value") ? 1 : 0);
  if (!strv_eq(by, "key") && !strv_eq(by, "value")) rfail(r, pos, PD_EINVAL, "You can only sort by either \"key\" or \"value\"");
  return sorted_items(r, pos, items.u.l->v, items.u.l->n, &idx, !truthy(&av[0]), truthy(&av[2]), false);
}
static value f_unique(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("unique", "case_sensitive", "attribute");
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  lbuild b = {0}, seen = {0};
  for (size_t i = 0; i < n; i++) {
    value key = absent(&av[1]) ? it[i] : attr_path(r, pos, it[i], &av[1]);
    if (!truthy(&av[0])) key = lower_key(r, key);
    charge(r, pos, seen.n + 1);
    bool dup = false;
    for (size_t j = 0; j < seen.n && !dup; j++) dup = v_eq(&seen.v[j], &key);
    if (!dup) {
      lb_push(r, &seen, key);
      lb_push(r, &b, it[i]);
    }
  }
  return lb_value(r, &b, false);
}
static value f_reverse(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "reverse", a);
  if (in.t == VT_STR) {
    value step = V_int(-1);
    return v_slice(r, pos, &in, NULL, NULL, &step);
  }
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  vlist *l = list_new(r, n);
  for (size_t i = 0; i < n; i++) l->v[i] = it[n - 1 - i];
  return V_list(l, false);
}
static value f_sum(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("sum", "attribute", "start");
  value acc = ag[1] ? av[1] : V_int(0);
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  charge(r, pos, n);
  for (size_t i = 0; i < n; i++) {
    value x = absent(&av[0]) ? it[i] : attr_path(r, pos, it[i], &av[0]);
    if (x.t == VT_STR) rfail(r, pos, PD_EINVAL, "sum() can't sum strings");
    acc = binop(r, pos, OP_ADD, &acc, &x);
  }
  return acc;
}
static value minmax(R *r, uint32_t pos, value in, const cargs *a, bool want_max) {
  BIND(want_max ? "max" : "min", "case_sensitive", "attribute");
  size_t n;
  const value *it = v_iter(r, pos, &in, &n);
  charge(r, pos, n);
  if (!n) return V_undef("No aggregated item, sequence was empty.");
  size_t best = 0;
  value bk = V_none();
  for (size_t i = 0; i < n; i++) {
    value k = absent(&av[1]) ? it[i] : attr_path(r, pos, it[i], &av[1]);
    if (!truthy(&av[0])) k = lower_key(r, k);
    if (i == 0) {
      bk = k;
      continue;
    }
    int c = v_cmp(r, pos, &k, &bk);
    if (want_max ? c > 0 : c < 0) {
      best = i;
      bk = k;
    }
  }
  return it[best];
}
static value f_min(R *r, uint32_t pos, value in, const cargs *a) { return minmax(r, pos, in, a, false); }
static value f_max(R *r, uint32_t pos, value in, const cargs *a) { return minmax(r, pos, in, a, true); }
static value f_indent(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("indent", "width", "first", "blank");
  strv ind;
  if (av[0].t == VT_STR) ind = (strv){av[0].u.s.p, av[0].u.s.n};
  else {
    int64_t w = ag[0] ? arg_int(r, pos, &av[0], "indent") : 4;
    if (w < 0) w = 0;
    if (w > 1024) w = 1024;
    char *sp = ralloc(r, (size_t)w + 1);
    memset(sp, ' ', (size_t)w);
    ind = (strv){sp, (size_t)w};
  }
  strv s0 = to_str(r, &in, pos);
  char *buf = ralloc(r, s0.n + 2);
  memcpy(buf, s0.p, s0.n);
  buf[s0.n] = '\n';
  value lines = str_splitlines(r, (strv){buf, s0.n + 1}, false);
  const vlist *L = lines.u.l;
  sink o = {0};
  if (truthy(&av[1])) put(r, &o, ind.p, ind.n);
  for (size_t i = 0; i < L->n; i++) {
    const value *ln = &L->v[i];
    if (i) {
      putc_(r, &o, '\n');
      if (truthy(&av[2]) || ln->u.s.n) put(r, &o, ind.p, ind.n);
    }
    put(r, &o, ln->u.s.p, ln->u.s.n);
  }
  return sink_value(&o);
}
static value f_center(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("center", "width");
  int64_t w = ag[0] ? arg_int(r, pos, &av[0], "center") : 80;
  return V_strv(str_pad(r, arg_str(r, pos, &in, "center"), w, (strv){" ", 1}, 0));
}
static value f_attr(R *r, uint32_t pos, value in, const cargs *a) {
  BIND("attr", "name");
  strv n = arg_str(r, pos, &av[0], "attr");
  return v_getattr(r, pos, &in, rdup(r, n.p, n.n).p);
}
static value f_wordcount(R *r, uint32_t pos, value in, const cargs *a) {
  no_args(r, pos, "wordcount", a);
  strv s = to_str(r, &in, pos);
  int64_t c = 0;
  bool inw = false;
  for (size_t i = 0; i < s.n;) {
    uint32_t cp;
    i += u8dec(s.p + i, s.n - i, &cp);
    bool w = cp_isalpha(cp) || cp_isdigit(cp) || cp == '_';
    if (w && !inw) c++;
    inw = w;
  }
  return V_int(c);
}

static const struct {
  const char *name;
  filter_fn fn;
} FILTERS[] = {
    {"abs", f_abs}, {"attr", f_attr}, {"capitalize", f_capitalize}, {"center", f_center}, {"count", f_length},
    {"d", f_default}, {"default", f_default}, {"dictsort", f_dictsort}, {"e", f_escape}, {"escape", f_escape},
    {"first", f_first}, {"float", f_float}, {"forceescape", f_escape}, {"indent", f_indent}, {"int", f_int},
    {"items", f_items}, {"join", f_join}, {"last", f_last}, {"length", f_length}, {"list", f_list},
    {"lower", f_lower}, {"map", f_map}, {"max", f_max}, {"min", f_min}, {"reject", f_reject},
    {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse}, {"round", f_round},
    {"safe", f_safe}, {"select", f_select}, {"selectattr", f_selectattr}, {"sort", f_sort},
    {"string", f_string}, {"sum", f_sum}, {"title", f_title}, {"tojson", f_tojson}, {"trim", f_trim},
    {"unique", f_unique}, {"upper", f_upper}, {"wordcount", f_wordcount},
};
#define N_FILTERS (sizeof FILTERS / sizeof FILTERS[0])

static int filter_lookup(const char *name) {
  for (size_t i = 0; i < N_FILTERS; i++)
    if (!strcmp(FILTERS[i].name, name)) return (int)i;
  return -1;
}
static value apply_filter_name(R *r, uint32_t pos, strv name, value in, const cargs *a) {
  for (size_t i = 0; i < N_FILTERS; i++)
    if (strv_eq(name, FILTERS[i].name)) return FILTERS[i].fn(r, pos, in, a);
  rfail(r, pos, PD_EUNSUPPORTED, "filter '%.*s' is not supported", (int)(name.n > 64 ? 64 : name.n), name.p);
}

/* ---- tests (jinja2.tests) ---- */
static void test_nargs(R *r, uint32_t pos, const char *name, const cargs *a, size_t n) {
  if (a->npos != n || a->nkw) rfail(r, pos, PD_EINVAL, "test '%s' takes %zu argument(s)", name, n);
}
#define SIMPLE_TEST(nm, expr_)                                              \
  static bool t_##nm(R *r, uint32_t pos, const value *v, const cargs *a) { \
    test_nargs(r, pos, #nm, a, 0);                                          \
    return (expr_);                                                         \
  }
SIMPLE_TEST(defined, v->t != VT_UNDEF)
SIMPLE_TEST(undefined, v->t == VT_UNDEF)
SIMPLE_TEST(none, v->t == VT_NONE)
SIMPLE_TEST(boolean, v->t == VT_BOOL)
SIMPLE_TEST(true, v->t == VT_BOOL && v->u.b)
SIMPLE_TEST(false, v->t == VT_BOOL && !v->u.b)
SIMPLE_TEST(integer, v->t == VT_INT)
SIMPLE_TEST(float, v->t == VT_FLOAT)
SIMPLE_TEST(number, is_num(v))
SIMPLE_TEST(string, v->t == VT_STR)
SIMPLE_TEST(mapping, v->t == VT_DICT)
SIMPLE_TEST(iterable, v->t == VT_STR || v->t == VT_LIST || v->t == VT_DICT || v->t == VT_UNDEF || v->t == VT_LOOP)
SIMPLE_TEST(sequence, v->t == VT_STR || v->t == VT_LIST || v->t == VT_DICT || v->t == VT_UNDEF)
SIMPLE_TEST(callable, v->t == VT_FUNC || v->t == VT_LOOP)
SIMPLE_TEST(escaped, false)
SIMPLE_TEST(lower, str_pred(to_str(r, v, pos), 4))
SIMPLE_TEST(upper, str_pred(to_str(r, v, pos), 5))

static int64_t test_int(R *r, uint32_t pos, const value *v) {
  if (v->t != VT_INT && v->t != VT_BOOL) rfail(r, pos, PD_EINVAL, "test expects an integer, got %s", type_name(v));
  return num_i(v);
}
static bool t_odd(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "odd", a, 0);
  return (test_int(r, pos, v) & 1) != 0;
}
static bool t_even(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "even", a, 0);
  return (test_int(r, pos, v) & 1) == 0;
}
static bool t_divisibleby(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "divisibleby", a, 1);
  value m = binop(r, pos, OP_MOD, v, &a->pos[0]);
  return !truthy(&m);
}
static bool t_sameas(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "sameas", a, 1);
  const value *o = &a->pos[0];
  if (v->t != o->t) return false;
  switch (v->t) {
  case VT_LIST: return v->u.l == o->u.l;
  case VT_DICT:
  case VT_NS: return v->u.d == o->u.d;
  case VT_STR: return v->u.s.p == o->u.s.p && v->u.s.n == o->u.s.n;
  default: return v_eq(v, o);
  }
}
static bool t_in(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "in", a, 1);
  return v_contains(r, pos, &a->pos[0], v);
}
#define CMP_TEST(nm, op)                                                    \
  static bool t_##nm(R *r, uint32_t pos, const value *v, const cargs *a) { \
    test_nargs(r, pos, #nm, a, 1);                                          \
    return compare_op(r, pos, op, v, &a->pos[0]);                           \
  }
CMP_TEST(eq, OP_EQ)
CMP_TEST(ne, OP_NE)
CMP_TEST(lt, OP_LT)
CMP_TEST(le, OP_LE)
CMP_TEST(gt, OP_GT)
CMP_TEST(ge, OP_GE)
static int test_lookup(const char *name);
static bool t_filter(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "filter", a, 0);
  return v->t == VT_STR && filter_lookup(rdup(r, v->u.s.p, v->u.s.n).p) >= 0;
}
static bool t_test(R *r, uint32_t pos, const value *v, const cargs *a) {
  test_nargs(r, pos, "test", a, 0);
  return v->t == VT_STR && test_lookup(rdup(r, v->u.s.p, v->u.s.n).p) >= 0;
}

static const struct {
  const char *name;
  test_fn fn;
} TESTS[] = {
    {"!=", t_ne}, {"<", t_lt}, {"<=", t_le}, {"==", t_eq}, {">", t_gt}, {">=", t_ge},
    {"boolean", t_boolean}, {"callable", t_callable}, {"defined", t_defined}, {"divisibleby", t_divisibleby},
    {"eq", t_eq}, {"equalto", t_eq}, {"escaped", t_escaped}, {"even", t_even}, {"false", t_false},
    {"filter", t_filter}, {"float", t_float}, {"ge", t_ge}, {"greaterthan", t_gt}, {"gt", t_gt}, {"in", t_in},
    {"integer", t_integer}, {"iterable", t_iterable}, {"le", t_le}, {"lessthan", t_lt}, {"lower", t_lower},
    {"lt", t_lt}, {"mapping", t_mapping}, {"ne", t_ne}, {"none", t_none}, {"number", t_number}, {"odd", t_odd},
    {"sameas", t_sameas}, {"sequence", t_sequence}, {"string", t_string}, {"test", t_test}, {"true", t_true},
    {"undefined", t_undefined}, {"upper", t_upper},
};
#define N_TESTS (sizeof TESTS / sizeof TESTS[0])

static int test_lookup(const char *name) {
  for (size_t i = 0; i < N_TESTS; i++)
    if (!strcmp(TESTS[i].name, name)) return (int)i;
  return -1;
}
static bool apply_test_name(R *r, uint32_t pos, strv name, const value *v, const cargs *a) {
  for (size_t i = 0; i < N_TESTS; i++)
    if (strv_eq(name, TESTS[i].name)) return TESTS[i].fn(r, pos, v, a);
  rfail(r, pos, PD_EUNSUPPORTED, "test '%.*s' is not supported", (int)(name.n > 64 ? 64 : name.n), name.p);
}

/* ---- global functions ------------------------------------------------------------------------------ */
enum { BI_RANGE, BI_DICT, BI_NAMESPACE, BI_RAISE, BI_STRFTIME };
static const char *const BUILTIN_NAMES[] = {"range", "dict", "namespace", "raise_exception", "strftime_now"};

static value call_builtin(R *r, uint32_t pos, int id, const cargs *a) {
  switch (id) {
  case BI_RANGE: {
    if (a->nkw || a->npos < 1 || a->npos > 3) rfail(r, pos, PD_EINVAL, "range expected 1 to 3 integer arguments");
    int64_t start = 0, stop, step = 1;
    if (a->npos == 1) stop = arg_int(r, pos, &a->pos[0], "range");
    else {
      start = arg_int(r, pos, &a->pos[0], "range");
      stop = arg_int(r, pos, &a->pos[1], "range");
      if (a->npos == 3) step = arg_int(r, pos, &a->pos[2], "range");
    }
    if (step == 0) rfail(r, pos, PD_EINVAL, "range() arg 3 must not be zero");
    double cnt = 0;
    if (step > 0 && start < stop) cnt = floor(((double)stop - (double)start - 1) / (double)step) + 1;
    if (step < 0 && stop < start) cnt = floor(((double)start - (double)stop - 1) / (double)-step) + 1;
    if (cnt > CT_RANGE_MAX)
      rfail(r, pos, PD_EINVAL, "range too big: the sandbox allows at most %d items", CT_RANGE_MAX);
    size_t n = (size_t)cnt;
    charge(r, pos, n / 16);
    vlist *l = list_new(r, n);
    for (size_t i = 0; i < n; i++) l->v[i] = V_int(start + (int64_t)i * step);
    return V_list(l, false);
  }
  case BI_DICT:
  case BI_NAMESPACE: {
    vdict *d = dict_new(r);
    if (a->npos > 1) rfail(r, pos, PD_EINVAL, "%s expected at most 1 positional argument", BUILTIN_NAMES[id]);
    if (a->npos == 1) {
      const value *src = &a->pos[0];
      if (src->t == VT_DICT || src->t == VT_NS) {
        for (size_t i = 0; i < src->u.d->n; i++) dict_set(r, d, src->u.d->k[i], src->u.d->v[i]);
      } else {
        size_t n;
        const value *it = v_iter(r, pos, src, &n);
        for (size_t i = 0; i < n; i++) {
          if (it[i].t != VT_LIST || it[i].u.l->n != 2)
            rfail(r, pos, PD_EINVAL, "%s(): sequence elements must be pairs", BUILTIN_NAMES[id]);
          check_hashable(r, pos, &it[i].u.l->v[0]);
          dict_set(r, d, it[i].u.l->v[0], it[i].u.l->v[1]);
        }
      }
    }
    for (size_t i = 0; i < a->nkw; i++) dict_set(r, d, V_cstr(a->kwn[i]), a->kwv[i]);
    return V_dict(d, id == BI_DICT ? VT_DICT : VT_NS);
  }
  case BI_RAISE: {
    BIND("raise_exception", "message");
    strv m = to_str(r, &av[0], pos);
    rfail(r, pos, PD_EINVAL, "%.*s", (int)(m.n > 400 ? 400 : m.n), m.p);
  }
  case BI_STRFTIME: {
    BIND("strftime_now", "format");
    strv f = arg_str(r, pos, &av[0], "strftime_now");
    if (!f.n) return V_str("", 0);
    strv fz = rdup(r, f.p, f.n);
    time_t now = time(NULL);
    struct tm tm;
    if (!localtime_r(&now, &tm)) rfail(r, pos, PD_EINVAL, "strftime_now: localtime failed");
    size_t cap = 256 + 8 * f.n;
    char *buf = ralloc(r, cap);
    size_t n = strftime(buf, cap, fz.p, &tm);
    if (n == 0) rfail(r, pos, PD_EINVAL, "strftime_now: format produced no output or was too long");
    return V_str(buf, n);
  }
  default: rfail(r, pos, PD_EUNSUPPORTED, "unknown builtin");
  }
}

static value eval(R *r, scope *s, const expr *x);
static int exec_list(R *r, scope *s, const slist *l, sink *o);

static value call_macro(R *r, uint32_t pos, const stmt *m, const cargs *a) {
  if (a->npos > m->nparams)
    rfail(r, pos, PD_EINVAL, "macro '%s' takes not more than %zu argument(s)", m->name, m->nparams);
  deeper(r, pos);
  scope scv, *sc = &scv;
  scope_init(sc, r->root);
  bool *given = ralloc(r, m->nparams + 1);
  memset(given, 0, m->nparams + 1);
  value *vals = ralloc(r, (m->nparams + 1) * sizeof *vals);
  for (size_t i = 0; i < a->npos; i++) {
    vals[i] = a->pos[i];
    given[i] = true;
  }
  for (size_t k = 0; k < a->nkw; k++) {
    size_t j;
    for (j = 0; j < m->nparams; j++)
      if (!strcmp(m->params[j], a->kwn[k])) break;
    if (j == m->nparams) rfail(r, pos, PD_EINVAL, "macro '%s' takes no keyword argument '%s'", m->name, a->kwn[k]);
    if (given[j]) rfail(r, pos, PD_EINVAL, "macro '%s' got multiple values for argument '%s'", m->name, a->kwn[k]);
    vals[j] = a->kwv[k];
    given[j] = true;
  }
  for (size_t i = 0; i < m->nparams; i++) { /* defaults are evaluated in the macro's scope, in order */
    if (!given[i]) vals[i] = m->defaults[i] ? eval(r, sc, m->defaults[i]) : V_undef(m->params[i]);
    scope_set(r, sc, m->params[i], vals[i]);
  }
  sink cap = {0};
  exec_list(r, sc, &m->body, &cap);
  r->depth--;
  return sink_value(&cap);
}

static value call_value(R *r, uint32_t pos, const value *f, const cargs *a, const expr *callee) {
  if (f->t == VT_FUNC) {
    switch (f->u.fn->kind) {
    case FN_BUILTIN: return call_builtin(r, pos, f->u.fn->id, a);
    case FN_MACRO: return call_macro(r, pos, f->u.fn->macro, a);
    default: return call_method(r, pos, &f->u.fn->self, f->u.fn->name, a);
    }
  }
  if (f->t == VT_UNDEF) {
    if (callee->kind == EX_NAME) rfail(r, pos, PD_EUNSUPPORTED, "unknown function '%s'", callee->name);
    fail_undefined(r, pos, f);
  }
  rfail(r, pos, PD_EINVAL, "'%s' object is not callable", type_name(f));
}

/* Evaluates x's call arguments into arena arrays. */
static cargs eval_args(R *r, scope *s, const expr *x) {
  cargs a = {0};
  if (x->nargs) {
    value *pv = ralloc(r, x->nargs * sizeof *pv);
    for (size_t i = 0; i < x->nargs; i++) pv[i] = eval(r, s, x->args[i]);
    a.pos = pv;
    a.npos = x->nargs;
  }
  if (x->nkw) {
    value *kv = ralloc(r, x->nkw * sizeof *kv);
    for (size_t i = 0; i < x->nkw; i++) kv[i] = eval(r, s, x->kwv[i]);
    a.kwn = x->kwn;
    a.kwv = kv;
    a.nkw = x->nkw;
  }
  return a;
}

/* ---- expression evaluation ------------------------------------------------------------------------- */
/* Applies a filter chain; the innermost input is x->a, or block_in for "{% set x | f %}" blocks. */
static value eval_filter(R *r, scope *s, const expr *x, const value *block_in) {
  deeper(r, x->pos);
  value in;
  if (!x->a) {
    PD_ASSERT(block_in != NULL);
    in = *block_in;
  }
  else if (x->a->kind == EX_FILTER) in = eval_filter(r, s, x->a, block_in);
  else in = eval(r, s, x->a);
  cargs a = eval_args(r, s, x);
  if (x->fid < 0) rfail(r, x->pos, PD_EUNSUPPORTED, "filter '%s' is not supported", x->name);
  value out = FILTERS[x->fid].fn(r, x->pos, in, &a);
  r->depth--;
  return out;
}

static value eval(R *r, scope *s, const expr *x) {
  deeper(r, x->pos);
  value out;
  switch (x->kind) {
  case EX_CONST: out = x->cv; break;
  case EX_NAME: {
    value *v = scope_find(s, x->name);
    out = v ? *v : V_undef(x->name);
    break;
  }
  case EX_LIST:
  case EX_TUPLE: {
    vlist *l = list_new(r, x->nargs);
    for (size_t i = 0; i < x->nargs; i++) l->v[i] = eval(r, s, x->args[i]);
    out = V_list(l, x->kind == EX_TUPLE);
    break;
  }
  case EX_DICT: {
    vdict *d = dict_new(r);
    for (size_t i = 0; i + 1 < x->nargs; i += 2) {
      value k = eval(r, s, x->args[i]);
      check_hashable(r, x->args[i]->pos, &k);
      dict_set(r, d, k, eval(r, s, x->args[i + 1]));
    }
    out = V_dict(d, VT_DICT);
    break;
  }
  case EX_ATTR: {
    value o = eval(r, s, x->a);
    out = v_getattr(r, x->pos, &o, x->name);
    break;
  }
  case EX_ITEM: {
    value o = eval(r, s, x->a);
    value k = eval(r, s, x->b);
    out = v_getitem(r, x->pos, &o, &k);
    break;
  }
  case EX_SLICE: {
    value o = eval(r, s, x->a);
    value p[3];
    for (int i = 0; i < 3; i++) p[i] = x->args[i] ? eval(r, s, x->args[i]) : V_none();
    out = v_slice(r, x->pos, &o, &p[0], &p[1], &p[2]);
    break;
  }
  case EX_CALL: {
    value f = eval(r, s, x->a);
    cargs a = eval_args(r, s, x);
    out = call_value(r, x->pos, &f, &a, x->a);
    break;
  }
  case EX_FILTER: out = eval_filter(r, s, x, NULL); break;
  case EX_TEST: {
    value v = eval(r, s, x->a);
    cargs a = eval_args(r, s, x);
    if (x->fid < 0) rfail(r, x->pos, PD_EUNSUPPORTED, "test '%s' is not supported", x->name);
    bool b = TESTS[x->fid].fn(r, x->pos, &v, &a);
    out = V_bool(x->neg ? !b : b);
    break;
  }
  case EX_NEG:
  case EX_POS: {
    value v = eval(r, s, x->a);
    if (v.t == VT_UNDEF) fail_undefined(r, x->pos, &v);
    if (v.t == VT_FLOAT) out = V_float(x->kind == EX_NEG ? -v.u.f : v.u.f);
    else if (v.t == VT_INT || v.t == VT_BOOL) {
      int64_t i = num_i(&v);
      if (x->kind == EX_NEG && i == INT64_MIN) rfail(r, x->pos, PD_EUNSUPPORTED, "integer overflow");
      out = V_int(x->kind == EX_NEG ? -i : i);
    } else {
      rfail(r, x->pos, PD_EINVAL, "bad operand type for unary %s: '%s'", x->kind == EX_NEG ? "-" : "+", type_name(&v));
    }
    break;
  }
  case EX_NOT: {
    value v = eval(r, s, x->a);
    out = V_bool(!truthy(&v));
    break;
  }
  case EX_BIN: {
    value a = eval(r, s, x->a);
    value b = eval(r, s, x->b);
    out = binop(r, x->pos, x->op, &a, &b);
    break;
  }
  case EX_AND:
  case EX_OR: {
    value a = eval(r, s, x->a);
    bool t = truthy(&a);
    out = (x->kind == EX_AND ? !t : t) ? a : eval(r, s, x->b);
    break;
  }
  case EX_CMP: {
    value left = eval(r, s, x->a);
    out = V_bool(true);
    for (size_t i = 0; i < x->nargs; i++) {
      value right = eval(r, s, x->args[i]);
      if (!compare_op(r, x->args[i]->pos, x->ops[i], &left, &right)) {
        out = V_bool(false);
        break;
      }
      left = right;
    }
    break;
  }
  case EX_CONCAT: {
    sink o = {0};
    for (size_t i = 0; i < x->nargs; i++) {
      value v = eval(r, s, x->args[i]);
      put_str(r, &o, &v, x->pos);
    }
    out = sink_value(&o);
    break;
  }
  case EX_COND: {
    value c = eval(r, s, x->a);
    out = truthy(&c) ? eval(r, s, x->b) : x->c ? eval(r, s, x->c) : V_undef("conditional expression");
    break;
  }
  default: rfail(r, x->pos, PD_EUNSUPPORTED, "unknown expression");
  }
  r->depth--;
  return out;
}

/* ---- statements ---------------------------------------------------------------------------------------- */
enum { XF_NORMAL, XF_BREAK, XF_CONTINUE };

static void assign(R *r, scope *s, const expr *target, value v) {
  if (target->kind == EX_NAME) {
    scope_set(r, s, target->name, v);
    return;
  }
  if (target->kind == EX_TUPLE) {
    size_t n;
    const value *it = v_iter(r, target->pos, &v, &n);
    if (v.t == VT_UNDEF) fail_undefined(r, target->pos, &v);
    if (n != target->nargs) {
      if (n > target->nargs) rfail(r, target->pos, PD_EINVAL, "too many values to unpack (expected %zu)", target->nargs);
      rfail(r, target->pos, PD_EINVAL, "not enough values to unpack (expected %zu, got %zu)", target->nargs, n);
    }
    for (size_t i = 0; i < n; i++) scope_set(r, s, target->args[i]->name, it[i]);
    return;
  }
  /* ns.attr = v */
  value *ns = scope_find(s, target->a->name);
  if (!ns || ns->t != VT_NS) rfail(r, target->pos, PD_EINVAL, "cannot assign attribute on non-namespace object");
  dict_set(r, ns->u.d, V_cstr(target->name), v);
}

static int exec_for(R *r, scope *s, const stmt *st, sink *o) {
  value seq = eval(r, s, st->e);
  size_t n;
  const value *items = v_iter(r, st->pos, &seq, &n);
  scope its, *it_s = &its;
  scope_init(it_s, s);
  if (st->cond) { /* "for x in xs if cond": filter first, so loop.* counts the kept items */
    lbuild kept = {0};
    for (size_t i = 0; i < n; i++) {
      charge(r, st->pos, 1);
      it_s->n = 0;
      assign(r, it_s, st->target, items[i]);
      value c = eval(r, it_s, st->cond);
      if (truthy(&c)) lb_push(r, &kept, items[i]);
    }
    items = kept.v;
    n = kept.n;
  }
  if (!n) {
    it_s->n = 0;
    return exec_list(r, it_s, &st->orelse, o); /* the else block belongs to the enclosing loop */
  }
  vloop *lp = ralloc(r, sizeof *lp);
  lp->items = items;
  lp->n = n;
  value lv = V_none();
  lv.t = VT_LOOP;
  lv.u.lp = lp;
  for (size_t i = 0; i < n; i++) {
    charge(r, st->pos, 1);
    lp->i = i;
    it_s->n = 0; /* a fresh scope per iteration, as jinja2 resets loop-local names */
    scope_set(r, it_s, "loop", lv);
    assign(r, it_s, st->target, items[i]);
    if (exec_list(r, it_s, &st->body, o) == XF_BREAK) break;
  }
  return XF_NORMAL;
}

static int exec_stmt(R *r, scope *s, const stmt *st, sink *o) {
  charge(r, st->pos, 1);
  switch (st->kind) {
  case ST_DATA: put(r, o, st->text, st->len); return XF_NORMAL;
  case ST_OUT: {
    value v = eval(r, s, st->e);
    put_str(r, o, &v, st->pos);
    return XF_NORMAL;
  }
  case ST_IF: {
    value c = eval(r, s, st->e);
    return exec_list(r, s, truthy(&c) ? &st->body : &st->orelse, o);
  }
  case ST_FOR: return exec_for(r, s, st, o);
  case ST_SET: assign(r, s, st->target, eval(r, s, st->e)); return XF_NORMAL;
  case ST_SETBLOCK: {
    sink cap = {0};
    int f = exec_list(r, s, &st->body, &cap);
    value v = sink_value(&cap);
    if (st->filter) v = eval_filter(r, s, st->filter, &v);
    assign(r, s, st->target, v);
    return f;
  }
  case ST_MACRO: {
    vfunc *fn = ralloc(r, sizeof *fn);
    memset(fn, 0, sizeof *fn);
    fn->kind = FN_MACRO;
    fn->name = st->name;
    fn->macro = st;
    value v = V_none();
    v.t = VT_FUNC;
    v.u.fn = fn;
    scope_set(r, s, st->name, v);
    return XF_NORMAL;
  }
  case ST_BREAK: return XF_BREAK;
  case ST_CONTINUE: return XF_CONTINUE;
  case ST_BLOCK: return exec_list(r, s, &st->body, o);
  default: rfail(r, st->pos, PD_EUNSUPPORTED, "unknown statement");
  }
}

static int exec_list(R *r, scope *s, const slist *l, sink *o) {
  if (!l->n) return XF_NORMAL;
  deeper(r, l->v[0]->pos);
  int f = XF_NORMAL;
  for (size_t i = 0; i < l->n && f == XF_NORMAL; i++) f = exec_stmt(r, s, l->v[i], o);
  r->depth--;
  return f;
}

/* ---- public API ------------------------------------------------------------------------------------------ */
pd_chat_template *pd_chat_template_parse(const char *src, size_t len, pd_err *e) {
  if (!src && len) {
    pd_err_set(e, PD_EINVAL, "chat template: NULL source");
    return NULL;
  }
  if (len >= (size_t)UINT32_MAX - 1) {
    pd_err_set(e, PD_EINVAL, "chat template: source too large (%zu bytes)", len);
    return NULL;
  }
  pd_chat_template *t = calloc(1, sizeof *t);
  P *p = calloc(1, sizeof *p);
  if (!t || !p) {
    free(t);
    free(p);
    pd_err_set(e, PD_ENOMEM, "chat template: out of memory");
    return NULL;
  }
  t->a.limit = SIZE_MAX;
  p->tmp.limit = SIZE_MAX;
  p->a = &t->a;
  if (setjmp(p->j.jb)) {
    pd_err_set(e, p->j.code, "%s", p->j.msg);
    arena_free(&p->tmp);
    arena_free(&t->a);
    free(p);
    free(t);
    return NULL;
  }
  /* jinja2 splits on \r\n, \r, \n, joins with \n and drops one trailing newline
   * (keep_trailing_newline=False) */
  char *ns = pnew(p, len + 1);
  size_t n = 0;
  for (size_t i = 0; i < len; i++) {
    if (src[i] == '\r') {
      ns[n++] = '\n';
      if (i + 1 < len && src[i + 1] == '\n') i++;
    } else {
      ns[n++] = src[i];
    }
  }
  if (n && ns[n - 1] == '\n') n--;
  ns[n] = 0;
  t->src = ns;
  t->n = n;
  p->j.src = ns;
  p->j.srcn = n;
  lex(p, ns, n);
  p->i = 0;
  t->body = parse_body(p, NULL);
  arena_free(&p->tmp);
  free(p);
  return t;
}

void pd_chat_template_free(pd_chat_template *t) {
  if (!t) return;
  arena_free(&t->a);
  free(t);
}

static void set_global_fn(R *r, int id) {
  vfunc *f = ralloc(r, sizeof *f);
  memset(f, 0, sizeof *f);
  f->kind = FN_BUILTIN;
  f->id = id;
  f->name = BUILTIN_NAMES[id];
  value v = V_none();
  v.t = VT_FUNC;
  v.u.fn = f;
  scope_set(r, &r->globals, BUILTIN_NAMES[id], v);
}

pd_status pd_chat_template_render(const pd_chat_template *t, const pd_chat_vars *v, char **out, pd_err *e) {
  if (!out) return pd_err_set(e, PD_EINVAL, "chat template: NULL output pointer");
  *out = NULL;
  if (!t || !v) return pd_err_set(e, PD_EINVAL, "chat template: NULL template or variables");
  if (v->n_messages && !v->messages) return pd_err_set(e, PD_EINVAL, "chat template: NULL messages");
  size_t in_bytes = 0;
  for (size_t i = 0; i < v->n_messages; i++) {
    if (!v->messages[i].role || !v->messages[i].content)
      return pd_err_set(e, PD_EINVAL, "chat template: message %zu has no role or content", i);
    in_bytes += strlen(v->messages[i].role) + strlen(v->messages[i].content) + 64;
  }
  if (in_bytes > SIZE_MAX / 32) return pd_err_set(e, PD_EINVAL, "chat template: input too large");
  R *r = calloc(1, sizeof *r);
  if (!r) return pd_err_set(e, PD_ENOMEM, "chat template: out of memory");
  r->t = t;
  r->j.src = t->src;
  r->j.srcn = t->n;
  r->a.limit = CT_MEM_BASE + 16 * in_bytes;
  r->out_limit = CT_OUT_BASE + 4 * in_bytes;
  r->out.heap = true;
  scope_init(&r->globals, NULL);
  if (setjmp(r->j.jb)) {
    pd_status code = r->j.code;
    pd_err_set(e, code, "%s", r->j.msg);
    free(r->out.p);
    arena_free(&r->a);
    free(r);
    return code;
  }
  /* globals: what transformers passes to render(), plus the environment's functions */
  vlist *msgs = list_new(r, v->n_messages);
  for (size_t i = 0; i < v->n_messages; i++) {
    vdict *d = dict_new(r);
    dict_set(r, d, V_cstr("role"), V_cstr(v->messages[i].role));
    dict_set(r, d, V_cstr("content"), V_cstr(v->messages[i].content));
    msgs->v[i] = V_dict(d, VT_DICT);
  }
  scope_set(r, &r->globals, "messages", V_list(msgs, false));
  scope_set(r, &r->globals, "add_generation_prompt", V_bool(v->add_generation_prompt));
  if (v->bos_token) scope_set(r, &r->globals, "bos_token", V_cstr(v->bos_token));
  if (v->eos_token) scope_set(r, &r->globals, "eos_token", V_cstr(v->eos_token));
  scope_set(r, &r->globals, "tools", V_none());
  scope_set(r, &r->globals, "documents", V_none());
  for (int id = BI_RANGE; id <= BI_STRFTIME; id++) set_global_fn(r, id);
  r->root = ralloc(r, sizeof *r->root);
  scope_init(r->root, &r->globals);

  exec_list(r, r->root, &t->body, &r->out);
  sink_reserve(r, &r->out, 1);
  r->out.p[r->out.n] = 0;
  *out = r->out.p;
  arena_free(&r->a);
  free(r);
  return PD_OK;
}

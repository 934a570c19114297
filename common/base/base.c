/* Status messages, failure reports and dtype helpers shared by all libraries. */
#include <execinfo.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd/dtype.h"
#include "pd/status.h"

pd_status pd_err_set(pd_err *e, pd_status code, const char *fmt, ...) {
  if (e) {
    va_list ap;
    va_start(ap, fmt);
    e->code = code;
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

void pd_err_prefix(pd_err *e, const char *fmt, ...) {
  if (!e) return;
  char pre[PD_ERR_MSG_MAX], old[PD_ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pre, sizeof pre, fmt, ap);
  va_end(ap);
  memcpy(old, e->msg, sizeof old);
  /* keep as much of both as fits */
  size_t n = strlen(pre);
  if (n > sizeof e->msg - 3) n = sizeof e->msg - 3;
  memcpy(e->msg, pre, n);
  memcpy(e->msg + n, ": ", 2);
  size_t rest = sizeof e->msg - n - 3, m = strlen(old);
  if (m > rest) m = rest;
  memcpy(e->msg + n + 2, old, m);
  e->msg[n + 2 + m] = 0;
}

void pd_err_clear(pd_err *e) {
  if (e) {
    e->code = PD_OK;
    e->msg[0] = 0;
  }
}

void pd_backtrace(int fd) {
  void *frames[64];
  int n = backtrace(frames, 64);
  /* Return addresses point after their calls, which for a call to a noreturn function at the
   * end of a function is already the next function: step back into the call instruction. */
  for (int i = 1; i < n; i++) frames[i] = (char *)frames[i] - 1;
  backtrace_symbols_fd(frames, n, fd); /* no malloc: safe in a signal handler */
}

void pd_assert_fail(const char *cond, const char *file, int line) {
  fprintf(stderr, "%s:%d: assertion failed: %s\nbacktrace:\n", file, line, cond);
  fflush(stderr);
  pd_backtrace(2);
  signal(SIGABRT, SIG_DFL); /* the backtrace is printed: no second one from the handler */
  abort();
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define PD_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define PD_SANITIZED 1
#endif
#endif

#ifndef PD_SANITIZED
static const char *g_prog = "pdserve";

static void on_fatal(int sig) {
  /* async-signal-safe only: write(2) and backtrace_symbols_fd */
  char msg[128];
  int n = snprintf(msg, sizeof msg, "%s: fatal signal %d (%s); backtrace:\n", g_prog, sig,
                   sig == SIGSEGV ? "segmentation fault" : sig == SIGABRT ? "abort" :
                   sig == SIGBUS ? "bus error" : sig == SIGFPE ? "arithmetic" : "illegal");
  if (n > 0 && write(2, msg, (size_t)n) < 0) {
  }
  pd_backtrace(2);
  signal(sig, SIG_DFL); /* die of it as before (core dump, the parent's wait status) */
  raise(sig);
}
#endif

void pd_crash_handlers_install(const char *prog) {
#ifndef PD_SANITIZED
  if (prog) g_prog = prog;
  void *frames[1];
  backtrace(frames, 1); /* loads libgcc's unwinder now, not inside a signal handler */
  static const int sigs[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fatal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND | SA_NODEFER;
    sigaction(sigs[i], &sa, NULL);
  }
#else
  (void)prog;
#endif
}

const char *pd_status_str(pd_status s) {
  static const char *names[PD_ESTATUS_COUNT] = {
      "ok", "invalid argument", "out of memory", "I/O error", "bad format",
      "unsupported", "not found", "full", "out of range", "backend error"};
  return (s >= 0 && s < PD_ESTATUS_COUNT) ? names[s] : "unknown status";
}

static const struct {
  const char *name;
  size_t size;
} dtype_info[PD_DTYPE_COUNT] = {
    [PD_DTYPE_F32] = {"F32", 4},     [PD_DTYPE_F16] = {"F16", 2},
    [PD_DTYPE_BF16] = {"BF16", 2},   [PD_DTYPE_F64] = {"F64", 8},
    [PD_DTYPE_I8] = {"I8", 1},       [PD_DTYPE_U8] = {"U8", 1},
    [PD_DTYPE_I16] = {"I16", 2},     [PD_DTYPE_I32] = {"I32", 4},
    [PD_DTYPE_I64] = {"I64", 8},     [PD_DTYPE_BOOL] = {"BOOL", 1},
    [PD_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [PD_DTYPE_F8_E5M2] = {"F8_E5M2", 1},
    [PD_DTYPE_Q4] = {"Q4", 0},       [PD_DTYPE_F8W] = {"F8W", 1},
    [PD_DTYPE_F8WA] = {"F8WA", 1},   [PD_DTYPE_F8WS] = {"F8WS", 1},
};

size_t pd_dtype_size(pd_dtype t) { return (t >= 0 && t < PD_DTYPE_COUNT) ? dtype_info[t].size : 0; }
const char *pd_dtype_name(pd_dtype t) {
  return (t >= 0 && t < PD_DTYPE_COUNT) ? dtype_info[t].name : "?";
}
size_t pd_dtype_row_bytes(pd_dtype t, int64_t cols) {
  if (t == PD_DTYPE_Q4) return (size_t)cols / 2 + (size_t)cols / 8;
  if (t == PD_DTYPE_F8W || t == PD_DTYPE_F8WA) return (size_t)cols + 4;
  if (t == PD_DTYPE_F8WS) return (size_t)cols + 8;
  return (size_t)cols * pd_dtype_size(t);
}

int pd_dtype_from_name(const char *s) {
  for (int i = 0; i < PD_DTYPE_COUNT; i++)
    if (i != PD_DTYPE_Q4 && i != PD_DTYPE_F8W && i != PD_DTYPE_F8WA && i != PD_DTYPE_F8WS &&
        strcmp(s, dtype_info[i].name) == 0)
      return i;
  return -1;
}

float pd_e4m3_to_f32(uint8_t b) {
  if ((b & 0x7f) == 0x7f) return NAN;
  /* the 7 bits placed at the top of an f32's exponent and mantissa, scaled by 2^120: normal and
   * subnormal values alike (2^-9 steps below 2^-6) */
  uint32_t u = (uint32_t)(b & 0x7f) << 20;
  float f;
  memcpy(&f, &u, 4);
  f *= 0x1p120f;
  return (b & 0x80) ? -f : f;
}

uint8_t pd_f32_to_e4m3(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;              /* NaN */
  if (a >= 0x43e00000u) return sign | 0x7e;      /* >= 448: saturated */
  if (a < 0x3c800000u) {                         /* below 2^-6: multiples of 2^-9 */
    float v;
    memcpy(&v, &a, 4);
    v = (v * 512.0f + 0x1p23f) - 0x1p23f;        /* exact scaling, then nearest even */
    return sign | (uint8_t)v;                    /* (8 is 2^-6, the smallest normal) */
  }
  /* normal: keep 3 fraction bits, nearest even at bit 20, and rebias 127 -> 7 */
  uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  r -= 120u << 3;
  return sign | (uint8_t)(r > 0x7e ? 0x7e : r);
}

float pd_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        exp--;
      }
      u = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

uint16_t pd_f32_to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t man = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000;
    uint32_t shift = (uint32_t)(14 - exp);
    uint32_t half = 1u << (shift - 1);
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    if (rem > half || (rem == half && (r & 1))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = (uint32_t)(exp << 10) | (man >> 13);
  uint32_t rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
  return (uint16_t)(sign | r);
}

void pd_convert_to_f32(float *dst, const void *src, pd_dtype t, size_t n) {
  if (t == PD_DTYPE_F32) {
    memcpy(dst, src, n * 4);
  } else if (t == PD_DTYPE_BF16) {
    const uint16_t *s = src;
    for (size_t i = 0; i < n; i++) dst[i] = pd_bf16_to_f32(s[i]);
  } else if (t == PD_DTYPE_F16) {
    const uint16_t *s = src;
    for (size_t i = 0; i < n; i++) dst[i] = pd_f16_to_f32(s[i]);
  } else {
    PD_ASSERT(!"pd_convert_to_f32: unsupported dtype");
  }
}

/* pdctl quantize --method fp8|int4-rtn --model DIR --out DIR [--group-size G] [--force]
 *
 * Writes a compressed-tensors checkpoint of a float (bf16 / f16 / f32) model, in the layouts
 * llm-compressor saves and vLLM and pdserve load (docs/quantization.md), without calibration
 * data:
 *   fp8       the FP8_DYNAMIC scheme: each linear layer's `weight` as e4m3 [out, in] with a
 *             per-channel f32 `weight_scale` [out, 1] = max|row| / 448 (the e4m3 values of
 *             w / scale, nearest even), activations quantized per token at run time;
 *   int4-rtn  W4A16 by round to nearest: `weight_packed` int32 [out, in / 8] (8 values a word,
 *             value i in bits 4i, offset by 8), `weight_scale` [out, in / G] in the model's dtype
 *             = max|group| / 7.5 (compressed-tensors' symmetric 4-bit range [-8, 7]), q =
 *             clamp(round(w / scale), -8, 7) with the stored scale, `weight_shape` [out, in].
 * The embeddings, norms, biases and lm_head are copied as they are (`ignore: ["lm_head"]`), and
 * so are the folder's other files (tokenizer, generation config); config.json gets the
 * quantization_config. One model.safetensors, tensors declared widest dtype first. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "pd/model.h"
#include "pd/safetensors.h"
#include "pd/st_write.h"
#include "pdctl.h"

typedef enum { QZ_FP8, QZ_INT4 } qz_method;

typedef struct qz_ctx {
  qz_method method;
  int group;
  pd_dtype scale_dt; /* int4: the model's float dtype */
} qz_ctx;

/* A linear layer's weight: model.layers.N.{self_attn.{q,k,v,o}_proj,mlp.{gate,up,down}_proj}
 * .weight, 2-D, in a float dtype. */
static bool qz_is_linear(const pd_st_tensor *t) {
  static const char *const ends[] = {".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                                     ".self_attn.v_proj.weight", ".self_attn.o_proj.weight",
                                     ".mlp.gate_proj.weight",    ".mlp.up_proj.weight",
                                     ".mlp.down_proj.weight"};
  if (strncmp(t->name, "model.layers.", 13) != 0 || t->ndim != 2) return false;
  if (t->dtype != PD_DTYPE_BF16 && t->dtype != PD_DTYPE_F16 && t->dtype != PD_DTYPE_F32)
    return false;
  const size_t n = strlen(t->name);
  for (size_t i = 0; i < sizeof ends / sizeof ends[0]; i++) {
    const size_t m = strlen(ends[i]);
    if (n > m && !strcmp(t->name + n - m, ends[i])) return true;
  }
  return false;
}

/* The scale of one group of values x[0, n) (fp8: a row; int4: a group), rounded to what is
 * stored. */
static float qz_scale(const qz_ctx *q, const float *x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
  if (!(amax > 0.0f) || !isfinite(amax)) return 1.0f;
  if (q->method == QZ_FP8) return amax / 448.0f;
  float s = amax / 7.5f;
  if (q->scale_dt == PD_DTYPE_BF16) s = pd_bf16_to_f32(pd_f32_to_bf16(s));
  else if (q->scale_dt == PD_DTYPE_F16) s = pd_f16_to_f32(pd_f32_to_f16(s));
  return s > 0.0f ? s : 1.0f;
}

static void qz_put_scale(const qz_ctx *q, uint8_t *dst, float s) {
  if (q->method == QZ_FP8 || q->scale_dt == PD_DTYPE_F32) {
    memcpy(dst, &s, 4);
  } else {
    const uint16_t h = q->scale_dt == PD_DTYPE_BF16 ? pd_f32_to_bf16(s) : pd_f32_to_f16(s);
    memcpy(dst, &h, 2);
  }
}

/* Row n of linear t in f32. */
static void qz_row(const pd_st_tensor *t, int64_t n, float *row) {
  const int64_t K = t->shape[1];
  pd_convert_to_f32(row, (const char *)t->data + (size_t)n * K * pd_dtype_size(t->dtype),
                    t->dtype, (size_t)K);
}

/* The bytes of the quantized tensor `part` (0: values, 1: scales) of linear t, row by row
 * through w. */
static pd_status qz_write_part(const qz_ctx *q, const pd_st_tensor *t, int part, pd_stw *w,
                               float *row, uint8_t *buf, pd_err *e) {
  const int64_t N = t->shape[0], K = t->shape[1];
  const int64_t G = q->method == QZ_FP8 ? K : q->group, NG = K / G;
  const size_t ss = q->method == QZ_FP8 || q->scale_dt == PD_DTYPE_F32 ? 4 : 2;
  for (int64_t n = 0; n < N; n++) {
    qz_row(t, n, row);
    size_t len = 0;
    for (int64_t g = 0; g < NG; g++) {
      const float *x = row + g * G;
      const float s = qz_scale(q, x, G);
      if (part == 1) {
        qz_put_scale(q, buf + (size_t)g * ss, s);
        continue;
      }
      if (q->method == QZ_FP8) {
        for (int64_t i = 0; i < G; i++) buf[i] = pd_f32_to_e4m3(x[i] / s);
        continue;
      }
      for (int64_t i = 0; i < G; i += 8) { /* one int32 word: 8 values offset by 8 */
        uint32_t word = 0;
        for (int j = 0; j < 8; j++) {
          float v = nearbyintf(x[i + j] / s);
          v = v < -8.0f ? -8.0f : v > 7.0f ? 7.0f : v;
          word |= (uint32_t)((int)v + 8) << (4 * j);
        }
        memcpy(buf + (size_t)(g * G + i) / 2, &word, 4);
      }
    }
    len = part == 1 ? (size_t)NG * ss : q->method == QZ_FP8 ? (size_t)K : (size_t)K / 2;
    if (pd_stw_write(w, buf, len, e) != PD_OK) return e->code;
  }
  return PD_OK;
}

/* One output tensor: a source tensor copied, or part of a quantized linear. */
typedef struct qz_out {
  const pd_st_tensor *src;
  int part; /* -1: copy; 0: values; 1: scales; 2: weight_shape (int4) */
  char name[256];
  pd_dtype dt;
  int ndim;
  int64_t shape[2];
} qz_out;

static pd_status qz_copy_file(const char *from, const char *to, pd_err *e) {
  FILE *a = fopen(from, "rb");
  if (!a) return pd_err_set(e, PD_EIO, "cannot read %s: %s", from, strerror(errno));
  FILE *b = fopen(to, "wb");
  if (!b) {
    fclose(a);
    return pd_err_set(e, PD_EIO, "cannot write %s: %s", to, strerror(errno));
  }
  char buf[1 << 16];
  size_t n;
  bool ok = true;
  while ((n = fread(buf, 1, sizeof buf, a)) > 0) ok &= fwrite(buf, 1, n, b) == n;
  ok &= !ferror(a);
  fclose(a);
  ok &= fclose(b) == 0;
  return ok ? PD_OK : pd_err_set(e, PD_EIO, "cannot copy %s to %s", from, to);
}

static cJSON *qz_config(const qz_ctx *q) {
  cJSON *c = cJSON_CreateObject();
  cJSON *g = cJSON_AddObjectToObject(cJSON_AddObjectToObject(c, "config_groups"), "group_0");
  const bool f8 = q->method == QZ_FP8;
  cJSON_AddStringToObject(g, "format", f8 ? "float-quantized" : "pack-quantized");
  if (f8) {
    cJSON *in = cJSON_AddObjectToObject(g, "input_activations");
    cJSON_AddBoolToObject(in, "dynamic", true);
    cJSON_AddNumberToObject(in, "num_bits", 8);
    cJSON_AddStringToObject(in, "strategy", "token");
    cJSON_AddBoolToObject(in, "symmetric", true);
    cJSON_AddStringToObject(in, "type", "float");
  } else {
    cJSON_AddNullToObject(g, "input_activations");
  }
  cJSON_AddItemToObject(g, "targets", cJSON_CreateStringArray((const char *[]){"Linear"}, 1));
  cJSON *w = cJSON_AddObjectToObject(g, "weights");
  cJSON_AddNullToObject(w, "actorder");
  cJSON_AddBoolToObject(w, "dynamic", false);
  if (f8) cJSON_AddNullToObject(w, "group_size");
  else cJSON_AddNumberToObject(w, "group_size", q->group);
  cJSON_AddNumberToObject(w, "num_bits", f8 ? 8 : 4);
  cJSON_AddStringToObject(w, "strategy", f8 ? "channel" : "group");
  cJSON_AddBoolToObject(w, "symmetric", true);
  cJSON_AddStringToObject(w, "type", f8 ? "float" : "int");
  cJSON_AddStringToObject(c, "format", f8 ? "float-quantized" : "pack-quantized");
  cJSON_AddItemToObject(c, "ignore", cJSON_CreateStringArray((const char *[]){"lm_head"}, 1));
  cJSON_AddNullToObject(c, "kv_cache_scheme");
  cJSON_AddStringToObject(c, "quant_method", "compressed-tensors");
  cJSON_AddStringToObject(c, "quantization_status", "compressed");
  return c;
}

static int qz_fail(pd_stw *w, pd_st *st, cJSON *cfg, qz_out *outs, const char *msg) {
  pd_stw_free(w);
  pd_st_close(st);
  cJSON_Delete(cfg);
  free(outs);
  return pdctl_fail("%s", msg);
}

int cmd_quantize(int argc, char **argv) {
  const char *method_s = NULL, *model = NULL, *out = NULL;
  int group = 128;
  bool force = false, help = false;
  pd_opt opts[] = {
      {"method", PD_OPT_STR, &method_s, "M",
       "fp8 (FP8_DYNAMIC: per-channel e4m3 weights, per-token FP8 activations) or int4-rtn "
       "(W4A16, symmetric groups, round to nearest)", NULL},
      {"model", PD_OPT_STR, &model, "DIR", "the float model folder", NULL},
      {"out", PD_OPT_STR, &out, "DIR", "the folder to write (created)", NULL},
      {"group-size", PD_OPT_INT, &group, "G", "int4-rtn: inputs per scale (128)", NULL},
      {"force", PD_OPT_BOOL, &force, NULL, "write into --out even if it holds files", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0},
  };
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl quantize --method fp8|int4-rtn --model DIR --out DIR [--group-size G] "
          "[--force]\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!method_s || !model || !out) return pdctl_fail("quantize needs --method, --model and --out");
  qz_ctx q = {.group = group};
  if (!strcmp(method_s, "fp8")) q.method = QZ_FP8;
  else if (!strcmp(method_s, "int4-rtn")) q.method = QZ_INT4;
  else return pdctl_fail("--method '%s' is not one of fp8, int4-rtn", method_s);
  if (q.method == QZ_INT4 && (group < 32 || group % 32))
    return pdctl_fail("--group-size %d: a multiple of 32", group);
  pd_model_config mc;
  if (pd_model_config_load(model, &mc, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (mc.quant.method != PD_QUANT_NONE)
    return pdctl_fail("%s is quantized already (its quantization_config)", model);
  q.scale_dt = mc.dtype == PD_DTYPE_F16 || mc.dtype == PD_DTYPE_F32 ? mc.dtype : PD_DTYPE_BF16;
  char rm[4096], ro[4096];
  if (realpath(model, rm) && realpath(out, ro) && !strcmp(rm, ro))
    return pdctl_fail("--out is the model folder");
  if (mkdir(out, 0755) != 0 && errno != EEXIST)
    return pdctl_fail("cannot create %s: %s", out, strerror(errno));
  if (!force) {
    DIR *d = opendir(out);
    struct dirent *de;
    bool empty = true;
    while (d && (de = readdir(d)))
      if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) empty = false;
    if (d) closedir(d);
    if (!empty) return pdctl_fail("%s is not empty (--force writes into it)", out);
  }

  pd_st *st = pd_st_open_dir(model, &e);
  if (!st) return pdctl_fail("%s", e.msg);
  const size_t n_src = pd_st_count(st);
  qz_out *outs = calloc(3 * n_src + 1, sizeof *outs);
  if (!outs) return qz_fail(NULL, st, NULL, NULL, "out of memory");
  size_t n_out = 0;
  int64_t max_k = 1;
  int n_lin = 0;
  for (size_t i = 0; i < n_src; i++) {
    const pd_st_tensor *t = pd_st_at(st, i);
    if (!qz_is_linear(t)) {
      qz_out *o = &outs[n_out++];
      o->src = t;
      o->part = -1;
      snprintf(o->name, sizeof o->name, "%s", t->name);
      o->dt = t->dtype;
      o->ndim = t->ndim;
      continue;
    }
    const int64_t N = t->shape[0], K = t->shape[1];
    if (q.method == QZ_FP8 ? K % 16 : K % q.group) {
      char msg[400];
      snprintf(msg, sizeof msg, "'%s': %lld input features are not a multiple of %d", t->name,
               (long long)K, q.method == QZ_FP8 ? 16 : q.group);
      return qz_fail(NULL, st, NULL, outs, msg);
    }
    if (K > max_k) max_k = K;
    n_lin++;
    const size_t base = strlen(t->name) - strlen(".weight");
    for (int p = 0; p < (q.method == QZ_FP8 ? 2 : 3); p++) {
      qz_out *o = &outs[n_out++];
      o->src = t;
      o->part = p;
      static const char *const fp8_names[] = {"weight", "weight_scale"};
      static const char *const int4_names[] = {"weight_packed", "weight_scale", "weight_shape"};
      snprintf(o->name, sizeof o->name, "%.*s.%s", (int)base, t->name,
               q.method == QZ_FP8 ? fp8_names[p] : int4_names[p]);
      o->ndim = p == 2 ? 1 : 2;
      if (q.method == QZ_FP8) {
        o->dt = p == 0 ? PD_DTYPE_F8_E4M3 : PD_DTYPE_F32;
        o->shape[0] = N;
        o->shape[1] = p == 0 ? K : 1;
      } else {
        o->dt = p == 0 ? PD_DTYPE_I32 : p == 1 ? q.scale_dt : PD_DTYPE_I64;
        o->shape[0] = p == 2 ? 2 : N;
        o->shape[1] = p == 0 ? K / 8 : K / q.group;
      }
    }
  }
  if (n_lin == 0) return qz_fail(NULL, st, NULL, outs, "no linear layers to quantize");

  /* declared widest dtype first (alignment), in source order within a width */
  pd_stw *w = pd_stw_new(&e);
  if (!w) return qz_fail(NULL, st, NULL, outs, e.msg);
  pd_stw_set_metadata(w, "format", "pt", &e);
  qz_out **order = malloc(n_out * sizeof *order);
  if (!order) return qz_fail(w, st, NULL, outs, "out of memory");
  size_t n_ord = 0;
  for (size_t width = 8; width >= 1; width /= 2)
    for (size_t i = 0; i < n_out; i++) {
      const int64_t *sh = outs[i].part < 0 ? outs[i].src->shape : outs[i].shape;
      if (pd_dtype_size(outs[i].dt) != width) continue;
      order[n_ord++] = &outs[i];
      if (pd_stw_add(w, outs[i].name, outs[i].dt, outs[i].ndim, sh, &e) != PD_OK) {
        free(order);
        return qz_fail(w, st, NULL, outs, e.msg);
      }
    }
  char path[4200];
  snprintf(path, sizeof path, "%s/model.safetensors", out);
  float *row = malloc((size_t)max_k * sizeof *row);
  uint8_t *buf = malloc((size_t)max_k * 4 + 64);
  pd_status s = !row || !buf ? pd_err_set(&e, PD_ENOMEM, "out of memory")
                             : pd_stw_begin(w, path, &e);
  for (size_t i = 0; s == PD_OK && i < n_ord; i++) {
    const qz_out *o = order[i];
    if (o->part < 0) {
      s = pd_stw_write(w, o->src->data, o->src->nbytes, &e);
    } else if (o->part == 2) {
      const int64_t shape[2] = {o->src->shape[0], o->src->shape[1]};
      s = pd_stw_write(w, shape, sizeof shape, &e);
    } else {
      s = qz_write_part(&q, o->src, o->part, w, row, buf, &e);
    }
  }
  free(order);
  free(row);
  free(buf);
  if (s == PD_OK) s = pd_stw_finish(w, false, &e);
  if (s != PD_OK) return qz_fail(w, st, NULL, outs, e.msg);
  pd_stw_free(w);
  pd_st_close(st);
  free(outs);

  /* config.json with the quantization_config; the other files as they are */
  snprintf(path, sizeof path, "%s/config.json", model);
  size_t len = 0;
  char *text = pdctl_read_file(path, &len);
  cJSON *cfg = text ? cJSON_ParseWithLength(text, len) : NULL;
  free(text);
  if (!cJSON_IsObject(cfg)) return qz_fail(NULL, NULL, cfg, NULL, "cannot read config.json");
  cJSON_DeleteItemFromObject(cfg, "quantization_config");
  cJSON_AddItemToObject(cfg, "quantization_config", qz_config(&q));
  char *js = cJSON_Print(cfg);
  cJSON_Delete(cfg);
  snprintf(path, sizeof path, "%s/config.json", out);
  FILE *f = js ? fopen(path, "w") : NULL;
  const bool ok = f && fputs(js, f) >= 0 && fputc('\n', f) != EOF;
  free(js);
  if (!f || fclose(f) != 0 || !ok) return pdctl_fail("cannot write %s", path);
  DIR *d = opendir(model);
  struct dirent *de;
  while (d && (de = readdir(d))) {
    const char *nm = de->d_name;
    const size_t nl = strlen(nm);
    if (nm[0] == '.' || !strcmp(nm, "config.json") || !strcmp(nm, "model.safetensors.index.json") ||
        (nl > 12 && !strcmp(nm + nl - 12, ".safetensors")))
      continue;
    char from[4200], to[4200];
    struct stat sb;
    snprintf(from, sizeof from, "%s/%s", model, nm);
    snprintf(to, sizeof to, "%s/%s", out, nm);
    if (stat(from, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    if (qz_copy_file(from, to, &e) != PD_OK) {
      closedir(d);
      return pdctl_fail("%s", e.msg);
    }
  }
  if (d) closedir(d);
  printf("%s: %d linear layers as %s, written to %s\n", model, n_lin,
         q.method == QZ_FP8 ? "FP8 (e4m3, per-channel scales)" : "4-bit (round to nearest)", out);
  return 0;
}

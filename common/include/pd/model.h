/* Hugging Face causal LMs of the Llama family: LlamaForCausalLM, Qwen2ForCausalLM,
 * MistralForCausalLM. config.json parsing and the weight layout the engine reads. */
#ifndef PD_MODEL_H
#define PD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/dtype.h"
#include "pd/safetensors.h"
#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_arch { PD_ARCH_LLAMA = 0, PD_ARCH_QWEN2, PD_ARCH_MISTRAL } pd_arch;

typedef enum pd_rope_type { PD_ROPE_DEFAULT = 0, PD_ROPE_LINEAR, PD_ROPE_LLAMA3 } pd_rope_type;

typedef struct pd_rope_config {
  pd_rope_type type;
  double theta;            /* rope_theta */
  double factor;           /* linear and llama3 */
  double low_freq_factor;  /* llama3 */
  double high_freq_factor; /* llama3 */
  int original_max_position_embeddings; /* llama3 */
} pd_rope_config;

#define PD_MAX_EOS 8

/* Weight quantization of a checkpoint as published (config.json's quantization_config). */
typedef enum pd_quant_method {
  PD_QUANT_NONE = 0,
  PD_QUANT_AWQ,  /* AutoAWQ "gemm": qweight [in, out/8], qzeros [in/g, out/8], scales [in/g, out] */
  PD_QUANT_GPTQ, /* qweight [in/8, out], qzeros [in/g, out/8], scales [in/g, out], g_idx [in] */
  PD_QUANT_CT_PACKED, /* compressed-tensors pack-quantized: weight_packed [out, in/8],
                         weight_scale [out, in/g], weight_zero_point when asymmetric */
  PD_QUANT_CT_FP8,    /* compressed-tensors float-quantized: weight e4m3 [out, in], weight_scale
                         per channel [out, 1] or per tensor */
} pd_quant_method;

typedef struct pd_quant_config {
  pd_quant_method method;
  int bits;         /* 4 */
  int group_size;   /* input features per scale; 0 = the whole row (GPTQ -1, channel strategy) */
  bool sym;         /* symmetric: no stored zero points (zero 2^(bits-1)) */
  bool zeros_minus_one; /* GPTQ checkpoint_format "gptq": stored zeros are z - 1 */
  bool act_fp8_dynamic; /* FP8: activations quantized per token at run time (FP8_DYNAMIC) */
  bool act_fp8_static;  /* FP8: activations quantized with the layers' static input_scale */
  bool kv_fp8_scales;   /* kv_cache_scheme: the layers' FP8 KV scales (self_attn.k_scale, v_scale) */
} pd_quant_config;

typedef struct pd_model_config {
  pd_arch arch;
  char architecture[64]; /* as written in config.json */
  int vocab_size;
  int hidden_size;
  int intermediate_size;
  int num_layers;
  int num_heads;
  int num_kv_heads;
  int head_dim; /* explicit, or hidden_size / num_heads */
  int max_position_embeddings;
  double rms_norm_eps;
  pd_rope_config rope;
  bool tie_word_embeddings;
  bool attention_bias; /* q/k/v biases (always for Qwen2); for Llama also the o_proj bias */
  bool mlp_bias;
  int sliding_window; /* 0 = none */
  int sliding_window_first_layer; /* layers >= this use sliding_window (Qwen2: from layer_types or
                                     max_window_layers; Mistral: 0) */
  int bos_token_id;   /* -1 = none */
  int n_eos;
  int eos_token_ids[PD_MAX_EOS];
  pd_dtype dtype; /* declared torch dtype ("dtype" or "torch_dtype"), BF16 if absent */
  pd_quant_config quant; /* method PD_QUANT_NONE: float weights */
} pd_model_config;

/* Parses config.json text. Unsupported architectures and RoPE types are PD_EUNSUPPORTED;
 * missing or nonsensical fields are PD_EFORMAT; messages name the field. */
pd_status pd_model_config_parse(const char *json, size_t len, pd_model_config *c, pd_err *e);
pd_status pd_model_config_load(const char *dir, pd_model_config *c, pd_err *e);

/* Fills inv_freq[head_dim/2] for the config's RoPE type (default, linear, llama3), following
 * transformers' modeling_rope_utils.py step by step in float32 (it computes
 * 1 / base ** (arange(0, dim, 2).float() / dim) and the scalings on float32 tensors). Every
 * step rounds as torch's does except pow, taken correctly rounded (torch's vectorised powf is
 * within 1 ulp of it), so values agree to about 1 ulp. */
void pd_rope_inv_freq(const pd_model_config *c, float *inv_freq);

/* A weight as stored: 2-D [rows = out features, cols = in features] or 1-D (cols = 1).
 * data points into the safetensors mapping. data == NULL means absent (optional bias). */
typedef struct pd_weight {
  const void *data;
  pd_dtype dtype;
  int64_t rows, cols;
} pd_weight;

typedef struct pd_layer_weights {
  pd_weight attn_norm;          /* input_layernorm.weight [hidden] */
  pd_weight wq, wk, wv, wo;     /* [nh*hd, hidden], [nkv*hd, hidden] x2, [hidden, nh*hd] */
  pd_weight bq, bk, bv;         /* optional biases [nh*hd], [nkv*hd] x2 (attention_bias) */
  pd_weight bo;                 /* optional o_proj bias [hidden] (Llama attention_bias only) */
  pd_weight ffn_norm;           /* post_attention_layernorm.weight [hidden] */
  pd_weight w_gate, w_up, w_down; /* [ffn, hidden] x2, [hidden, ffn] */
  pd_weight b_gate, b_up, b_down; /* optional biases [ffn] x2, [hidden] (Llama mlp_bias) */
  float k_scale, v_scale;       /* FP8 KV cache scales of a kv_cache_scheme checkpoint, else 0 */
} pd_layer_weights;

typedef struct pd_model {
  pd_model_config cfg;
  char dir[4096];
  pd_st *st;
  pd_weight tok_embeddings; /* model.embed_tokens.weight [vocab, hidden] */
  pd_weight final_norm;     /* model.norm.weight [hidden] */
  pd_weight lm_head;        /* lm_head.weight, or tok_embeddings when tied */
  pd_layer_weights *layers; /* [num_layers] */
  /* weights the loader made (quantized checkpoints repacked into PD_DTYPE_Q4), freed with it */
  void **owned;
  int n_owned;
} pd_model;

typedef struct pd_model_opts {
  /* --quantization fp8: a float checkpoint's linear layers quantized at load into
   * PD_DTYPE_F8WA rows (per-channel e4m3 weights, scale max|row| / 448, and dynamic per-token
   * FP8 activations); the embeddings and the LM head stay as they are */
  bool quantize_fp8;
} pd_model_opts;

/* Loads config.json and maps the weights of dir; checks every tensor's presence, dtype
 * (F32/F16/BF16) and shape against the config. o may be NULL. The linear layers of a quantized
 * checkpoint (config quant) are repacked into PD_DTYPE_Q4 rows; a layer the checkpoint left
 * unquantized (a float `.weight`, as modules_to_not_convert / ignore lists leave them) is
 * mapped as it is. */
pd_model *pd_model_load(const char *dir, const pd_model_opts *o, pd_err *e);
/* The quantized linear layer prefix (e.g. "model.layers.0.self_attn.q_proj") of [N out, K in]
 * in st, in the layout qc names, repacked into PD_DTYPE_Q4 rows: *rows is a malloc'ed buffer of
 * N * pd_dtype_row_bytes(PD_DTYPE_Q4, K) bytes (the caller frees it). Tensors missing or of the
 * wrong dtype or shape, shapes the kernels do not take and act-order groups are errors naming
 * the tensor. */
pd_status pd_model_quant_linear(const pd_st *st, const pd_quant_config *qc, const char *prefix,
                                int64_t N, int64_t K, void **rows, pd_err *e);
/* The same for an FP8 (compressed-tensors float-quantized) layer: prefix.weight e4m3 [N, K] and
 * prefix.weight_scale (per channel or one) as PD_DTYPE_F8W rows (N * (K + 4) bytes). */
pd_status pd_model_fp8_linear(const pd_st *st, const pd_quant_config *qc, const char *prefix,
                               int64_t N, int64_t K, void **rows, pd_err *e);
/* Bytes of the weights as the engine places them (quantized layers in their repacked rows; a
 * tied LM head counted once). */
size_t pd_model_weight_bytes(const pd_model *m);
void pd_model_free(pd_model *m);

/* Fingerprint of a model folder for the router's compatibility check: XXH64 of config.json
 * mixed with XXH64 of tokenizer.json. PD_EIO when a file cannot be read. */
pd_status pd_model_fingerprint(const char *dir, uint64_t *fp, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif

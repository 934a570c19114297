#!/usr/bin/env python3
"""PyTorch decode baselines for pdserve's benchmark table (issue 5), on one CUDA GPU.

Given a Hugging Face model folder (typically one written by `pdctl make-model`: bf16, random
weights, exact published shapes), measures greedy generation throughput of

  hf-generate     transformers' `model.generate` (greedy, dynamic KV cache, SDPA attention):
                  what most people run.
  torch-static    a minimal Llama written here in plain PyTorch, the gpt-fast recipe: fused QKV
                  and gate/up weights, RMSNorm/RoPE/GQA/SwiGLU, a STATIC preallocated KV cache
                  [batch, kv_heads, max_len, head_dim], and one decode step (forward + argmax +
                  cache/position update) captured once as a CUDA graph and replayed per token
                  (or, with --compile, torch.compile(mode="reduce-overhead")).

Each measurement: `batch` sequences of `ctx` random prompt tokens, `new` tokens generated each
(min_new_tokens = max_new_tokens: no early stop), after one untimed warm-up run.
tokens_per_s = batch * new / time, where time covers the prefill and all decode steps (as
gpt-fast and HF report it); torch-static also reports decode-only tokens/s.

Output: one JSON line per measurement ({"impl", "batch", "ctx", "new_tokens", "tokens_per_s",
...}), then a table. For the Llama-3-8B shape on an H200 the default run takes about
1.5 minutes with loading; --compile adds about a minute of compilation per batch shape
(--budget-s stops early, reporting what was skipped).

  python3 bench/torch_baseline.py /path/to/llama3-8b
  python3 bench/torch_baseline.py MODEL --impl static --batches 1,8,32 --ctx 128,1024
"""
import argparse
import glob
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

# Published layer counts by (hidden_size, intermediate_size, vocab_size), to say when a folder
# holds fewer layers than the model whose shapes it copies (no make_model.json).
PUBLISHED = {
    (4096, 14336, 128256): ("meta-llama/Meta-Llama-3-8B", 32),
    (8192, 28672, 128256): ("meta-llama/Meta-Llama-3-70B", 80),
    (3584, 18944, 152064): ("Qwen/Qwen2-7B", 28),
    (4096, 11008, 32000): ("meta-llama/Llama-2-7b-hf", 32),
    (4096, 14336, 32000): ("mistralai/Mistral-7B-v0.1", 32),
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- model folder --------------------------------------------------------------------------


class Config:
    """The config.json fields a Llama/Qwen2/Mistral decoder needs."""

    def __init__(self, d):
        arch = (d.get("architectures") or [""])[0]
        mt = d.get("model_type", "")
        self.qwen2 = arch == "Qwen2ForCausalLM" or mt == "qwen2"
        self.mistral = arch == "MistralForCausalLM" or mt == "mistral"
        self.hidden = d["hidden_size"]
        self.ffn = d["intermediate_size"]
        self.layers = d["num_hidden_layers"]
        self.heads = d["num_attention_heads"]
        self.kv_heads = d.get("num_key_value_heads") or self.heads
        self.head_dim = d.get("head_dim") or self.hidden // self.heads
        self.vocab = d["vocab_size"]
        self.eps = d.get("rms_norm_eps", 1e-6)
        self.tied = bool(d.get("tie_word_embeddings", False))
        llama_bias = bool(d.get("attention_bias", False)) and not (self.qwen2 or self.mistral)
        self.qkv_bias = self.qwen2 or llama_bias
        self.o_bias = llama_bias
        self.mlp_bias = bool(d.get("mlp_bias", False))
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        self.rope_theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
        self.rope = dict(rp)
        self.rope_type = rp.get("rope_type", rp.get("type", "default"))
        self.sliding_window = None
        if self.mistral:
            self.sliding_window = d.get("sliding_window", 4096)
        elif self.qwen2 and d.get("use_sliding_window"):
            self.sliding_window = d.get("sliding_window")
        self.max_pos = d.get("max_position_embeddings", 4096)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def layers_note(model_dir, cfg):
    """(published name, published layers) when the folder holds fewer layers, else None."""
    mm = os.path.join(model_dir, "make_model.json")
    if os.path.exists(mm):
        m = read_json(mm)
        pub = m.get("published_num_hidden_layers")
        if pub and pub != cfg.layers:
            return m.get("published", m.get("like", "?")), pub
        return None
    known = PUBLISHED.get((cfg.hidden, cfg.ffn, cfg.vocab))
    if known and known[1] != cfg.layers:
        return known
    return None


def rope_inv_freq(cfg):
    """transformers' modeling_rope_utils: default, linear and llama3 RoPE (float32)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    t = cfg.rope_type
    if t in ("default", None):
        return inv
    if t == "linear":
        return inv / float(cfg.rope["factor"])
    if t == "llama3":
        factor = float(cfg.rope["factor"])
        low, high = float(cfg.rope["low_freq_factor"]), float(cfg.rope["high_freq_factor"])
        old = float(cfg.rope.get("original_max_position_embeddings", cfg.max_pos))
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, inv_l)
    raise SystemExit(f"torch_baseline: RoPE type {t!r} is not supported here")


# ---- the gpt-fast style model --------------------------------------------------------------


def rms_norm(x, w, eps):
    """As transformers' LlamaRMSNorm: float32 statistics, weight applied in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def buffers(module, tensors):
    """Registers tensors (or None) as non-persistent buffers: torch.compile's CUDA graphs treat
    module buffers as static inputs, which the in-place KV cache updates need."""
    for name, t in tensors.items():
        module.register_buffer(name, t, persistent=False)


class Layer(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        buffers(self, {
            "attn_norm": w["attn_norm"], "ffn_norm": w["ffn_norm"],
            "wqkv": w["wqkv"], "bqkv": w.get("bqkv"),  # [(H + 2 KV) * hd, hidden]
            "wo": w["wo"], "bo": w.get("bo"),
            "w13": w["w13"], "b13": w.get("b13"),  # [2 * ffn, hidden]: gate rows, then up
            "w2": w["w2"], "b2": w.get("b2"),
            "k_cache": None, "v_cache": None,  # [B, KV, L, hd] once set up
        })


class StaticLlama(torch.nn.Module):
    """Llama/Qwen2/Mistral decoder with a static KV cache. Weights as loaded from the folder's
    safetensors (names of transformers' state dict), q/k/v and gate/up fused per layer."""

    def __init__(self, cfg, weights, device, dtype):
        super().__init__()
        self.cfg = cfg
        embed = weights.pop("model.embed_tokens.weight")
        head = weights.pop("lm_head.weight", None)
        buffers(self, {"embed": embed, "norm": weights.pop("model.norm.weight"),
                       "lm_head": embed if cfg.tied or head is None else head})
        self.layers = torch.nn.ModuleList()
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            g = lambda n: weights.pop(p + n, None)  # noqa: E731
            w = {
                "attn_norm": g("input_layernorm.weight"),
                "ffn_norm": g("post_attention_layernorm.weight"),
                "wqkv": torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                                   g("self_attn.v_proj.weight")]),
                "wo": g("self_attn.o_proj.weight"),
                "w13": torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]),
                "w2": g("mlp.down_proj.weight"),
            }
            if cfg.qkv_bias:
                w["bqkv"] = torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"),
                                       g("self_attn.v_proj.bias")])
            if cfg.o_bias:
                w["bo"] = g("self_attn.o_proj.bias")
            if cfg.mlp_bias:
                w["b13"] = torch.cat([g("mlp.gate_proj.bias"), g("mlp.up_proj.bias")])
                w["b2"] = g("mlp.down_proj.bias")
            self.layers.append(Layer(w))
        inv = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_pos if cfg.max_pos <= 1 << 17 else 1 << 17, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        buffers(self, {"cos": emb.cos().to(device=device, dtype=dtype),  # [max_pos, hd]
                       "sin": emb.sin().to(device=device, dtype=dtype), "arange": None})
        self.max_len = 0

    def setup_cache(self, batch, max_len, device, dtype):
        c = self.cfg
        for layer in self.layers:
            layer.k_cache = None
            layer.v_cache = None
        for layer in self.layers:
            shape = (batch, c.kv_heads, max_len, c.head_dim)
            layer.k_cache = torch.zeros(shape, device=device, dtype=dtype)
            layer.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.arange = torch.arange(max_len, device=device)

    def free_cache(self):
        for layer in self.layers:
            layer.k_cache = None
            layer.v_cache = None

    def forward(self, tokens, input_pos, prefill):
        """tokens [B, T] at positions input_pos [T] (the same for every sequence). Prefill
        starts at position 0 (causal attention over the prompt); decode has T = 1 and attends
        over the cache masked to positions <= input_pos. Returns last-position logits [B, V]."""
        c = self.cfg
        B, T = tokens.shape
        H, KV, hd = c.heads, c.kv_heads, c.head_dim
        G = H // KV
        x = F.embedding(tokens, self.embed)
        cos = self.cos[input_pos][None, None]  # [1, 1, T, hd]
        sin = self.sin[input_pos][None, None]
        if not prefill:
            mask = self.arange <= input_pos[-1]  # [L]
            if c.sliding_window:
                mask = mask & (self.arange > input_pos[-1] - c.sliding_window)
        for layer in self.layers:
            h = rms_norm(x, layer.attn_norm, c.eps)
            qkv = F.linear(h, layer.wqkv, layer.bqkv)
            q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
            q = q.view(B, T, H, hd).transpose(1, 2)
            k = k.view(B, T, KV, hd).transpose(1, 2)
            v = v.view(B, T, KV, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            layer.k_cache.index_copy_(2, input_pos, k)
            layer.v_cache.index_copy_(2, input_pos, v)
            if prefill:
                if c.sliding_window and T > c.sliding_window:
                    i = torch.arange(T, device=x.device)
                    m = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - c.sliding_window)
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=G > 1)
                else:
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G > 1)
            else:
                # GQA without repeating K/V: the G query heads of one KV head form the rows of
                # one [G, hd] x [hd, L] product, so the cache is read once.
                qg = q.reshape(B, KV, G, hd)
                s = torch.matmul(qg, layer.k_cache.transpose(-1, -2)).float()
                s = s * (1.0 / math.sqrt(hd))
                s = s.masked_fill(~mask, float("-inf"))
                p = torch.softmax(s, dim=-1).to(q.dtype)
                o = torch.matmul(p, layer.v_cache).view(B, H, 1, hd)
            o = o.transpose(1, 2).reshape(B, T, H * hd)
            x = x + F.linear(o, layer.wo, layer.bo)
            h = rms_norm(x, layer.ffn_norm, c.eps)
            gu = F.linear(h, layer.w13, layer.b13)
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, layer.w2, layer.b2)
        x = rms_norm(x[:, -1], self.norm, c.eps)
        return F.linear(x, self.lm_head)


def load_weights(model_dir, device, dtype):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted({os.path.join(model_dir, f) for f in read_json(idx)["weight_map"].values()})
    if not files:
        raise SystemExit(f"torch_baseline: no *.safetensors in {model_dir}")
    w = {}
    for f in files:
        with safe_open(f, framework="pt", device=str(device)) as sf:
            for name in sf.keys():
                w[name] = sf.get_tensor(name).to(dtype)
    return w


# ---- measurements --------------------------------------------------------------------------


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StaticRunner:
    """Greedy generation with the static model: eager prefill, then per token either one
    replay of a captured CUDA graph (decode step + argmax + token/position update, all on the
    GPU) or a call of the torch.compile'd step."""

    def __init__(self, model, batch, ctx, new, device, dtype, mode):
        self.m, self.B, self.ctx, self.new, self.dev, self.mode = model, batch, ctx, new, device, mode
        max_len = (ctx + new + 63) // 64 * 64
        model.setup_cache(batch, max_len, device, dtype)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.gen = torch.zeros(batch, new, dtype=torch.long, device=device)
        self.graph = None
        self.compiled = None
        if mode == "graph" and device.type == "cuda":
            self._capture()
        elif mode == "compile":
            def step(tok, pos):
                return self.m(tok, pos, prefill=False).argmax(-1)
            self.compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)

    def _step(self):
        nxt = self.m(self.tok, self.pos, prefill=False).argmax(-1)  # [B]
        self.gen.index_copy_(1, self.pos - (self.ctx - 1), nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)

    def _capture(self):
        self.pos.fill_(self.ctx)
        s = torch.cuda.Stream(self.dev)
        s.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(s):  # warm-up off the capture: allocator and cuBLAS settle
            for _ in range(3):
                self._step()
        torch.cuda.current_stream(self.dev).wait_stream(s)
        self.pos.fill_(self.ctx)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def run(self, prompt):
        """Generates self.new tokens per sequence; returns (total s, decode-only s)."""
        sync(self.dev)
        t0 = time.perf_counter()
        ip = torch.arange(self.ctx, device=self.dev)
        first = self.m(prompt, ip, prefill=True).argmax(-1)
        self.gen[:, 0] = first
        self.tok.copy_(first[:, None])
        self.pos.fill_(self.ctx)
        sync(self.dev)
        t1 = time.perf_counter()
        if self.graph is not None:
            for _ in range(self.new - 1):
                self.graph.replay()
        elif self.compiled is not None:
            for i in range(1, self.new):
                nxt = self.compiled(self.tok, self.pos).clone()
                self.gen[:, i] = nxt
                self.tok.copy_(nxt[:, None])
                self.pos.add_(1)
        else:
            for _ in range(self.new - 1):
                self._step()
        sync(self.dev)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    def close(self):
        self.graph = None
        self.compiled = None
        self.m.free_cache()


def hf_generate(model, prompt, new, pad_id):
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                         max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=pad_id, use_cache=True)
    if out.shape[1] != prompt.shape[1] + new:
        raise SystemExit(f"torch_baseline: generate returned {out.shape[1] - prompt.shape[1]} "
                         f"new tokens, expected {new}")
    return out


def load_hf(model_dir, device, dtype):
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": "sdpa"}
    try:
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=str(device), **kw)
    except (TypeError, ImportError, ValueError) as e:  # older transformers / no accelerate
        log(f"from_pretrained(device_map=...) failed ({e}); loading on the CPU, then moving")
        try:
            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
        except TypeError:
            m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, **kw)
        m = m.to(device)
    m.eval()
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="Hugging Face model folder (e.g. from pdctl make-model)")
    ap.add_argument("--impl", default="hf,static", help="hf, static or both (default hf,static)")
    ap.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    ap.add_argument("--ctx", default="128", help="prompt lengths (default 128)")
    ap.add_argument("--long-ctx", type=int, default=1024,
                    help="torch-static also at this prompt length with the largest batch "
                         "(0 = off; default 1024)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated (128)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of torch-static; median")
    ap.add_argument("--compile", action="store_true",
                    help="torch-static: torch.compile(mode='reduce-overhead') instead of a "
                         "hand-captured CUDA graph (slow to compile: minutes for 8B)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (smoke test)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--budget-s", type=float, default=230,
                    help="skip the remaining measurements after this many seconds (230)")
    ap.add_argument("--json-out", help="also write all results to this file")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.new_tokens < 4:
        ap.error("--new-tokens must be at least 4")

    t_start = time.perf_counter()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("torch_baseline: CUDA is not available (use --device cpu for a smoke test)")
    dtype = getattr(torch, a.dtype)
    impls = [s.strip() for s in a.impl.split(",") if s.strip()]
    batches = [int(b) for b in a.batches.split(",")]
    ctxs = [int(c) for c in a.ctx.split(",")]
    new = a.new_tokens
    cfg = Config(read_json(os.path.join(a.model, "config.json")))
    note = layers_note(a.model, cfg)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = None
    header = {"model": os.path.abspath(a.model), "layers": cfg.layers, "hidden": cfg.hidden,
              "heads": cfg.heads, "kv_heads": cfg.kv_heads, "ffn": cfg.ffn, "vocab": cfg.vocab,
              "dtype": a.dtype, "device": gpu, "torch": torch.__version__, "transformers": tv}
    if note:
        header["published"], header["published_layers"] = note
        log(f"NOTE: this folder has {cfg.layers} of the {note[1]} layers of {note[0]}: "
            f"these figures are NOT those of the full model")
    print(json.dumps({"header": header}), flush=True)

    results, skipped = [], []
    gen = torch.Generator(device="cpu").manual_seed(a.seed)

    def prompt_for(b, c):
        return torch.randint(0, cfg.vocab, (b, c), generator=gen).to(device)

    def over_budget(what):
        if time.perf_counter() - t_start > a.budget_s:
            skipped.append(what)
            log(f"budget of {a.budget_s:.0f} s spent: skipping {what}")
            return True
        return False

    def emit(r):
        r.update({"layers": cfg.layers})
        if note:
            r["published_layers"] = note[1]
        results.append(r)
        print(json.dumps(r), flush=True)

    check_prompt = torch.randint(0, cfg.vocab, (1, 32), generator=gen).to(device)
    ref_logits = None
    with torch.no_grad():
        if "hf" in impls:
            t = time.perf_counter()
            hf = load_hf(a.model, device, dtype)
            log(f"hf: loaded in {time.perf_counter() - t:.1f} s")
            ref_logits = hf(check_prompt).logits[:, -1].float().cpu()
            pad = 0
            for c in ctxs:
                for b in batches:
                    what = f"hf-generate batch {b} ctx {c}"
                    if over_budget(what):
                        continue
                    p = prompt_for(b, c)
                    hf_generate(hf, p, min(8, new), pad)  # warm-up
                    sync(device)
                    t0 = time.perf_counter()
                    hf_generate(hf, p, new, pad)
                    sync(device)
                    dt = time.perf_counter() - t0
                    emit({"impl": "hf-generate", "batch": b, "ctx": c, "new_tokens": new,
                          "tokens_per_s": round(b * new / dt, 2), "time_s": round(dt, 3)})
            del hf
            if device.type == "cuda":
                torch.cuda.empty_cache()

        if "static" in impls:
            t = time.perf_counter()
            model = StaticLlama(cfg, load_weights(a.model, device, dtype), device, dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"torch-static: loaded in {time.perf_counter() - t:.1f} s")
            if ref_logits is not None:  # the hand-written model computes what transformers does
                model.setup_cache(1, 64, device, dtype)
                n = check_prompt.shape[1]
                pre = model(check_prompt, torch.arange(n, device=device), prefill=True)
                # the same last position through the decode path: prefill n-1, decode 1
                model(check_prompt[:, :-1], torch.arange(n - 1, device=device), prefill=True)
                dec = model(check_prompt[:, -1:], torch.tensor([n - 1], device=device),
                            prefill=False)
                for what, mine in (("prefill", pre), ("decode", dec)):
                    mine = mine.float().cpu()
                    rel = ((mine - ref_logits).abs().max() / ref_logits.abs().max()).item()
                    same = mine.argmax(-1).item() == ref_logits.argmax(-1).item()
                    log(f"torch-static {what} vs transformers: last-position logits max rel "
                        f"diff {rel:.3g}, same argmax: {same}")
                    if rel > 0.1 or not same:
                        log(f"WARNING: torch-static {what} does not match transformers")
                model.free_cache()
            mode = "compile" if a.compile else ("graph" if device.type == "cuda" else "eager")
            impl = {"graph": "torch-static-cudagraph", "compile": "torch-static-compile",
                    "eager": "torch-static-eager"}[mode]
            runs = [(b, c) for c in ctxs for b in batches]
            if a.long_ctx and a.long_ctx not in ctxs:
                runs.append((max(batches), a.long_ctx))
            for b, c in runs:
                what = f"{impl} batch {b} ctx {c}"
                if c + new > cfg.max_pos:
                    log(f"skipping {what}: exceeds max_position_embeddings {cfg.max_pos}")
                    continue
                if over_budget(what):
                    continue
                t = time.perf_counter()
                r = StaticRunner(model, b, c, new, device, dtype, mode)
                p = prompt_for(b, c)
                r.run(p)  # warm-up (and, with --compile, the compilation)
                setup = time.perf_counter() - t
                times = sorted(r.run(p) for _ in range(max(1, a.repeat)))
                tot, dec = times[len(times) // 2]
                r.close()
                del r
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                emit({"impl": impl, "batch": b, "ctx": c, "new_tokens": new,
                      "tokens_per_s": round(b * new / tot, 2),
                      "decode_tokens_per_s": round(b * (new - 1) / dec, 2) if dec > 0 else None,
                      "time_s": round(tot, 4), "setup_s": round(setup, 2)})

    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"header": header, "results": results, "skipped": skipped}, f, indent=2)
    print()
    title = f"{gpu}, {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}, {a.dtype}"
    if note:
        title += f" -- {cfg.layers} of {note[1]} layers of {note[0]}"
    print(title)
    print(f"{'impl':<26} {'batch':>5} {'ctx':>6} {'new':>5} {'tokens/s':>10} {'decode tok/s':>13}")
    for r in results:
        d = r.get("decode_tokens_per_s")
        print(f"{r['impl']:<26} {r['batch']:>5} {r['ctx']:>6} {r['new_tokens']:>5} "
              f"{r['tokens_per_s']:>10.1f} {d if d is not None else '':>13}")
    for s in skipped:
        print(f"skipped (budget): {s}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()

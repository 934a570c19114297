#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/seed-*.

  tests/fuzz/make_seeds.py

Seeds are small, valid (or nearly valid) inputs that show each target the shapes it should
explore; the fuzzer mutates them. Files named crash-*, leak-*, timeout-* or found-* beside them
are inputs that once failed (regressions): this script never touches those. The wire seeds
(protobuf envelopes) are not written here: see tests/fuzz/README.md. Standard library only."""
import json
import os
import struct

ROOT = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(ROOT))


def put(target, name, data):
    d = os.path.join(ROOT, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# ---- (a) http: [limits preset] [split seed] stream ----
def http():
    reqs = {
        "get": "GET /v1/models?a=1&b=%20x HTTP/1.1\r\nHost: localhost:8000\r\nUser-Agent: t\r\n"
               "Accept: */*\r\n\r\n",
        "post-cl": "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                   "Content-Length: 27\r\n\r\n{\"prompt\":\"hi\",\"stream\":1}\n",
        "chunked-ext-trailer": "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
                               "Transfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3;x=y\r\n:1}\r\n"
                               "0\r\nT: v\r\n\r\n",
        "http10-keepalive": "GET /health?verbose=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        "expect": "POST /generate HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n"
                  "Content-Length: 5\r\n\r\nhello",
        "options-star": "OPTIONS * HTTP/1.1\r\nHost: a\r\nOrigin: http://x\r\n"
                        "Access-Control-Request-Method: POST\r\n\r\n",
        "absolute-form": "GET http://example.com:80/a/b?c=d HTTP/1.1\r\nHost: example.com\r\n"
                         "Connection: close\r\n\r\n",
        "pipelined": "GET /a HTTP/1.1\r\nHost: a\r\n\r\nPOST /b HTTP/1.1\r\nHost: a\r\n"
                     "Content-Length: 3\r\n\r\nxyzGET /c HTTP/1.1\r\nHost: a\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n1\r\nz\r\n0\r\n\r\n\r\nGET /d HTTP/1.1\r\n"
                     "Host: a\r\nConnection: keep-alive, close\r\n\r\n",
        "smuggle-cl-te": "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
                         "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "smuggle-two-cl": "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n"
                          "\r\nabc",
        "obs-fold": "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
        "bare-lf": "GET / HTTP/1.1\nHost: a\n\n",
        "chunk-overflow": "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
                          "fffffffffffffffff\r\n",
        "tls": "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    }
    for i, (name, r) in enumerate(sorted(reqs.items())):
        put("http", name, bytes([i % 3, i * 37 % 256]) + r.encode("latin-1"))


# ---- (b) openai: [kind 0 completions, 1 chat, 2 generate] body ----
def openai():
    bodies = {
        "completion": (0, {"model": "pycoder-12m", "prompt": "def f(x):", "max_tokens": 8,
                           "temperature": 0.7, "top_p": 0.9, "top_k": 40, "stop": ["\n\n", "def"],
                           "seed": 12345678901234567, "logprobs": 2, "echo": True, "n": 2,
                           "best_of": 2, "stream": True,
                           "stream_options": {"include_usage": True}}),
        "completion-ids": (0, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 4,
                               "logit_bias": {"10": -100, "11": 5.5}, "min_tokens": 1,
                               "stop_token_ids": [0], "ignore_eos": False,
                               "presence_penalty": 0.5, "frequency_penalty": -0.5,
                               "repetition_penalty": 1.1, "suffix": "",
                               "response_format": {"type": "text"}}),
        "completion-list": (0, {"prompt": ["a", "b"], "max_completion_tokens": 3,
                                "prompt_logprobs": 1, "add_special_tokens": False,
                                "cache_salt": "s1", "skip_special_tokens": False,
                                "include_stop_str_in_output": True}),
        "chat": (1, {"model": "pycoder-12m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "user", "content": "q\u00e9\U0001f600"}],
            "max_tokens": 5, "logprobs": True, "top_logprobs": 3, "tools": [],
            "tool_choice": "none", "parallel_tool_calls": False}),
        "chat-tools": (1, {"messages": [{"role": "user", "content": "x"}],
                           "tools": [{"type": "function",
                                      "function": {"name": "f", "parameters": {}}}]}),
        "chat-continue": (1, {"messages": [{"role": "user", "content": "x"},
                                           {"role": "assistant", "content": "y"}],
                              "continue_final_message": True, "add_generation_prompt": False,
                              "stream": False, "min_p": 0.1}),
        "generate": (2, {"prompt": "hello", "max_tokens": 2, "temperature": 0}),
    }
    for name, (kind, body) in sorted(bodies.items()):
        put("openai", name, bytes([kind]) + json.dumps(body, ensure_ascii=False).encode())
    put("openai", "deep", b"\x00" + b"[" * 130 + b"]" * 130)
    put("openai", "dup-key", b"\x00{\"max_tokens\": 2, \"max_tokens\": -5, \"prompt\": \"a\"}")
    put("openai", "escapes", b"\x01{\"messages\":[{\"role\":\"user\",\"content\":\"\\ud83d\\ude00"
        b"\\u00e9\\n\\t\\\"\"}],\"seed\":-9223372036854775808,\"n\":1e0}")


# ---- (d) safetensors: [mode 0 file, 1 index.json] bytes ----
def st_file(tensors, pad=True, meta=None):
    hdr, data, off = {}, b"", 0
    if meta is not None:
        hdr["__metadata__"] = meta
    for name, dtype, shape, size in tensors:
        n = size
        for s in shape:
            n *= s
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        data += bytes((off + i) % 251 for i in range(n))
        off += n
    h = json.dumps(hdr, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors():
    put("safetensors", "f32-bf16", b"\x00" + st_file(
        [("model.embed_tokens.weight", "BF16", [4, 3], 2), ("model.norm.weight", "F32", [3], 4),
         ("lm_head.weight", "F16", [4, 3], 2)], meta={"format": "pt"}))
    put("safetensors", "dtypes", b"\x00" + st_file(
        [("a", "I8", [2], 1), ("b", "U8", [1, 1], 1), ("c", "I32", [2], 4), ("d", "F64", [1], 8),
         ("e", "BOOL", [2], 1), ("f", "F8_E4M3", [3], 1), ("g", "I64", [], 8),
         ("h", "F32", [0, 5], 4)], pad=False))
    put("safetensors", "empty-header", b"\x00" + struct.pack("<Q", 2) + b"{}")
    put("safetensors", "index", b"\x01" + json.dumps(
        {"metadata": {"total_size": 16},
         "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}).encode())
    put("safetensors", "index-missing", b"\x01" + json.dumps(
        {"weight_map": {"x": "b.safetensors", "w": "../a.safetensors"}}).encode())


# ---- (d) model_config: config.json ----
def model_config():
    d = os.path.join(REPO, "tests/data/models")
    for m in sorted(os.listdir(d)):
        with open(os.path.join(d, m, "config.json"), "rb") as f:
            put("model_config", m, f.read())
    put("model_config", "qwen2-sliding", json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 32,
        "max_window_layers": 2, "layer_types": ["full_attention", "full_attention",
                                                "sliding_attention", "sliding_attention"],
        "rope_theta": 1000000.0, "rope_scaling": {"type": "linear", "factor": 2.0},
        "tie_word_embeddings": True, "torch_dtype": "float16", "eos_token_id": [1, 2],
        "bos_token_id": 3}))
    put("model_config", "mistral", json.dumps({
        "architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
        "sliding_window": 4096, "hidden_act": "silu", "dtype": "float32", "head_dim": 16,
        "rms_norm_eps": 1e-6}))


# ---- (d) tokenizer_files: tokenizer.json NUL tokenizer_config.json NUL chat_template.jinja ----
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def added(i, s, special=True, normalized=False, lstrip=False, rstrip=False):
    return {"id": i, "content": s, "single_word": False, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_files():
    bl = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(bl)}
    merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["i", "n"], ["Ġ", "a"]]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    n = len(vocab)
    byte_level = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(n, "<|endoftext|>"), added(n + 1, "<|im_start|>"),
                         added(n + 2, "<|im_end|>"), added(n + 3, " def", special=False,
                                                           normalized=True, lstrip=True)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                                   "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                                                   "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges}}
    cfg = {"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False,
           "chat_template": CHAT}
    put("tokenizer_files", "byte-level", json.dumps(byte_level, ensure_ascii=False).encode() +
        b"\0" + json.dumps(cfg).encode())
    put("tokenizer_files", "byte-level-jinja", json.dumps(byte_level, ensure_ascii=False).encode()
        + b"\0" + json.dumps({"eos_token": {"content": "<|im_end|>"}}).encode() + b"\0" +
        CHAT.encode())

    sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        sp_vocab["<0x%02X>" % b] = len(sp_vocab)
    for s in ["▁", "h", "e", "l", "o", "▁h", "he", "ll", "▁he", "llo", "▁hello", "w", "r", "d"]:
        sp_vocab[s] = len(sp_vocab)
    sp = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                    {"Sequence": {"id": "A", "type_id": 0}},
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1],
                                                      "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True,
                  "vocab": sp_vocab, "merges": ["▁ h", "h e", "l l", "▁h e", "ll o", "▁he llo"]}}
    sp_cfg = {"add_bos_token": True, "add_eos_token": True, "bos_token": "<s>", "eos_token": "</s>",
              "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in "
                                 "messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}"
                                 "{% endfor %}"}, {"name": "tool_use", "template": "x"}]}
    put("tokenizer_files", "sentencepiece", json.dumps(sp, ensure_ascii=False).encode() + b"\0" +
        json.dumps(sp_cfg, ensure_ascii=False).encode())


# ---- (e) tokenizer: [tokenizer 0 pycoder, 1 llama2, 2 llama3, 3 qwen3] [flags] bytes ----
def tokenizer():
    texts = {
        "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "special": "<|im_start|>user\nhi<|im_end|>\n<s>[INST] x [/INST]</s><|endoftext|>",
        "unicode": "caf\u00e9 \u00e9\u0301 na\u00efve \u4e2d\u6587 \U0001f600\U0001f44d\U0001f3fd "
                   "\u0645\u0631\u062d\u0628\u0627 \u00a0\u200b\t\r\n  ",
        "numbers": "1234567890 3.14159 -42 0x1F 1e-9 12,345,678",
        "spaces": "   a  b   \n\n\n  \t\t x  ",
    }
    for i, (name, t) in enumerate(sorted(texts.items())):
        for tok in range(4):
            put("tokenizer", "%s-%d" % (name, tok), bytes([tok, i % 4]) + t.encode())
    put("tokenizer", "ids", bytes([1, 4]) + struct.pack("<8I", 1, 2, 3, 259, 300, 0, 13, 31999))
    put("tokenizer", "ids-bytes", bytes([1, 6]) + struct.pack("<6I", 3 + 0xe4, 3 + 0xb8, 3 + 0xad,
                                                               3 + 0xf0, 3 + 0x9f, 3 + 0x98))
    put("tokenizer", "invalid-utf8", bytes([0, 0]) + b"ok \xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80")


# ---- (f) chat_template: [0 own, 1 pycoder, 2 llama3, 3 qwen3] [flags] NUL-separated parts ----
def chat_template():
    msgs = [("system", "You are helpful."), ("user", "Hello <|im_end|> {{ x }}"),
            ("assistant", "Hi."), ("tool", "{\"r\": 1}"), ("user", "")]
    body = b"".join(r.encode() + b"\0" + c.encode() + b"\0" for r, c in msgs)
    for w in (1, 2, 3):
        put("chat_template", "bundled-%d" % w, bytes([w, 1]) + body)
    own = {
        "loops": "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role|upper }}: "
                 "{{ m.content|replace('a', 'b')|trim }}{% if not loop.last %}, {% endif %}"
                 "{% else %}none{% endfor %}",
        "namespace": "{% set ns = namespace(n=0, s='') %}{% for m in messages %}"
                     "{% set ns.n = ns.n + 1 %}{% set ns.s = ns.s ~ m.role[0] %}{% endfor %}"
                     "{{ ns.n }} {{ ns.s }} {{ messages|length }} {{ bos_token }}{{ eos_token }}",
        "exprs": "{{ [1, 2, 3][::-1] }} {{ {'a': 1}['a'] }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }}"
                 " {{ 'x' * 3 }} {{ 'a,b'.split(',') | join('-') }} {{ none is none }} "
                 "{{ (messages | first).content if messages else 'e' }} {{ range(3) | list }} "
                 "{{ 'abc'.startswith('a') and not false }} {{ messages[0]['role'] | tojson }}",
        "raise": "{% if messages | length > 1 %}{{ raise_exception('too many: ' ~ "
                 "messages|length) }}{% endif %}ok",
        "whitespace": "{%- for m in messages -%}\n  {{- m.content -}}\n{%- endfor -%}\n"
                      "{# comment #}{%- if add_generation_prompt %} gen{% endif -%}",
        "macro": "{% macro f(x, y='d') %}<{{ x }}{{ y }}>{% endmacro %}{{ f(1) }}{{ f('a', y=2) }}",
        "range-big": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}",
        "string-growth": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    }
    for name, src in sorted(own.items()):
        put("chat_template", "own-" + name, bytes([0, 3]) + src.encode() + b"\0" + body)


if __name__ == "__main__":
    http()
    openai()
    safetensors()
    model_config()
    tokenizer_files()
    tokenizer()
    chat_template()

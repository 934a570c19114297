#!/usr/bin/env python3
"""OpenAI / vLLM conformance and strict JSON, against a real cluster (router, one prefill and one
decode node on loopback) with the official `openai` client.

Main cluster (--api-key, --allowed-origins): completions, chat, streaming with include_usage
(finish_reason on the last token's chunk, then the usage chunk), logprobs (completions: the
chosen token first in top_logprobs, logprobs 0 included; chat), echo (with logprobs: the prompt's
tokens first), prompt_logprobs ([null] for a one-token prompt), n, stop, seed, models.list and
models.retrieve, /tokenize, /detokenize, /version, CORS, a TLS ClientHello and garbage on the
HTTP port, every error class the client raises (BadRequestError with param, AuthenticationError,
NotFoundError), and the strict-JSON refusals over raw HTTP (duplicate keys, NUL, control
characters, trailing data, lone surrogates, invalid UTF-8, numbers that do not fit), each a 400
naming the parameter. The ZeroMQ client API refuses a NUL in a prompt and top_logprobs without
logprobs the same way.

Small cluster (--max-queue 2, one tokenizer thread, CORS off): a request that can never fit
(n x prompts over the queue) is a 400 (HTTP and ZeroMQ) while a full tokenizer queue is a 429
that a later retry gets through (RateLimitError), OPTIONS is a 405 with Allow, and with the
decode node gone a request gets a 5xx (APIStatusError)."""
import json
import os
import signal
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"), ("openai", "openai"), ("zmq", "pyzmq"))
import openai  # noqa: E402
import requests  # noqa: E402
import zmq  # noqa: E402

KEY = "conformance-key-5678"
MODEL = "pycoder-12m"
ORIGIN = "https://app.example"


def main():
    a = pc.args()
    chk = pc.Checks()
    pc.run_checks(pc.Cluster(a.build, api_key=KEY,
                             router_args=["--allowed-origins", f"{ORIGIN}, https://other.example"]),
                  main_cluster, chk, "main cluster")
    pc.run_checks(pc.Cluster(a.build, router_args=["--max-queue", "2", "--tokenizer-threads", "1",
                                                   "--max-prompt-mb", "8", "--max-body-mb", "16"]),
                  small_cluster, chk, "small cluster")
    return chk.done()


def raw(c, path, data, headers=None, key=KEY, method="POST"):
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    h.update(headers or {})
    return requests.request(method, c.url + path, data=data, headers=h, timeout=60)


def error_of(r):
    try:
        return r.json()["error"]
    except Exception:  # noqa: BLE001
        return {}


def main_cluster(c, chk):
    u = c.url
    client = openai.OpenAI(base_url=u + "/v1", api_key=KEY, timeout=60, max_retries=0)

    print("== completions and chat")
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12,
                                  temperature=0)
    chk.ok(r.object == "text_completion" and r.id.startswith("cmpl-") and len(r.choices) == 1,
           "completion object")
    chk.eq(r.choices[0].finish_reason, "length", "completion finish_reason length")
    chk.eq(r.usage.completion_tokens, 12, "completion usage")
    full = r.choices[0].text
    rc = client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0,
                                        messages=[{"role": "user", "content": "def add(a, b):"}])
    chk.ok(rc.object == "chat.completion" and rc.choices[0].message.role == "assistant" and
           rc.usage.completion_tokens == 10, "chat completion object")

    print("== streaming: finish_reason on the last token's chunk, then usage")
    chunks = list(client.completions.create(model=MODEL, prompt="def fibonacci(n):",
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    with_choices = [ch for ch in chunks if ch.choices]
    chk.ok(len(with_choices) >= 2, "several chunks")
    chk.eq("".join(ch.choices[0].text for ch in with_choices), full, "stream joins to the text")
    chk.ok(all(ch.choices[0].finish_reason is None for ch in with_choices[:-1]),
           "no finish_reason before the last chunk")
    last = with_choices[-1].choices[0]
    chk.ok(last.finish_reason == "length" and last.text != "",
           f"the last chunk carries text and finish_reason together ({last.text!r}, "
           f"{last.finish_reason})")
    chk.ok(chunks[-1].choices == [] and chunks[-1].usage is not None and
           chunks[-1].usage.completion_tokens == 12, "a usage chunk ends the stream")
    chk.ok(all(ch.usage is None for ch in chunks[:-1]), "no usage before the last chunk")
    cchunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "def add(a, b):"}]))
    cw = [ch for ch in cchunks if ch.choices]
    chk.eq(cw[0].choices[0].delta.role, "assistant", "chat stream: role first")
    chk.eq("".join(ch.choices[0].delta.content or "" for ch in cw),
           rc.choices[0].message.content, "chat stream joins to the message")
    chk.ok(cw[-1].choices[0].finish_reason == "length" and cw[-1].choices[0].delta.content,
           "chat: the last content chunk carries finish_reason")
    chk.ok(sum(ch.choices[0].finish_reason is not None for ch in cw) == 1,
           "chat: finish_reason exactly once")
    chk.ok(cchunks[-1].usage is not None and cchunks[-1].choices == [], "chat usage chunk")
    # the raw stream: data lines, [DONE] last
    with requests.post(u + "/v1/completions", headers=c.headers(), stream=True, timeout=60,
                       json={"prompt": "x = ", "max_tokens": 5, "temperature": 0,
                             "stream": True}) as s:
        ev = list(pc.sse_events(s))
    chk.ok(ev[-1] == "[DONE]" and ev[-2]["choices"][0]["finish_reason"] == "length" and
           "stop_reason" in ev[0]["choices"][0], "raw SSE: finish on the last chunk, [DONE]")

    print("== logprobs")
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0,
                                  logprobs=0)
    lp = r.choices[0].logprobs
    chk.ok(len(lp.top_logprobs) == 6 and all(
        len(t) == 1 and list(t) == [tok] and abs(t[tok] - v) < 1e-6
        for t, tok, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)),
        "logprobs 0: top_logprobs hold the chosen token (vLLM)")
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=1.0,
                                  seed=3, logprobs=2)
    lp = r.choices[0].logprobs
    chk.ok(all(tok in t and 2 <= len(t) <= 3 and list(t)[0] == tok
               for t, tok in zip(lp.top_logprobs, lp.tokens)),
           "logprobs 2: the chosen token first, then the others, at most 3")
    chk.eq("".join(lp.tokens), r.choices[0].text, "logprob tokens join to the text")
    rc = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3,
                                        messages=[{"role": "user", "content": "hi"}])
    content = rc.choices[0].logprobs.content
    chk.ok(len(content) == 4 and all(len(x.top_logprobs) == 3 and
                                     x.top_logprobs[0].token == x.token for x in content),
           "chat logprobs: top_logprobs entries, the greedy token first")
    rc = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, logprobs=True,
                                        messages=[{"role": "user", "content": "hi"}])
    chk.ok(all(x.top_logprobs == [] for x in rc.choices[0].logprobs.content),
           "chat logprobs without top_logprobs: empty lists")

    print("== echo")
    prompt = "import numpy as np\n"
    ptoks = raw(c, "/tokenize", json.dumps({"prompt": prompt})).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  echo=True)
    chk.ok(r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt),
           "echo: the prompt before the completion")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    chk.eq(len(lp.tokens), len(ptoks) + 5, "echo + logprobs: prompt tokens then output tokens")
    chk.ok(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and
           all(v is not None for v in lp.token_logprobs[1:]),
           "echo + logprobs: the first prompt token has none, the rest have theirs")
    chk.eq("".join(lp.tokens), r.choices[0].text, "echo tokens join to the echoed text")
    chk.ok(all(t is None or (1 <= len(t) <= 2) for t in lp.top_logprobs), "echo top_logprobs")
    chk.eq(lp.text_offset[len(ptoks)], len(prompt), "the first output token's offset")
    parts = [ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True)
        if ch.choices]
    chk.ok(parts[0].startswith(prompt) and len(parts[0]) > len(prompt) and
           "".join(parts) == r.choices[0].text, "echo stream: the prompt rides on the first chunk")

    print("== prompt_logprobs")
    one = raw(c, "/v1/completions", json.dumps({"prompt": [ptoks[0]], "max_tokens": 2,
                                                "temperature": 0, "prompt_logprobs": 1})).json()
    chk.eq(one["choices"][0].get("prompt_logprobs"), [None], "one-token prompt: [null]")
    many = raw(c, "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2, "n": 2,
                                                 "temperature": 0, "prompt_logprobs": 2})).json()
    pls = [ch.get("prompt_logprobs") for ch in many["choices"]]
    chk.ok(all(pl and len(pl) == len(ptoks) and pl[0] is None and
               str(ptoks[1]) in pl[1] for pl in pls), "prompt_logprobs on every choice")
    chat = raw(c, "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}))
    chk.ok(chat.status_code == 200 and chat.json().get("prompt_logprobs", [1])[0] is None,
           "chat: prompt_logprobs beside the choices")

    print("== n, stop, seed")
    kw = dict(model=MODEL, prompt="def sort(xs):", max_tokens=10, n=3, seed=11, temperature=1.0)
    t1 = [ch.text for ch in client.completions.create(**kw).choices]
    t2 = [ch.text for ch in client.completions.create(**kw).choices]
    chk.ok(len(t1) == 3 and t1 == t2, "n=3 with a seed: 3 choices, reproducible")
    big_seed = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=1.0,
                                         seed=2**63 - 1)
    chk.eq(len(big_seed.choices), 1, "seed 2^63-1 accepted")
    neg_seed = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=1.0,
                                         seed=-(2**63))
    chk.eq(len(neg_seed.choices), 1, "seed -2^63 accepted")
    stop = full[3:6]
    r = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=12,
                                  temperature=0, stop=[stop])
    chk.ok(r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop",
           f"stop {stop!r}: cut, finish_reason stop")
    sc = [ch for ch in client.completions.create(model=MODEL, prompt="def fibonacci(n):",
                                                 max_tokens=12, temperature=0, stop=[stop],
                                                 stream=True) if ch.choices]
    chk.ok(sc[-1].choices[0].finish_reason == "stop" and
           "".join(ch.choices[0].text for ch in sc) == r.choices[0].text,
           "stop in a stream: same text, finish_reason stop")

    print("== models")
    ms = client.models.list()
    chk.ok([m.id for m in ms.data] == [MODEL], "models.list")
    m = client.models.retrieve(MODEL)
    chk.ok(m.id == MODEL and m.object == "model", "models.retrieve")
    try:
        client.models.retrieve("gpt-9")
        chk.ok(False, "models.retrieve of an unknown id raises")
    except openai.NotFoundError as e:
        chk.ok(e.status_code == 404 and e.code == "model_not_found" and e.param == "model",
               "models.retrieve unknown: NotFoundError, model_not_found, param model")
    chk.eq(raw(c, "/v1/models/pycoder%2D12m", None, method="GET").status_code, 200,
           "a percent-encoded model id")

    print("== /tokenize, /detokenize, /version")
    t = raw(c, "/tokenize", json.dumps({"prompt": "def f():", "return_token_strs": True})).json()
    usage = client.completions.create(model=MODEL, prompt="def f():", max_tokens=1).usage
    chk.ok(t["count"] == len(t["tokens"]) == usage.prompt_tokens and
           t["max_model_len"] == m.model_extra["max_model_len"] and
           len(t["token_strs"]) == t["count"], f"/tokenize shape {t}")
    t2 = raw(c, "/tokenize", json.dumps({"prompt": "def f():"})).json()
    chk.ok(t2["tokens"] == t["tokens"] and t2.get("token_strs") is None, "/tokenize no strs")
    d = raw(c, "/detokenize", json.dumps({"tokens": t["tokens"]})).json()
    chk.eq(d, {"prompt": "def f():"}, "/detokenize")
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    tc = raw(c, "/tokenize", json.dumps({"messages": msgs})).json()
    cu = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage
    chk.eq(tc["count"], cu.prompt_tokens, "/tokenize of messages counts the chat prompt")
    bad_tok = raw(c, "/detokenize", json.dumps({"tokens": [1, 10**7]}))
    chk.ok(bad_tok.status_code == 400 and error_of(bad_tok).get("param") == "tokens",
           "/detokenize of an id outside the vocabulary: 400 tokens")
    chk.eq(raw(c, "/tokenize", json.dumps({"prompt": "x"}), key=None).status_code, 401,
           "/tokenize needs the key")
    v = requests.get(u + "/version", timeout=10)
    chk.ok(v.status_code == 200 and isinstance(v.json().get("version"), str), "/version open")

    print("== error classes")
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-5)
        chk.ok(False, "max_tokens -5 raises")
    except openai.BadRequestError as e:
        chk.ok(e.status_code == 400 and e.param == "max_tokens", "BadRequestError param max_tokens")
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=False,
                                  stream_options={"include_usage": True})
        chk.ok(False, "stream_options without stream raises")
    except openai.BadRequestError as e:
        chk.eq(e.param, "stream_options", "stream_options without stream: 400")
    try:
        client.chat.completions.create(model=MODEL, max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "x"}])
        chk.ok(False, "top_logprobs without logprobs raises")
    except openai.BadRequestError as e:
        chk.eq(e.param, "top_logprobs", "top_logprobs without logprobs: 400")
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
        chk.ok(False, "prompt_logprobs in a stream raises")
    except openai.BadRequestError as e:
        chk.eq(e.param, "prompt_logprobs", "prompt_logprobs with stream: 400")
    try:
        client.completions.create(model=MODEL, prompt="x " * 3000, max_tokens=4)
        chk.ok(False, "over the context raises")
    except openai.BadRequestError as e:
        chk.ok(e.code == "context_length_exceeded" and e.param == "prompt",
               "context too long: 400 context_length_exceeded")
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=100)
        chk.ok(False, "n over --max-n raises")
    except openai.BadRequestError as e:
        chk.eq(e.param, "n", "n over --max-n: 400")
    try:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
        chk.ok(False, "unknown model raises")
    except openai.NotFoundError as e:
        chk.ok(e.code == "model_not_found" and e.param == "model", "unknown model: NotFoundError")
    try:
        openai.OpenAI(base_url=u + "/v1", api_key="wrong", timeout=30, max_retries=0) \
            .completions.create(model=MODEL, prompt="x", max_tokens=2)
        chk.ok(False, "a wrong key raises")
    except openai.AuthenticationError as e:
        chk.eq(e.status_code, 401, "AuthenticationError 401")

    print("== strict JSON over raw HTTP")
    cases = [
        (b'{"prompt": "x", "max_tokens": 2, "max_tokens": -5}', "max_tokens", "duplicate key"),
        (b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": true, '
         b'"include_usage": false}}', "stream_options.include_usage", "duplicate key"),
        (b'{"prompt": "a\x00b", "max_tokens": 2}', "prompt", "NUL"),
        (b'{"prompt": "a\\u0000b", "max_tokens": 2}', "prompt", "\\u0000"),
        (b'{"prompt": "a\x01b", "max_tokens": 2}', "prompt", "control character"),
        (b'{"prompt": "line\nbreak", "max_tokens": 2}', "prompt", "control character"),
        (b'{"prompt": "x", "max_tokens": 2} trailing', "", "after the JSON value"),
        (b'{"prompt": "x", "max_tokens": 2}{}', "", "after the JSON value"),
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt", "surrogate"),
        (b'{"prompt": "\\udc00x", "max_tokens": 2}', "prompt", "surrogate"),
        (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "prompt", "UTF-8"),
        (b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt", "UTF-8"),
        (b'{"prompt": "x", "max_tokens": 1e30}', "max_tokens", "integer"),
        (b'{"prompt": "x", "max_tokens": 1e999}', "max_tokens", "range of a double"),
        (b'{"prompt": "x", "n": 2.5}', "n", "integer"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "seed", "integer"),
        (b'{"prompt": "x", "seed": 9223372036854775808}', "seed", "integer"),
        (b'{"prompt": "x", "n": -1}', "n", "integer"),
        (b'{"prompt": "x", "min_tokens": -1}', "min_tokens", "integer"),
        (b'{"prompt": "x", "logprobs": -1}', "logprobs", "integer"),
        (b'{"prompt": "x", "top_k": -2}', "top_k", "integer"),
        (b'{"prompt": [1, -3]}', "prompt", "token ids"),
        (b'{"prompt": "x", "temperature": -1}', "temperature", "temperature"),
        (b'{"prompt": "x", "max_tokens": 2,}', "", "expected a string key"),
    ]
    for body, param, text in cases:
        r = raw(c, "/v1/completions", body)
        e = error_of(r)
        chk.ok(r.status_code == 400 and e.get("param") == (param or None) and
               text in e.get("message", "") and e.get("type") == "invalid_request_error",
               f"{body[:60]!r}: 400 param {param!r} ({r.status_code} {r.text[:160]!r})")
    r = raw(c, "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x\\u0000"}], "max_tokens": 2}')
    chk.ok(r.status_code == 400 and error_of(r).get("param") == "messages.[0].content",
           f"a NUL in a message: param messages.[0].content ({r.text[:120]!r})")
    r = raw(c, "/v1/chat/completions",
            b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}')
    chk.ok(r.status_code == 400 and error_of(r).get("param") == "messages.[0].role",
           "a duplicate key inside a message")
    r = raw(c, "/v1/completions", b'{"prompt": "x", "max_tokens": 2}\n \t')
    chk.eq(r.status_code, 200, "trailing whitespace is fine")

    print("== HTTP: CORS, 405, non-HTTP bytes")
    pre = requests.options(u + "/v1/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    chk.ok(pre.status_code == 200 and pre.headers.get("Access-Control-Allow-Origin") == ORIGIN and
           "POST" in pre.headers.get("Access-Control-Allow-Methods", "") and
           pre.headers.get("Access-Control-Allow-Headers") == "authorization, content-type" and
           "Origin" in pre.headers.get("Vary", ""), f"preflight: 200 {dict(pre.headers)}")
    bad = requests.options(u + "/v1/completions", timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    chk.ok(bad.status_code == 400 and "Access-Control-Allow-Origin" not in bad.headers,
           "preflight from another origin: 400")
    r = requests.post(u + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {KEY}", "Origin": ORIGIN})
    chk.ok(r.status_code == 200 and r.headers.get("Access-Control-Allow-Origin") == ORIGIN,
           "a request from the allowed origin gets Access-Control-Allow-Origin")
    r = requests.post(u + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 2},
                      headers={"Origin": ORIGIN})
    chk.ok(r.status_code == 401 and r.headers.get("Access-Control-Allow-Origin") == ORIGIN,
           "the 401 too (so a browser can read it)")
    r = requests.post(u + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {KEY}"})
    chk.ok("Access-Control-Allow-Origin" not in r.headers, "no Origin: no CORS headers")
    r = requests.get(u + "/v1/completions", headers=c.headers(), timeout=10)
    chk.ok(r.status_code == 405 and r.headers.get("Allow") == "POST", "GET on POST: 405 Allow")
    tls_hello = bytes.fromhex("16030100c4010000c00303") + os.urandom(32) + b"\x00" * 20
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
        s.sendall(tls_hello)
        got = s.recv(100)
    chk.ok(got == b"" and time.time() - t0 < 3, f"TLS ClientHello: closed at once ({got!r})")
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
        s.sendall(b"\x00\x01\x02\x03garbage")
        got = s.recv(200)
    chk.ok(got.startswith(b"HTTP/1.1 400") and time.time() - t0 < 3,
           f"binary garbage: 400 at once ({got[:40]!r})")
    chk.eq(requests.get(u + "/health", timeout=10).status_code, 200, "router up")

    print("== ZeroMQ client API: the same strictness")
    ctx = zmq.Context()
    z = zmq_request(ctx, c, generate(rid="z-nul", prompt=b"abc\x00def", max_tokens=4,
                                     api_key=c.api_key))
    chk.ok(z[0] in ("error", "chunk-error") and z[1] == 1 and "NUL" in z[2],
           f"ZeroMQ: a NUL in the prompt is refused ({z})")
    z = zmq_request(ctx, c, generate(rid="z-top", prompt=b"def f():", max_tokens=4,
                                     top_logprobs=2, api_key=c.api_key))
    chk.ok(z[0] == "chunk-error" and z[1] == 1 and "logprobs" in z[2],
           f"ZeroMQ: top_logprobs without logprobs: INVALID_REQUEST ({z})")
    z = zmq_request(ctx, c, generate(rid="z-ok", prompt=b"def f():", max_tokens=4,
                                     api_key=c.api_key))
    chk.ok(z[0] == "chunk" and z[1] == 0, f"ZeroMQ: a good request is answered ({z})")
    ctx.destroy(linger=0)


def small_cluster(c, chk):
    u = c.url
    client = openai.OpenAI(base_url=u + "/v1", api_key="none", timeout=120, max_retries=0)
    print("== never fits: 400; full for now: 429")
    try:
        client.completions.create(model=MODEL, prompt=["def a():", "def b():"], n=2,
                                  max_tokens=2)
        chk.ok(False, "n x prompts over --max-queue raises")
    except openai.BadRequestError as e:
        chk.ok(e.status_code == 400 and e.param == "n" and "--max-queue" in e.message,
               "n x prompts over --max-queue: BadRequestError, param n")
    ctx = zmq.Context()
    z = zmq_request(ctx, c, generate(rid="z-n", prompt=b"def f():", max_tokens=2, n=3,
                                     api_key=c.api_key))
    chk.ok(z[0] == "chunk-error" and z[1] == 1, f"ZeroMQ: n over the queue: INVALID_REQUEST ({z})")
    ctx.destroy(linger=0)
    # a full tokenizer queue: big prompts keep the one tokenizer thread busy
    big = "def f(x):\n    return x * 2\n" * ((5 << 20) // 28)
    results = []

    def load():
        try:
            r = requests.post(u + "/v1/completions", timeout=120,
                              json={"prompt": big, "max_tokens": 1})
            results.append(r.status_code)
        except Exception as e:  # noqa: BLE001
            results.append(repr(e))

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    end, busy = time.time() + 60, False
    while time.time() < end and not busy:
        m = requests.get(u + "/metrics", timeout=10).text
        busy = (pc.metric(m, "pd_router_requests_tokenizing") or 0) >= 2
        time.sleep(0.02)
    got_429 = False
    if busy:
        try:
            client.completions.create(model=MODEL, prompt="def g():", max_tokens=2)
        except openai.RateLimitError as e:
            got_429 = e.status_code == 429
    chk.ok(busy and got_429, "a full tokenizer queue: RateLimitError 429")
    for t in threads:
        t.join(timeout=120)
    r = client.completions.create(model=MODEL, prompt="def g():", max_tokens=2)
    chk.eq(r.usage.completion_tokens, 2, "the same request later succeeds (429 was retryable)")
    chk.ok(all(x in (400, 429) for x in results), f"the big prompts were answered: {results}")

    print("== CORS off: OPTIONS is a 405")
    r = requests.options(u + "/v1/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    chk.ok(r.status_code == 405 and r.headers.get("Allow") == "POST" and
           "Access-Control-Allow-Origin" not in r.headers, "OPTIONS without CORS: 405 Allow POST")
    chk.eq(requests.options(u + "/nope", timeout=10).status_code, 404, "OPTIONS unknown path: 404")

    print("== a node missing: 5xx")
    c.procs["d0"].kill(signal.SIGKILL)
    end = time.time() + 20
    while time.time() < end and c.health()[1].get("decode_nodes", 1) != 0:
        time.sleep(0.1)
    try:
        client.completions.create(model=MODEL, prompt="def h():", max_tokens=8)
        chk.ok(False, "no decode node: raises")
    except openai.APIStatusError as e:
        chk.ok(500 <= e.status_code < 600 and not isinstance(e, openai.RateLimitError),
               f"no decode node: APIStatusError {e.status_code}")


# ---- the ZeroMQ client API (proto/pd.proto), with pdcluster's few lines of protobuf ----

def generate(rid, prompt, max_tokens, n=None, top_logprobs=None, api_key=None):
    """Envelope{version, generate: GenerateRequest{request_id, prompt, sampling, api_key}};
    greedy."""
    sp = b"\x0d\x00\x00\x00\x00" + pc.pb_field(6, max_tokens)  # temperature 0.0f, max_tokens
    if n:
        sp += pc.pb_field(10, n)
    if top_logprobs:
        sp += pc.pb_field(12, top_logprobs)
    g = pc.pb_field(1, rid) + pc.pb_field(3, prompt) + pc.pb_field(6, sp)
    if api_key:
        g += pc.pb_field(13, api_key)
    return pc.pb_field(1, pc.PROTOCOL_VERSION) + pc.pb_field(2, "conformance") + pc.pb_field(10, g)


def zmq_request(ctx, c, envelope, timeout_ms=30000):
    """Sends one GenerateRequest; returns ("error", code, message) for an Error envelope,
    ("chunk-error", code, message) for a GenerateChunk with error, ("chunk", 0, text) for the
    final chunk of an answered request."""
    s = c.zmq_curve(ctx.socket(zmq.DEALER))
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{c.client_port}")
    s.send(envelope)
    text = b""
    try:
        while True:
            if not s.poll(timeout_ms):
                return ("timeout", -1, "")
            env = pc.pb_decode(s.recv_multipart()[0])
            if 39 in env:
                e = pc.pb_decode(env[39][0])
                return ("error", e.get(1, [0])[0], e.get(2, [b""])[0].decode(errors="replace"))
            if 12 in env:
                ch = pc.pb_decode(env[12][0])
                if 10 in ch:
                    e = pc.pb_decode(ch[10][0])
                    return ("chunk-error", e.get(1, [0])[0],
                            e.get(2, [b""])[0].decode(errors="replace"))
                text += ch.get(4, [b""])[0]
                if ch.get(6, [0])[0]:
                    return ("chunk", 0, text.decode(errors="replace"))
    finally:
        s.close()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Cluster API test: a router (with --api-key), one prefill and one decode node on loopback.

Checks: auth (401 without or with a wrong key, /health and /metrics open); greedy output over
the cluster equals `pdctl generate` (completions and chat); streamed chunks (official openai
client, stream_options.include_usage) join to the non-streamed text and carry the same usage;
n > 1 with a seed is reproducible; stop strings cut the text; logprobs shapes; the legacy
/generate endpoint returns prompt + completion; /v1/models; every bad input gets its 4xx with
an OpenAI-style error body and the router stays up; the ZeroMQ client API (pdctl client) gives
the same greedy text; router and node metrics are present and move."""
import json
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pdcluster as pc  # noqa: E402

pc.ensure_packages(("requests", "requests"), ("openai", "openai"))
import openai  # noqa: E402
import requests  # noqa: E402

KEY = "test-key-1234"
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def __init__(self):"]


# The example keypairs of zmq_curve(7): public test keys, never to be deployed.
SERVER_PUBLIC = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
SERVER_SECRET = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6"
CLIENT_PUBLIC = "Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"
CLIENT_SECRET = "D:)Q[IlAW!ahhC2ac:9*A}h:p?([4%wOTJ%JR%cs"



def promtool(text):
    """promtool check metrics' findings on a /metrics text ("" when clean; deploy/test.sh installs
    promtool, Debian package prometheus)."""
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    return (r.stdout + r.stderr).strip() if r.returncode else ""

def main():
    a = pc.args()
    c = pc.Cluster(a.build, api_key=KEY)
    chk = pc.Checks()
    try:
        c.up(1, 1)
        run(c, a.build, chk)
    except Exception as e:  # noqa: BLE001
        import traceback
        traceback.print_exc()
        chk.ok(False, f"exception: {e!r}")
    if chk.failures:
        print(c.logs())
    chk.eq(c.down(), [], "no sanitizer reports")
    curve(a.build, chk)
    return chk.done()


def curve(build, chk):
    """Cluster traffic over CURVE: the router admits only listed node keys; KV pages travel
    encrypted to the decode node's key (announced through the router)."""
    print("== CURVE")
    c = None
    try:
        node = ["--curve-secret-key", CLIENT_SECRET, "--router-public-key", SERVER_PUBLIC]
        c = pc.Cluster(build, node_args=node, secure=False)  # its own keys
        allow = os.path.join(c.dir, "allow.txt")
        with open(allow, "w") as f:
            f.write("# nodes allowed on the cluster port\n" + CLIENT_PUBLIC + "\n")
        c.router_args += ["--curve-secret-key", SERVER_SECRET, "--curve-allow-file", allow]
        c.up(1, 1)
        intruder = c.start_node("decode", ["--curve-secret-key", "", "--node-id", "intruder"])
        r = requests.post(c.url + "/v1/completions", timeout=30,
                          json={"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0})
        ref = pc.pdctl_generate(build, prompt="def fibonacci(n):", max_tokens=24)
        chk.ok(r.status_code == 200 and r.json()["choices"][0]["text"] == ref["text"],
               "CURVE cluster: greedy text == pdctl generate")
        __import__("time").sleep(2.0)
        ids = [n["node_id"] for n in requests.get(c.url + "/cluster/nodes",
                                                   timeout=10).json()["nodes"]]
        chk.ok("intruder" not in ids and len(ids) == 2 and c.procs[intruder].alive(),
               "a node with an unlisted key never joins")
    except Exception as e:  # noqa: BLE001
        chk.ok(False, f"CURVE cluster: {e!r}")
        if c:
            print(c.logs())
    if c:
        chk.eq(c.down(), [], "CURVE cluster: no sanitizer reports")


def post(c, path, body, key=KEY, timeout=60, raw=None):
    h = {"Content-Type": "application/json"}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else json.dumps(body)
    return requests.post(c.url + path, data=data, headers=h, timeout=timeout)


def is_error_body(r):
    try:
        e = r.json()["error"]
        return isinstance(e["message"], str) and "type" in e
    except Exception:  # noqa: BLE001
        return False


def run(c, build, chk):
    u = c.url
    # ---- auth ----
    chk.eq(requests.get(u + "/v1/models", timeout=10).status_code, 401, "no key: 401")
    chk.eq(requests.get(u + "/v1/models", headers={"Authorization": "Bearer wrong"},
                        timeout=10).status_code, 401, "wrong key: 401")
    chk.eq(post(c, "/v1/completions", {"prompt": "x"}, key="test-key-123").status_code, 401,
           "key prefix: 401")
    chk.eq(post(c, "/v1/completions", {"prompt": "x"}, key=None).status_code, 401,
           "completions without key: 401")
    chk.eq(requests.get(u + "/health", timeout=10).status_code, 200, "/health open")
    chk.eq(requests.get(u + "/live", timeout=10).status_code, 200, "/live open")
    chk.eq(requests.get(u + "/metrics", timeout=10).status_code, 200, "/metrics open")
    r = requests.get(u + "/v1/models", headers=c.headers(), timeout=10)
    chk.ok(r.status_code == 200 and r.json()["data"][0]["id"] == "pycoder-12m", "/v1/models")

    client = openai.OpenAI(base_url=u + "/v1", api_key=KEY, timeout=60, max_retries=0)
    m0 = requests.get(u + "/metrics", timeout=10).text

    # ---- greedy equals pdctl generate ----
    for p in PROMPTS:
        ref = pc.pdctl_generate(build, prompt=p, max_tokens=48)
        r = client.completions.create(model="pycoder-12m", prompt=p, max_tokens=48, temperature=0)
        chk.eq(r.choices[0].text, ref["text"], f"completions greedy == pdctl ({p[:20]!r})")
        chk.eq(r.usage.completion_tokens, len(ref["output_ids"]), "completion_tokens")
        chk.eq(r.usage.prompt_tokens, len(ref["input_ids"]), "prompt_tokens")
    ref = pc.pdctl_generate(build, chat="def add(a, b):", max_tokens=40)
    r = client.chat.completions.create(model="pycoder-12m", max_tokens=40, temperature=0,
                                       messages=[{"role": "user", "content": "def add(a, b):"}])
    chk.eq(r.choices[0].message.content, ref["text"], "chat greedy == pdctl --chat")
    chk.eq(r.choices[0].message.role, "assistant", "chat role")

    # ---- streaming joins to the non-streamed text ----
    for p in PROMPTS[:2]:
        ns = client.completions.create(model="pycoder-12m", prompt=p, max_tokens=40, temperature=0)
        parts, usage, finish = [], None, None
        for ch in client.completions.create(model="pycoder-12m", prompt=p, max_tokens=40,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
            if ch.choices:
                parts.append(ch.choices[0].text)
                finish = ch.choices[0].finish_reason or finish
            if ch.usage:
                usage = ch.usage
        chk.eq("".join(parts), ns.choices[0].text, "completions stream joins to non-stream")
        chk.ok(len(parts) > 3, "stream came in several chunks")
        chk.eq(finish, ns.choices[0].finish_reason, "stream finish_reason")
        chk.ok(usage is not None and usage.completion_tokens == ns.usage.completion_tokens and
               usage.prompt_tokens == ns.usage.prompt_tokens, "stream include_usage")
    msgs = [{"role": "user", "content": "Write a sorting function"}]
    ns = client.chat.completions.create(model="pycoder-12m", messages=msgs, max_tokens=30,
                                        temperature=0)
    parts, usage, roles = [], None, 0
    for ch in client.chat.completions.create(model="pycoder-12m", messages=msgs, max_tokens=30,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            roles += ch.choices[0].delta.role == "assistant"
        if ch.usage:
            usage = ch.usage
    chk.eq("".join(parts), ns.choices[0].message.content, "chat stream joins to non-stream")
    chk.eq(roles, 1, "chat stream sends the role once")
    chk.ok(usage is not None and usage.total_tokens == ns.usage.total_tokens, "chat stream usage")

    # ---- n > 1 with a seed; temperature sampling is reproducible ----
    kw = dict(model="pycoder-12m", prompt="def sort(xs):", max_tokens=16, n=3, seed=7,
              temperature=1.0)
    r1 = client.completions.create(**kw)
    r2 = client.completions.create(**kw)
    t1 = [ch.text for ch in sorted(r1.choices, key=lambda x: x.index)]
    t2 = [ch.text for ch in sorted(r2.choices, key=lambda x: x.index)]
    chk.eq(len(t1), 3, "n=3 gives 3 choices")
    chk.eq(t1, t2, "seeded n=3 is reproducible")
    chk.ok(len(set(t1)) > 1, "the choices of n=3 differ")
    s_parts = {}
    for ch in client.completions.create(stream=True, **kw):
        for x in ch.choices:
            s_parts[x.index] = s_parts.get(x.index, "") + x.text
    chk.eq([s_parts.get(i, "") for i in range(3)], t1, "seeded n=3 stream == non-stream")
    r = client.completions.create(model="pycoder-12m", prompt=["def a():", "def b():"],
                                  max_tokens=8, temperature=0, n=2)
    chk.eq(sorted(ch.index for ch in r.choices), [0, 1, 2, 3], "2 prompts x n=2: 4 choices")

    # ---- stop strings ----
    full = client.completions.create(model="pycoder-12m", prompt="def add(a, b):", max_tokens=40,
                                     temperature=0).choices[0].text
    stop = "if"
    if stop in full:
        r = client.completions.create(model="pycoder-12m", prompt="def add(a, b):",
                                      max_tokens=40, temperature=0, stop=[stop, "zzzz"])
        t = r.choices[0].text
        chk.eq(t, full[:full.index(stop)], "stop string cuts the text")
        chk.eq(r.choices[0].finish_reason, "stop", "stop string: finish_reason stop")
        st = "".join(ch.choices[0].text for ch in client.completions.create(
            model="pycoder-12m", prompt="def add(a, b):", max_tokens=40, temperature=0,
            stop=stop, stream=True) if ch.choices)
        chk.eq(st, t, "stop string: stream == non-stream")
    else:
        chk.ok(False, f"the reference text has no {stop!r} to stop at: {full!r}")

    # a stop string that spans several tokens (held back until it is complete or cannot be)
    longer = client.completions.create(model="pycoder-12m", prompt="def fibonacci(n):",
                                       max_tokens=48, temperature=0)
    lt = longer.choices[0].text
    toks = client.completions.create(model="pycoder-12m", prompt="def fibonacci(n):",
                                     max_tokens=48, temperature=0, logprobs=0).choices[0].logprobs
    # start inside token 3 and end inside token 6: the match spans token boundaries
    off = toks.text_offset
    a0, b0 = off[3] + 1, off[6] + 1
    stop2 = lt[a0:b0]
    if len(stop2) >= 3 and lt.index(stop2) == a0:
        for stream in (False, True):
            if stream:
                got = "".join(ch.choices[0].text for ch in client.completions.create(
                    model="pycoder-12m", prompt="def fibonacci(n):", max_tokens=48,
                    temperature=0, stop=[stop2], stream=True) if ch.choices)
            else:
                got = client.completions.create(model="pycoder-12m", prompt="def fibonacci(n):",
                                                max_tokens=48, temperature=0,
                                                stop=[stop2]).choices[0].text
            chk.eq(got, lt[:a0], f"multi-token stop string {stop2!r} (stream={stream})")
        got = client.completions.create(model="pycoder-12m", prompt="def fibonacci(n):",
                                        max_tokens=48, temperature=0, stop=[stop2],
                                        extra_body={"include_stop_str_in_output": True})
        chk.eq(got.choices[0].text, lt[:b0], "include_stop_str_in_output keeps the stop string")
    else:
        chk.ok(False, f"could not pick a multi-token stop string from {lt!r}")

    # ---- logprobs ----
    r = client.completions.create(model="pycoder-12m", prompt="def f(x):", max_tokens=6,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    chk.ok(len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6 and
           all(len(t) == 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs),
           "completions logprobs shape")
    chk.eq("".join(lp.tokens), r.choices[0].text, "logprob tokens join to the text")
    r = client.chat.completions.create(model="pycoder-12m", messages=msgs, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    chk.ok(len(content) == 5 and all(len(x.top_logprobs) == 2 for x in content),
           "chat logprobs shape")

    # ---- legacy /generate (vLLM simple api_server) ----
    g = post(c, "/generate", {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0})
    ref = client.completions.create(model="pycoder-12m", prompt="def fibonacci(n):",
                                    max_tokens=24, temperature=0).choices[0].text
    chk.ok(g.status_code == 200 and g.json()["text"] == ["def fibonacci(n):" + ref],
           "/generate returns [prompt + completion]")
    g = post(c, "/generate", {"prompt": "x = ", "max_tokens": 8, "temperature": 0, "stream": True})
    pieces = [json.loads(x) for x in g.content.split(b"\0") if x.strip()]
    chk.ok(g.status_code == 200 and pieces and pieces[-1]["text"][0].startswith("x = "),
           "/generate stream: NUL-delimited JSON with the full text")

    # ---- bad inputs ----
    bad = [
        ("/v1/completions", None, b"{not json", 400, "bad JSON"),
        ("/v1/completions", None, b"[1, 2]", 400, "not an object"),
        ("/v1/completions", {"prompt": 12}, None, 400, "prompt of a wrong type"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, 400, "max_tokens string"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens 0"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, None, 400, "max_tokens < 0"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 4000}, None, 400, "over the context"),
        ("/v1/completions", {"prompt": "x " * 2100, "max_tokens": 4}, None, 400,
         "prompt over the context"),
        ("/v1/completions", {"prompt": ""}, None, 400, "empty prompt"),
        ("/v1/completions", {"prompt": []}, None, 400, "empty prompt list"),
        ("/v1/completions", None, b'{"prompt": "\xff\xfe abc"}', 400, "invalid UTF-8"),
        ("/v1/completions", {"prompt": "a\u0000b"}, None, 400, "NUL in a string"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, None, 400, "n too large"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature < 0"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "top_p 0"),
        ("/v1/completions", {"prompt": "x", "stop": 5}, None, 400, "stop of a wrong type"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, "stream not a bool"),
        ("/v1/completions", {"prompt": [5000000]}, None, 400, "token id out of range"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 500}}, None, 400,
         "logit_bias out of range"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, None, 404, "unknown model"),
        ("/v1/chat/completions", {"messages": []}, None, 400, "empty messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, None, 400, "message w/o role"),
        ("/v1/chat/completions", {"prompt": "x"}, None, 400, "chat without messages"),
        ("/generate", {"prompt": ["a"]}, None, 400, "/generate prompt list"),
        ("/v1/nope", {"prompt": "x"}, None, 404, "unknown path"),
    ]
    for path, body, raw, want, what in bad:
        r = post(c, path, body, raw=raw)
        chk.ok(r.status_code == want and is_error_body(r),
               f"{what}: {want} with an error body (got {r.status_code} {r.text[:120]!r})")
    r = requests.get(u + "/v1/completions", headers=c.headers(), timeout=10)
    chk.eq(r.status_code, 405, "GET on a POST endpoint: 405")
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    try:
        r = post(c, "/v1/completions", None, raw=big, timeout=30)
        chk.eq(r.status_code, 413, "9 MiB body: 413")
    except requests.exceptions.ConnectionError:
        chk.ok(True, "9 MiB body: refused (connection closed after 413)")
    # a raw socket that sends garbage gets a 400 and the router stays up
    with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
        s.sendall(b"BLAH / HTTP/9.9\r\n\r\n")
        chk.ok(s.recv(100).startswith(b"HTTP/1.1 "), "garbage request line answered")
    chk.eq(requests.get(u + "/health", timeout=10).status_code, 200, "router up after bad input")
    r = client.completions.create(model="pycoder-12m", prompt="def f():", max_tokens=4,
                                  temperature=0)
    chk.eq(r.usage.completion_tokens, 4, "requests still work after bad input")

    # ---- ZeroMQ client API ----
    pdctl = os.path.join(build, "tools", "pdctl")
    keyfile = os.path.join(c.dir, "api-key")
    with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(KEY + "\n")
    zargs = [pdctl, "client", "--endpoint", f"tcp://127.0.0.1:{c.client_port}"] + c.client_args()
    out = subprocess.run(zargs + ["--api-key-file", keyfile,
                                  "--prompt", "def fibonacci(n):", "--max-tokens", "48",
                                  "--temperature", "0", "--json", "--timeout", "30000"],
                         capture_output=True, timeout=60)
    nokey = subprocess.run(zargs + ["--prompt", "x", "--max-tokens", "2"],
                           capture_output=True, timeout=60)
    chk.ok(nokey.returncode == 1 and b"unauthorized" in nokey.stderr,
           "ZeroMQ client API without the API key: refused (unauthorized)")
    ref = pc.pdctl_generate(build, prompt="def fibonacci(n):", max_tokens=48)
    try:
        got = json.loads(out.stdout)["choices"][0]["text"]
    except Exception:  # noqa: BLE001
        got = out.stdout.decode(errors="replace") + out.stderr.decode(errors="replace")
    chk.eq(got, ref["text"], "ZeroMQ client API greedy == pdctl generate")

    # ---- metrics move ----
    m1 = requests.get(u + "/metrics", timeout=10).text
    for name in ["pd_router_time_to_first_token_seconds", "pd_router_inter_token_latency_seconds",
                 "pd_router_e2e_request_latency_seconds", "pd_router_queue_length",
                 "pd_router_requests_total", "pd_router_generation_tokens_total",
                 "pd_router_errors_total"]:
        chk.ok(f"# TYPE {name} " in m1, f"router metric {name}")
    chk.ok("pd_router_time_to_first_token_seconds_bucket{le=\"+Inf\"}" in m1 and
           "pd_router_time_to_first_token_seconds_count" in m1, "histogram has _bucket/_count")
    chk.ok(pc.metric(m1, "pd_router_generation_tokens_total") >
           (pc.metric(m0, "pd_router_generation_tokens_total") or 0), "generated tokens moved")
    chk.ok(pc.metric(m1, "pd_router_requests_total", {"api": "completions", "code": "200"}) >
           (pc.metric(m0, "pd_router_requests_total", {"api": "completions", "code": "200"}) or 0),
           "requests_total moved")
    chk.ok(pc.metric(m1, "pd_router_errors_total", {"kind": "invalid_request"}) > 0,
           "errors_total counts invalid requests")
    chk.ok(pc.metric(m1, "pd_router_time_to_first_token_seconds_count") >
           (pc.metric(m0, "pd_router_time_to_first_token_seconds_count") or 0), "TTFT observed")
    chk.eq(promtool(m1), "", "router metrics pass promtool check metrics")
    for node in ("p0", "d0"):
        port = c.node_metrics_port(node)
        nm = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        chk.eq(promtool(nm), "", f"{node} metrics pass promtool check metrics")
        chk.ok('pd_node_kv_transfer_seconds_bucket{le="1e-05"}' in nm,
               f"{node} KV transfer times resolve 10 us")
        chk.eq(requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code, 200,
               f"{node} /health")
        chk.eq(requests.get(f"http://127.0.0.1:{port}/live", timeout=10).status_code, 200,
               f"{node} /live")
        for name in ["pd_node_running_seqs", "pd_node_kv_cache_usage_ratio",
                     "pd_node_prefix_cache_hit_rate", "pd_node_kv_transfer_bytes_total",
                     "pd_node_kv_transfer_seconds", "pd_node_generation_tokens_total"]:
            chk.ok(f"# TYPE {name} " in nm, f"{node} metric {name}")
        chk.ok((pc.metric(nm, "pd_node_kv_transfer_bytes_total") or 0) > 0,
               f"{node} KV transfer bytes > 0")
        chk.ok((pc.metric(nm, "pd_node_generation_tokens_total") or 0) > 0,
               f"{node} generated tokens > 0")


if __name__ == "__main__":
    sys.exit(main())

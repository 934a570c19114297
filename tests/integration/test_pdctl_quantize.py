#!/usr/bin/env python3
"""`pdctl quantize` (compressed-tensors checkpoints without calibration) on the bundled
pycoder-qwen2-4m:
  - fp8: the layers in the FP8_DYNAMIC layout (e4m3 `weight`, f32 `weight_scale` [out, 1] =
    max|row| / 448); every value is the nearest e4m3 of w / scale; the folder loads and its
    perplexity equals `--quantization fp8` on the float model (the same arithmetic) and is within
    0.5% of the perplexity of llm-compressor's FP8_DYNAMIC checkpoint of the same model;
  - int4-rtn: `weight_packed` int32 [out, in/8] (value i of a word in bits 4i, offset by 8),
    `weight_scale` bf16 [out, in/128] = max|group| / 7.5 (in bf16), `weight_shape`; every value
    is round-to-nearest of w / scale clamped to [-8, 7]; perplexity between the float model's
    and 10% above it;
  - config.json's quantization_config, the tokenizer files copied, the other tensors as they
    were; bad arguments refused with a message.
The safetensors files are read here with the standard library (struct), no numpy."""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile


def read_st(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    return head, data


def raw(head, data, name):
    a, b = head[name]["data_offsets"]
    return data[a:b]


def bf16(b, i):
    return struct.unpack("<f", b"\x00\x00" + b[2 * i:2 * i + 2])[0]


def e4m3(v):
    s = -1.0 if v & 0x80 else 1.0
    e, m = (v >> 3) & 15, v & 7
    return s * (m / 8.0) * 2.0 ** -6 if e == 0 else s * (1 + m / 8.0) * 2.0 ** (e - 7)


def nearest_e4m3(x):
    """nearest e4m3 code of x (ties to the even code), saturating at 448"""
    a = min(abs(x), 448.0)
    best, bd = 0, float("inf")
    for c in range(0x7F):
        d = abs(e4m3(c) - a)
        if d < bd or (d == bd and c % 2 == 0):
            best, bd = c, d
    return (0x80 if x < 0 else 0) | best


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def to_bf16(x):
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", u))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdctl", required=True)
    ap.add_argument("--repo", required=True)
    a = ap.parse_args()
    data = os.environ.get("PD_TEST_DATA_DIR") or os.path.join(a.repo, "tests", "data")
    base = os.path.join(data, "models", "pycoder-qwen2-4m")
    ids = os.path.join(data, "quant", "eval_ids.json")
    failures = []

    def check(cond, what):
        print(("  ok   " if cond else "  FAIL ") + what)
        if not cond:
            failures.append(what)

    def ppl(model, extra=()):
        p = subprocess.run([a.pdctl, "perplexity", "--model", model, "--ids-file", ids,
                            "--context", "256", "--json", "--threads", "2"] + list(extra),
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)["perplexity"]

    bh, bd = read_st(os.path.join(base, "model.safetensors"))
    lin = "model.layers.1.mlp.down_proj"  # [256 out, 768 in]
    N, K = bh[lin + ".weight"]["shape"]
    wsrc = raw(bh, bd, lin + ".weight")
    with tempfile.TemporaryDirectory(prefix="pd-quantize-") as tmp:
        # ---- fp8
        d8 = os.path.join(tmp, "fp8")
        p = subprocess.run([a.pdctl, "quantize", "--method", "fp8", "--model", base, "--out", d8],
                           capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "quantize fp8: rc %d %s" % (p.returncode, p.stderr.strip()))
        h, d = read_st(os.path.join(d8, "model.safetensors"))
        check(h[lin + ".weight"]["dtype"] == "F8_E4M3" and h[lin + ".weight"]["shape"] == [N, K]
              and h[lin + ".weight_scale"]["dtype"] == "F32"
              and h[lin + ".weight_scale"]["shape"] == [N, 1],
              "fp8 tensors: %s %s" % (h[lin + ".weight"], h[lin + ".weight_scale"]))
        q, sc = raw(h, d, lin + ".weight"), raw(h, d, lin + ".weight_scale")
        bad = 0
        for n in range(0, N, 37):
            row = [bf16(wsrc, n * K + k) for k in range(K)]
            s = struct.unpack("<f", sc[4 * n:4 * n + 4])[0]
            if s != f32(f32(max(abs(v) for v in row)) / 448.0):
                bad += 1
            for k in range(0, K, 7):
                if q[n * K + k] != nearest_e4m3(f32(row[k] / s)):
                    bad += 1
        check(bad == 0, "fp8: scales max|row| / 448 and values the nearest e4m3 (%d wrong)" % bad)
        check(raw(h, d, "model.embed_tokens.weight") == raw(bh, bd, "model.embed_tokens.weight"),
              "fp8: embeddings copied")
        cfg = json.load(open(os.path.join(d8, "config.json")))
        qc = cfg.get("quantization_config", {})
        g = qc.get("config_groups", {}).get("group_0", {})
        check(qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "float-quantized"
              and g.get("weights", {}).get("strategy") == "channel"
              and g.get("input_activations", {}).get("dynamic") is True
              and qc.get("ignore") == ["lm_head"], "fp8 quantization_config: %s" % qc)
        check(os.path.exists(os.path.join(d8, "tokenizer.json")), "fp8: tokenizer copied")
        with open(os.path.join(data, "quant", "pycoder-qwen2-4m-llmc-fp8-dynamic-q_proj",
                               "reference.json")) as f:
            tool = json.load(f)["perplexity"]["quantized"]["ppl"]
        p8, online = ppl(d8), ppl(base, ["--quantization", "fp8"])
        check(abs(p8 - online) <= 1e-4 * online and abs(p8 - tool) <= 0.005 * tool,
              "fp8 checkpoint: perplexity %.4f, --quantization fp8 %.4f, llm-compressor "
              "FP8_DYNAMIC %.4f" % (p8, online, tool))

        # ---- int4-rtn
        d4 = os.path.join(tmp, "int4")
        p = subprocess.run([a.pdctl, "quantize", "--method", "int4-rtn", "--model", base,
                            "--out", d4], capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, "quantize int4-rtn: rc %d %s" % (p.returncode, p.stderr.strip()))
        h, d = read_st(os.path.join(d4, "model.safetensors"))
        check(h[lin + ".weight_packed"]["dtype"] == "I32"
              and h[lin + ".weight_packed"]["shape"] == [N, K // 8]
              and h[lin + ".weight_scale"]["dtype"] == "BF16"
              and h[lin + ".weight_scale"]["shape"] == [N, K // 128]
              and h[lin + ".weight_shape"]["shape"] == [2] and lin + ".weight" not in h,
              "int4 tensors: %s" % {k: v for k, v in h.items() if k.startswith(lin)})
        qp, sc = raw(h, d, lin + ".weight_packed"), raw(h, d, lin + ".weight_scale")
        check(struct.unpack("<qq", raw(h, d, lin + ".weight_shape")) == (N, K),
              "int4: weight_shape [%d, %d]" % (N, K))
        bad = 0
        for n in range(0, N, 29):
            for gi in range(K // 128):
                grp = [bf16(wsrc, n * K + gi * 128 + i) for i in range(128)]
                s = bf16(sc, n * (K // 128) + gi)
                if s != to_bf16(f32(f32(max(abs(v) for v in grp)) / 7.5)):
                    bad += 1
                for i in range(0, 128, 5):
                    k = gi * 128 + i
                    word = struct.unpack("<I", qp[4 * (n * K // 8 + k // 8):][:4])[0]
                    got = ((word >> (4 * (k % 8))) & 15) - 8
                    r = f32(grp[i] / s)
                    want = max(-8, min(7, round(r)))  # (Python rounds half to even)
                    if got != want:
                        bad += 1
        check(bad == 0, "int4: scales max|group| / 7.5 in bf16, values round(w / scale) in "
              "[-8, 7] (%d wrong)" % bad)
        cfg = json.load(open(os.path.join(d4, "config.json")))
        qc = cfg.get("quantization_config", {})
        w = qc.get("config_groups", {}).get("group_0", {}).get("weights", {})
        check(qc.get("format") == "pack-quantized" and w.get("num_bits") == 4
              and w.get("group_size") == 128 and w.get("symmetric") is True
              and w.get("strategy") == "group", "int4 quantization_config: %s" % qc)
        pf, p4 = ppl(base), ppl(d4)
        check(pf < p4 < 1.1 * pf, "int4-rtn checkpoint: perplexity %.4f (float %.4f)" % (p4, pf))

        # ---- static activation scales and FP8 KV scales (compressed-tensors input_scale and
        # kv_cache_scheme), on the fp8 folder above with scales added: fused products (q/k/v,
        # gate/up) take the largest of their modules' input scales, so a checkpoint whose
        # q/k/v scales differ gives exactly the perplexity of one with the largest everywhere;
        # KV scales of 1.0 give exactly --kv-cache-dtype fp8 without a kv_cache_scheme
        def with_scales(dst, in_scale, kv_scale):
            os.makedirs(dst)
            for f in os.listdir(d8):
                if f not in ("model.safetensors", "config.json"):
                    with open(os.path.join(d8, f), "rb") as a_, open(os.path.join(dst, f), "wb") as b_:
                        b_.write(a_.read())
            h, d = read_st(os.path.join(d8, "model.safetensors"))
            tensors = [(k, v["dtype"], v["shape"], raw(h, d, k)) for k, v in h.items()
                       if k != "__metadata__"]
            for k, _, _, _ in list(tensors):
                if k.endswith("_proj.weight") and ".layers." in k:
                    tensors.append((k[:-len("weight")] + "input_scale", "F32", [],
                                    struct.pack("<f", in_scale(k))))
            for layer in sorted({k.split(".")[2] for k, _, _, _ in tensors if ".layers." in k}):
                for nm in ("k_scale", "v_scale"):
                    tensors.append(("model.layers.%s.self_attn.%s" % (layer, nm), "F32", [1],
                                    struct.pack("<f", kv_scale)))
            size = {"F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}
            tensors.sort(key=lambda t: -size[t[1]])
            head, off = {"__metadata__": {"format": "pt"}}, 0
            for k, dt, shp, b in tensors:
                head[k] = {"dtype": dt, "shape": shp, "data_offsets": [off, off + len(b)]}
                off += len(b)
            hj = json.dumps(head).encode()
            hj += b" " * ((8 - len(hj) % 8) % 8)
            with open(os.path.join(dst, "model.safetensors"), "wb") as f:
                f.write(struct.pack("<Q", len(hj)) + hj + b"".join(t[3] for t in tensors))
            cfg = json.load(open(os.path.join(d8, "config.json")))
            q = cfg["quantization_config"]
            q["config_groups"]["group_0"]["input_activations"] = {
                "dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True,
                "type": "float"}
            q["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "strategy": "tensor",
                                    "symmetric": True, "type": "float"}
            json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))

        def mixed(k):
            return {"q_proj": 0.02, "k_proj": 0.05, "v_proj": 0.03, "gate_proj": 0.06,
                    "up_proj": 0.04}.get(k.split(".")[-2], 0.05)

        def top(k):
            return {"q_proj": 0.05, "k_proj": 0.05, "v_proj": 0.05, "gate_proj": 0.06,
                    "up_proj": 0.06}.get(k.split(".")[-2], 0.05)

        ds_mixed, ds_top = os.path.join(tmp, "static-mixed"), os.path.join(tmp, "static-top")
        ds_kv2 = os.path.join(tmp, "static-kv2")
        with_scales(ds_mixed, mixed, 1.0)
        with_scales(ds_top, top, 1.0)
        with_scales(ds_kv2, top, 2.0)
        p_mixed = ppl(ds_mixed, ["--kv-cache-dtype", "fp8"])
        p_top = ppl(ds_top, ["--kv-cache-dtype", "fp8"])
        p_kv2 = ppl(ds_kv2, ["--kv-cache-dtype", "fp8"])
        check(p_mixed == p_top and abs(p_top - p8) <= 0.05 * p8,
              "static input scales: q/k/v and gate/up take their largest (%.4f = %.4f; dynamic "
              "%.4f)" % (p_mixed, p_top, p8))
        p_kv1_default = ppl(ds_top, ["--kv-cache-dtype", "bf16"])
        check(p_top != p_kv1_default and p_kv2 != p_top and abs(p_kv2 - p_top) <= 0.01 * p_top,
              "kv_cache_scheme: KV scales change the FP8 cache's rounding (scale 1: %.4f, scale "
              "2: %.4f, bf16 cache: %.4f)" % (p_top, p_kv2, p_kv1_default))

        # ---- refusals
        for args, want in ((["--method", "int3", "--model", base, "--out", d4], "not one of"),
                           (["--method", "fp8", "--model", base, "--out", d8], "not empty"),
                           (["--method", "fp8", "--model", d4, "--out", d8 + "x"],
                            "quantized already"),
                           (["--method", "int4-rtn", "--group-size", "48", "--model", base,
                             "--out", d8 + "y"], "multiple of 32"),
                           (["--method", "fp8", "--model", base, "--out", base], "model folder")):
            p = subprocess.run([a.pdctl, "quantize"] + args, capture_output=True, text=True,
                               timeout=60)
            check(p.returncode != 0 and want in p.stderr, "refused %s: %s" % (args[:2] + args[-2:],
                                                                           p.stderr.strip()))
    print("test_pdctl_quantize: %s" % ("all checks passed" if not failures else
                                       "%d check(s) failed" % len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

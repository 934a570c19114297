#!/usr/bin/env python3
"""Copies, byte for byte, the tensors of one linear layer out of a quantized checkpoint into a
small safetensors file, with the checkpoint's config.json and reference.json beside it: the
layout tests of the formats whose whole checkpoints are too large to keep in the repository.

Usage: extract_layer0.py SRC_DIR DST_DIR [PREFIX]   (PREFIX: model.layers.0.self_attn.q_proj)
Standard library only."""
import json
import os
import shutil
import struct
import sys


def main():
    src, dst = sys.argv[1], sys.argv[2]
    prefix = sys.argv[3] if len(sys.argv) > 3 else "model.layers.0.self_attn.q_proj"
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out_h, blobs, off = {}, [], 0
        for name, t in sorted(header.items()):
            if name == "__metadata__" or not name.startswith(prefix + "."):
                continue
            a, b = t["data_offsets"]
            f.seek(base + a)
            blob = f.read(b - a)
            out_h[name] = {"dtype": t["dtype"], "shape": t["shape"],
                           "data_offsets": [off, off + len(blob)]}
            blobs.append(blob)
            off += len(blob)
    if not out_h:
        sys.exit("no tensor starts with %s." % prefix)
    hj = json.dumps(out_h, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for blob in blobs:
            f.write(blob)
    for name in ("config.json", "reference.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


if __name__ == "__main__":
    main()

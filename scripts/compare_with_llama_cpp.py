#!/usr/bin/env python3
"""Diff pdmesh's forward pass against llama.cpp's, tensor by tensor.

Runs one golden chat prompt through llama.cpp (via llama-cpp-python's eval
callback, which hands over every intermediate tensor) and through
`pdmesh-engine generate` with PDMESH_DEBUG_DUMP_DIR set, then prints, for
each layer and tensor, the share of bit-identical values and the largest
difference. With --decode both sides also run one decode step and the
decode step is compared instead of the prefill.

Needs llama-cpp-python 0.3.36 built for AVX2 only (the golden file's
machine), e.g.:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_INT8=OFF" \
    pip install llama-cpp-python==0.3.36
  python3 scripts/compare_with_llama_cpp.py --model MODEL.gguf [--prompt 0] [--decode]
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import llama_cpp as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_inp",
         "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"]


class Tensor(ctypes.Structure):  # struct ggml_tensor (ggml.h of this version)
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def llama_cpp_tensors(model, ids, decode):
    got, recording = {}, [not decode]

    def cb(ptr, ask, _ud):
        t = Tensor.from_address(ptr)
        if ask or not recording[0] or t.type != 0 or not t.data:
            return True
        ne, nb = list(t.ne), list(t.nb)
        rows = []
        for i3 in range(ne[3]):
            for i2 in range(ne[2]):
                for i1 in range(ne[1]):
                    off = t.data + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]
                    if nb[0] == 4:
                        rows.append(np.frombuffer((ctypes.c_char * (4 * ne[0])).from_address(off), dtype=np.float32).copy())
                    else:
                        rows.append(np.array([ctypes.c_float.from_address(off + i * nb[0]).value for i in range(ne[0])], np.float32))
        got[t.name.decode()] = np.concatenate(rows)
        return True

    L.llama_backend_init()
    m = L.llama_model_load_from_file(model.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 2048, 512, 512, 2, 2
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cbf = L.ggml_backend_sched_eval_callback(cb)
    cp.cb_eval = cbf
    ctx = L.llama_init_from_model(m, cp)
    toks = (L.llama_token * len(ids))(*ids)  # kept alive: the batch points into it
    assert L.llama_decode(ctx, L.llama_batch_get_one(toks, len(ids))) == 0
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(L.llama_vocab_n_tokens(L.llama_model_get_vocab(m)),))
    first = int(np.argmax(logits))
    if decode:
        recording[0] = True
        one = (L.llama_token * 1)(first)
        assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
    return got, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=0, help="index into the golden file")
    ap.add_argument("--decode", action="store_true", help="compare the first decode step")
    ap.add_argument("--layers", type=int, default=30)
    a = ap.parse_args()
    golden = json.load(open(os.path.join(ROOT, "services/engine/tests/data/smollm2.golden.json")))
    rec = golden[a.prompt]
    ref, _first = llama_cpp_tensors(a.model, rec["chat_ids"], a.decode)
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PDMESH_DEBUG_DUMP_DIR=d)
        subprocess.run([os.path.join(ROOT, "target/release/pdmesh-engine"), "generate", "--chat", "--model", a.model,
                        "--text", rec["prompt"], "--max-tokens", "2" if a.decode else "1"],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        worst = 1.0
        for layer in range(a.layers):
            line = []
            for n in NAMES:
                key = f"{n}-{layer}"
                p = os.path.join(d, key + ".f32")
                if key not in ref or not os.path.exists(p):
                    continue
                ours = np.fromfile(p, dtype=np.float32)
                theirs = ref[key]
                if ours.size > theirs.size and ours.size % theirs.size == 0:
                    ours = ours[-theirs.size:]  # llama.cpp keeps only the output row in the last layer
                if ours.size != theirs.size:
                    line.append(f"{n}: size {ours.size} vs {theirs.size}")
                    continue
                same = float(np.mean(ours == theirs))
                worst = min(worst, same)
                line.append(f"{n} {same:.3f}" + ("" if same == 1.0 else f" (max diff {np.abs(ours - theirs).max():.2g})"))
            print(f"layer {layer}: " + ", ".join(line))
    print("bit-identical everywhere" if worst == 1.0 else f"lowest identical share: {worst:.3f}")
    return 0 if worst == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())

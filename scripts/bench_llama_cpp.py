#!/usr/bin/env python3
"""The `pdmesh-engine bench` measurements, taken on llama.cpp (through
llama-cpp-python's C API) so both engines can be run side by side:
prefill of one 512-token prompt, and decode steps at batch 1/8/32 over
128-token prompts (as llama-batched-bench does). Prints JSON.

  python3 scripts/bench_llama_cpp.py --model MODEL.gguf [--threads 2]
"""
import argparse
import json
import time

import llama_cpp as L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda *_: None)  # kept alive for the C side
    L.llama_log_set(quiet, None)
    model = L.llama_model_load_from_file(a.model.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(model)
    text = ("The history of computing is a story of people finding new ways to make machines do arithmetic, "
            "remember what they computed, and share it with each other. ") * 40
    buf = (L.llama_token * 4096)()
    n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 4096, False, False)
    toks = list(buf[:n])

    cp = L.llama_context_default_params()
    cp.n_ctx = 8192
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = max(batches)
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if hasattr(cp, "kv_unified"):
        cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, cp.n_seq_max)

    def submit(items):
        # items: (token, pos, seq, want_logits)
        for i, (t, p, s, lg) in enumerate(items):
            batch.token[i] = t
            batch.pos[i] = p
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = s
            batch.logits[i] = lg
        batch.n_tokens = len(items)
        assert L.llama_decode(ctx, batch) == 0

    def prefill(seq, prompt):
        for c in range(0, len(prompt), 512):
            chunk = prompt[c:c + 512]
            submit([(t, c + i, seq, c + i == len(prompt) - 1) for i, t in enumerate(chunk)])

    runs = []
    for r in range(4):
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        prefill(0, toks[:a.prefill_tokens])
        if r > 0:
            runs.append(time.perf_counter() - t0)
    runs.sort()
    out = {"engine": "llama.cpp (llama-cpp-python 0.3.36)", "threads": a.threads,
           "prefill_tokens": a.prefill_tokens, "prefill_tokens_per_s": a.prefill_tokens / runs[len(runs) // 2],
           "prefill_runs_s": runs, "decode_prompt_tokens": 128, "decode": []}
    for b in batches:
        L.llama_memory_clear(mem, True)
        for s in range(b):
            prefill(s, toks[s:s + 128])
        pos = 128
        submit([(toks[0], pos, s, True) for s in range(b)])  # warm-up step
        t0 = time.perf_counter()
        for k in range(a.steps):
            pos += 1
            submit([(toks[k + 1], pos, s, True) for s in range(b)])
        dt = time.perf_counter() - t0
        out["decode"].append({"batch": b, "steps": a.steps, "tokens_per_s": b * a.steps / dt, "ms_per_step": dt * 1000 / a.steps})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

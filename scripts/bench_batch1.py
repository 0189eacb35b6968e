#!/usr/bin/env python3
"""Batch-1 decode and prefill 512, pdmesh-engine bench against llama-bench,
interleaved (llama.cpp, pdmesh, llama.cpp, ...), same GGUF, same threads.
Batch 1 is measured at two context depths: from an empty context
(llama-bench tg128, pdmesh --decode-prompt 1) and from 128 tokens
(llama-bench tg128 -d 128, pdmesh --decode-prompt 128).
Prints one JSON line per run and a summary with the ratios (issue 30's
report: docs/benchmarks/engine-batch1-<date>.md).

    python3 scripts/bench_batch1.py --llama-bench PATH [--rounds 3] [--threads 2]
        [--kernels auto|avx2|scalar] [--label NAME] [--model smollm2|gemma3-270m]

--kernels caps pdmesh's kernels (PDMESH_KERNELS); build llama-bench to
match (for avx2: -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_AVX512=OFF). Needs target/release/pdmesh-engine and
the model (pdmesh-engine fetch).
"""
import argparse
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "target", "release", "pdmesh-engine")


def cpu_flags():
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            keep = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                    "avx_vnni", "amx_tile", "amx_int8"]
            return [f for f in keep if f in have]
    return []


def llama(bench, model, threads):
    def run(*args):
        out = subprocess.run([bench, "-m", model, "-t", str(threads), "-r", "3", "-o", "json", *args],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)
    pp = run("-p", "512", "-n", "0")[0]["avg_ts"]
    tg = {r["n_depth"]: r["avg_ts"] for r in run("-p", "0", "-n", "128", "-d", "0,128")}
    return {"prefill_512": pp, "batch_1": tg[0], "batch_1_depth_128": tg[128]}


def pdmesh(model, threads, kernels):
    env = dict(os.environ, PDMESH_KERNELS=kernels)

    def run(prefill, depth):
        out = subprocess.run([ENGINE, "bench", "--model", model, "--threads", str(threads), "--batches", "1", "--steps", "128",
                              "--prefill-tokens", str(prefill), "--decode-prompt", str(depth)],
                             capture_output=True, text=True, check=True, env=env).stdout
        return json.loads(out)
    v = run(512, 1)
    deep = run(32, 128)
    return {"prefill_512": v["prefill_tokens_per_s"], "batch_1": v["decode"][0]["tokens_per_s"],
            "batch_1_depth_128": deep["decode"][0]["tokens_per_s"],
            "backend": v["backend"], "kernel_batch_1": dict(v["kernels"]).get(1),
            "read_gb_per_s": v["read_gb_per_s"], "share_of_floor": v["batch1_share_of_floor"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--label", default="")
    ap.add_argument("--model", default="smollm2", help="catalogue name (smollm2, gemma3-270m)")
    a = ap.parse_args()
    model = subprocess.run([ENGINE, "fetch", a.model], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    ratios = {"batch_1": [], "batch_1_depth_128": [], "prefill_512": []}
    for r in range(a.rounds):
        ll = llama(a.llama_bench, model, a.threads)
        print(json.dumps({"round": r, "engine": "llama.cpp", **ll}), flush=True)
        pd = pdmesh(model, a.threads, a.kernels)
        print(json.dumps({"round": r, "engine": "pdmesh", **pd}), flush=True)
        for k in ratios:
            ratios[k].append(round(pd[k] / ll[k], 3))
    print(json.dumps({"label": a.label, "kernels": a.kernels, "threads": a.threads, "cpu_flags": cpu_flags(),
                      "ratio_pdmesh_over_llama_cpp": ratios}))


if __name__ == "__main__":
    main()

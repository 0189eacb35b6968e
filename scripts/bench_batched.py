#!/usr/bin/env python3
"""Batched decode, pdmesh-engine bench against llama-batched-bench,
interleaved (llama.cpp, pdmesh, llama.cpp, ...), same GGUF, same threads:
sequences of 128 prompt tokens, 32 decode steps, at batch 8 and 32
(llama-batched-bench's S_TG column against pdmesh's decode tokens/s).
Prints one JSON line per run and a summary with the ratios.

    python3 scripts/bench_batched.py --llama-batched-bench PATH [--model gemma3-270m] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = os.path.join(ROOT, "target", "release", "pdmesh-engine")
BATCHES = [8, 32]


def llama(bench, model, threads):
    out = subprocess.run([bench, "-m", model, "-t", str(threads), "-c", "8192", "-b", "2048", "-ub", "512",
                          "-npp", "128", "-ntg", "32", "-npl", ",".join(map(str, BATCHES)), "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return {f"batch_{r['pl']}": r["speed_tg"] for r in rows}


def pdmesh(model, threads):
    out = subprocess.run([ENGINE, "bench", "--model", model, "--threads", str(threads), "--batches",
                          ",".join(map(str, BATCHES)), "--decode-prompt", "128", "--steps", "32", "--prefill-tokens", "32"],
                         capture_output=True, text=True, check=True).stdout
    return {f"batch_{d['batch']}": d["tokens_per_s"] for d in json.loads(out)["decode"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-batched-bench", required=True)
    ap.add_argument("--model", default="gemma3-270m", help="catalogue name")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = subprocess.run([ENGINE, "fetch", a.model], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    runs = {"llama.cpp": [], "pdmesh": []}
    for r in range(a.rounds):
        for name, f in (("llama.cpp", lambda: llama(a.llama_batched_bench, model, a.threads)), ("pdmesh", lambda: pdmesh(model, a.threads))):
            runs[name].append(f())
            print(json.dumps({"round": r + 1, "engine": name, **runs[name][-1]}), flush=True)
    keys = runs["pdmesh"][0].keys()
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in runs.items()}
    print(json.dumps({"model": a.model, "threads": a.threads, "median": med,
                      "ratio_pdmesh_over_llama_cpp": {k: round(med["pdmesh"][k] / med["llama.cpp"][k], 3) for k in keys}}))


if __name__ == "__main__":
    main()

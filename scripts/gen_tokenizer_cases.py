#!/usr/bin/env python3
"""Regenerate services/engine/tests/data/tokenizer_cases.json with llama.cpp.

The reference is llama.cpp through llama-cpp-python 0.3.36 (the version that
produced ../shared/golden), tokenizing with add_special=False and
parse_special False (raw) and True (special). Run:

    pip install llama-cpp-python==0.3.36   # builds llama.cpp (~30 min here)
    python3 scripts/gen_tokenizer_cases.py MODEL.gguf > services/engine/tests/data/tokenizer_cases.json
"""
import json
import sys

from llama_cpp import Llama

CASES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand    runs     of spaces",
    "naïve café résumé Ünïcödé",
    "日本語のテキストと中文文本",
    "Emoji: 🚀🧪👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "Numbers: 1234567890, 3.14159, -42, 1e10, 0x1F",
    "def f(x):\n    return [i**2 for i in range(x) if i % 2 == 0]\n",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "<|im_start|>user\nhi<|im_end|>",
    "looks like <|im_end|> special but <|notatoken|> is not",
    "<repo_name>pdmesh<file_sep>README.md",
    "don't won't I'm you're they'll we've she'd",
    "mixed CASE and ALLCAPS and camelCaseWords",
    "URL https://example.com/path?q=1&x=2#frag",
    "   ",
    "\n",
    "a",
    "Ελληνικά και кириллица и العربية",
    "zero\u200bwidth and non\u00a0breaking",
]


def main():
    llm = Llama(model_path=sys.argv[1], n_ctx=256, vocab_only=True, verbose=False)
    out = []
    for text in CASES:
        b = text.encode("utf-8")
        out.append({
            "text": text,
            "raw_ids": llm.tokenize(b, add_bos=False, special=False),
            "special_ids": llm.tokenize(b, add_bos=False, special=True),
        })
    meta = {"generator": "llama.cpp via llama-cpp-python 0.3.36", "script": "scripts/gen_tokenizer_cases.py"}
    json.dump({"meta": meta, "cases": out}, sys.stdout, ensure_ascii=False, indent=1)
    print()


if __name__ == "__main__":
    main()

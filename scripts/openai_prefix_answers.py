#!/usr/bin/env python3
"""Greedy answers of a fixed set of conversations, through the official
`openai` client, with the cached-token counts the server reports.

Every golden prompt is asked twice (not streamed, then streamed), and each
of three two-turn chats is asked turn by turn, its second turn twice. With
a prefix cache the repeats and second turns reuse earlier KV; the tests run
this against a mesh with the cache on and one with it off and compare
(services/meshctl/tests/prefix.rs). Prints one JSON object.

    python3 scripts/openai_prefix_answers.py --base-url http://127.0.0.1:8080/v1 \
        --golden services/engine/tests/data/smollm2.golden.json
"""
import argparse
import json
import sys

import openai


def cached(usage):
    details = getattr(usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) if details is not None else None


def ask(client, model, messages, max_tokens, stream):
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        return {"text": r.choices[0].message.content, "prompt_tokens": r.usage.prompt_tokens, "cached_tokens": cached(r.usage)}
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
    return {"text": "".join(parts), "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached(usage)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=120)
    golden = json.load(open(a.golden))
    out = {"golden": [], "chats": []}
    for g in golden:
        messages = [{"role": "user", "content": g["prompt"]}]
        first = ask(client, a.model, messages, 24, stream=False)
        again = ask(client, a.model, messages, 24, stream=True)
        out["golden"].append({"prompt": g["prompt"], "first": first, "again": again})
    for g in golden[:3]:
        turn1 = [{"role": "user", "content": g["prompt"]}]
        a1 = ask(client, a.model, turn1, 24, stream=False)
        turn2 = turn1 + [{"role": "assistant", "content": a1["text"]},
                         {"role": "user", "content": "Now say the same in other words, briefly."}]
        a2 = ask(client, a.model, turn2, 24, stream=True)
        a2_again = ask(client, a.model, turn2, 24, stream=False)
        out["chats"].append({"turn1": a1, "turn2": a2, "turn2_again": a2_again})
    out["openai_version"] = openai.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

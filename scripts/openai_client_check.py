#!/usr/bin/env python3
"""Drive the pdmesh gateway with the official `openai` Python client.

Checks chat and completions, streaming and not, /v1/models, and that errors
arrive as the client's typed exceptions. Greedy chat output must equal the
golden (llama.cpp) text. Exits non-zero with a message on the first failure.

With --api-key (the gateway started with --api-keys-file KEYS, holding
that key with concurrency=2 and --limited-key with rpm=1), it also checks
401 without a key or with a wrong one, 429 with Retry-After over a key's
limits, and that removing the key from KEYS revokes it within seconds.

    python3 scripts/openai_client_check.py --base-url http://127.0.0.1:8080/v1 \
        --golden services/engine/tests/data/smollm2.golden.json
"""
import argparse
import json
import sys
import time
import urllib.error
import urllib.request

import openai


def check_keys(a, client) -> dict:
    """401, 429 and revocation, as the official client sees them."""
    msgs = [{"role": "user", "content": "hi"}]
    # No Authorization header at all (the client always sends one).
    req = urllib.request.Request(a.base_url + "/models")
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("a request without a key was served")
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
        assert e.code == 401 and body["error"]["code"] == "missing_api_key", (e.code, body)
    wrong = openai.OpenAI(base_url=a.base_url, api_key="not-a-key", max_retries=0, timeout=120)
    try:
        wrong.chat.completions.create(model=a.model, messages=msgs, max_tokens=1)
        raise AssertionError("a wrong key was served")
    except openai.AuthenticationError as e:
        assert e.status_code == 401 and "invalid" in str(e), e
    # Requests per minute: the limited key's second request is refused.
    limited = openai.OpenAI(base_url=a.base_url, api_key=a.limited_key, max_retries=0, timeout=120)
    limited.chat.completions.create(model=a.model, messages=msgs, max_tokens=1)
    try:
        limited.chat.completions.create(model=a.model, messages=msgs, max_tokens=1)
        raise AssertionError("a key over its requests per minute was served")
    except openai.RateLimitError as e:
        retry = int(e.response.headers["retry-after"])
        assert 1 <= retry <= 60, retry
    # Concurrency: two streams held open, the third request is refused.
    time.sleep(0.5)
    held = [client.chat.completions.create(model=a.model, messages=msgs, max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True}) for _ in range(2)]
    for s in held:
        next(iter(s))
    try:
        client.chat.completions.create(model=a.model, messages=msgs, max_tokens=1)
        raise AssertionError("a key over its concurrency was served")
    except openai.RateLimitError as e:
        assert "in flight" in str(e), e
    for s in held:
        s.close()
    # Revocation: the key leaves the file, and is refused within seconds.
    with open(a.keys_file, "w") as f:
        f.write(f"{a.limited_key} rpm=1\n")
    t0 = time.time()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        assert time.time() - t0 < 10, "the removed key still works after 10 s"
        time.sleep(0.2)
    return {"revoked_after_s": round(time.time() - t0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--golden", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--limited-key")
    ap.add_argument("--keys-file")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    golden = json.load(open(a.golden))

    models = [m.id for m in client.models.list()]
    assert models == [a.model], models

    # Chat, not streamed: the golden prompt whose greedy output ends at EOS.
    item = next(g for g in golden if g["stopped_at_eos"])
    r = client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": item["prompt"]}], temperature=0, max_tokens=64)
    text = r.choices[0].message.content
    assert text == item["greedy_text"], (text, item["greedy_text"])
    assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(item["chat_ids"]), r.usage
    assert r.usage.completion_tokens == len(item["greedy_ids"]), (r.usage, len(item["greedy_ids"]))

    # Chat, streamed: the same text, in pieces, with usage at the end.
    parts, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": item["prompt"]}], temperature=0, max_tokens=64, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(parts) == item["greedy_text"], ("".join(parts), item["greedy_text"])
    assert len(parts) > 1, "streaming delivered everything in one piece"
    assert finish == "stop", finish
    assert usage is not None and usage.completion_tokens == len(item["greedy_ids"]), usage

    # Completions, not streamed and streamed: equal, cut by max_tokens.
    r = client.completions.create(model=a.model, prompt="The capital of France is", temperature=0, max_tokens=8)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "length", r.choices[0].finish_reason
    assert r.usage.completion_tokens == 8, r.usage
    assert "Paris" in text, text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=a.model, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True) if c.choices)
    assert streamed == text, (streamed, text)

    # Errors arrive as the client's typed exceptions.
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), e
    try:
        client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
        raise AssertionError("max_tokens 0 accepted")
    except openai.BadRequestError as e:
        assert "max_tokens" in str(e), e
    try:
        client.chat.completions.create(model=a.model, messages=[])
        raise AssertionError("empty messages accepted")
    except openai.BadRequestError as e:
        assert "messages" in str(e), e
    keys = check_keys(a, client) if a.keys_file else None
    print(json.dumps({"openai_version": openai.__version__, "keys": keys, "checks": "passed"}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"openai client check failed: {e}", file=sys.stderr)
        sys.exit(1)
